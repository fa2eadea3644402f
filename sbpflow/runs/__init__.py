"""What every layer says of a run: how it runs (``options``), where it is (``states``), why it failed on numbers (``numerics``) and what a traced job starts from (``bound_values``)."""

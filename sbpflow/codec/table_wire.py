"""The wire form of the table sources (``protos/sbpflow/v1/data_table.proto``), registered in
:data:`sbpflow.codec.formats.FORMATS` at import (``data_wire`` imports this module)."""

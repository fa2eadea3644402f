"""The wire form of the text sources (``protos/sbpflow/v1/data_text.proto``), registered in
:data:`sbpflow.codec.formats.FORMATS` at import (``data_wire`` imports this module)."""

"""The wire form of the image sources (``protos/sbpflow/v1/data_image.proto``), registered in
:data:`sbpflow.codec.formats.FORMATS` at import (``data_wire`` imports this module)."""

"""The core's values to and from the wire protobufs (``sbpflow.v1``), both ways: protobufs stop here."""

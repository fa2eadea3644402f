"""The wire form of the text sources (``protos/sbpflow/v1/data_text.proto``), registered in
:data:`sbpflow.codec.formats.FORMATS` at import (``data_wire`` imports this module)."""

from __future__ import annotations

from typing import Any, Literal

from sbpflow.codec.formats import FileFormat, register
from sbpflow.codec.values import WireError
from sbpflow.data.text import TextFileSource, TextMlm
from sbpflow.v1 import data_text_pb2 as pb

SPECIALS: tuple[Literal["cls_id"], Literal["sep_id"], Literal["mask_id"]] = ("cls_id", "sep_id", "mask_id")


def text_to_proto(s: TextFileSource) -> pb.TextFiles:
    m = pb.TextFiles(paths=s.paths, tokenizer=s.tokenizer, seq_len=s.seq_len)
    if s.mlm is not None:
        m.mlm.mask_prob = s.mlm.mask_prob
        for k in SPECIALS:
            if (v := getattr(s.mlm, k)) is not None:
                setattr(m.mlm, k, v)
    return m


def text_from_proto(m: pb.TextFiles, common: dict[str, Any]) -> TextFileSource:
    """The source of ``m``; its values' bounds are ``TextFileSource.check_limits`` (at Submit)."""
    if not m.paths:
        raise WireError("TextFiles.paths is empty; give a text file or a glob pattern")
    if not m.tokenizer:
        raise WireError("TextFiles.tokenizer is empty; give 'bytes' or the path of a tokenizer.json")
    mlm = None
    if m.HasField("mlm"):
        specials = {k: getattr(m.mlm, k) for k in SPECIALS if m.mlm.HasField(k)}
        mlm = TextMlm(mask_prob=m.mlm.mask_prob, **specials)
    return TextFileSource(paths=tuple(m.paths), tokenizer=m.tokenizer, seq_len=m.seq_len, mlm=mlm, **common)


register(FileFormat("text_files", TextFileSource, text_to_proto, text_from_proto))

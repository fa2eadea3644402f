"""``sf.data``: what feeds a job's input tensors, as plain data, and the readers that serve a rank.

The sources a user names (``from sbpflow.data import SyntheticSource``) are re-exported here from
``sources``, which defines them; the rest of sbpflow imports them from there. Like ``sf.nn``, this
package is the user's import path, so its ``__init__`` is more than a docstring.

    sources  ArraySource, ArrayFileSource, TokenFileSource, SyntheticSource, FileSource (the base of
             every file format), and the readers of a rank
    access   which files a source may open (the read-time half of the server's data roots)
    checks   a source's own values against sbpflow.limits.Limits (at Submit, before any file is opened)
    text     TextFileSource: text files tokenized (bytes or a tokenizers file) and packed; BERT MLM;
             tokenize: the tokenizers and the token cache
    images   ImageFileSource: an image folder or tar shards (image_index lists them, image_transforms crops)
    tables   TableFileSource: Parquet, Arrow, CSV, JSON lines;   columns: TableField, columns -> fields
    clicks   click-log samples for Wide & Deep;   mlm: masked-language-model samples for BERT
    corpus   the Python standard library's own sources as a text corpus (``sf.corpus``)
"""

from sbpflow.data.columns import TableField
from sbpflow.data.images import ImageFileSource, image_source
from sbpflow.data.sources import (
    ArrayFileSource,
    ArraySource,
    DataError,
    DataField,
    DataSource,
    FileSource,
    SyntheticSource,
    TokenFileSource,
)
from sbpflow.data.tables import TableFileSource
from sbpflow.data.text import TextFileSource, TextMlm

__all__ = [
    "ArrayFileSource",
    "ArraySource",
    "DataError",
    "DataField",
    "DataSource",
    "FileSource",
    "ImageFileSource",
    "SyntheticSource",
    "TableField",
    "TableFileSource",
    "TextFileSource",
    "TextMlm",
    "TokenFileSource",
    "image_source",
]

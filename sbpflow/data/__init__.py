"""``sf.data``: what feeds a job's input tensors, as plain data, and the readers that serve a rank.

The sources a user names (``from sbpflow.data import SyntheticSource``) are re-exported here from
``sources``, which defines them; the rest of sbpflow imports them from there. Like ``sf.nn``, this
package is the user's import path, so its ``__init__`` is more than a docstring.

    sources  ArraySource, ArrayFileSource, TokenFileSource, SyntheticSource, and the readers of a rank
    access   which files a source may open (the read-time half of the server's data roots)
    clicks   click-log samples for Wide & Deep;   mlm: masked-language-model samples for BERT
    corpus   the Python standard library's own sources as a text corpus (``sf.corpus``)
"""

from sbpflow.data.sources import (
    ArrayFileSource,
    ArraySource,
    DataError,
    DataField,
    DataSource,
    SyntheticSource,
    TokenFileSource,
)

__all__ = [
    "ArrayFileSource",
    "ArraySource",
    "DataError",
    "DataField",
    "DataSource",
    "SyntheticSource",
    "TokenFileSource",
]

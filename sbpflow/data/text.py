"""Text files as a data source: tokenized once per corpus, packed into samples, read a rank's rows at a time.

    TextFileSource(paths=("corpus/*.txt",), tokenizer="bytes", seq_len=256, batch_size=32, shuffle=True)

The files (glob patterns expand to their sorted matches) are documents, joined with the tokenizer's
end-of-text token where it has one, and tokenized once into a memory-mapped cache
(:mod:`sbpflow.data.tokenize`). Sample ``i`` is the window of ``seq_len`` tokens at ``i * seq_len``:
``tokens``, and ``targets`` the same window shifted by one, as :class:`~sbpflow.data.sources.TokenFileSource`
gives. With ``mlm`` (:class:`TextMlm`) a sample is BERT's masked-language-model sample instead:
``[CLS] window [SEP]`` with a fraction of the window masked 80 / 10 / 10, each draw a pure function of
(seed, epoch, sample id), so every layout reads the same samples and each epoch masks afresh.
"""

from __future__ import annotations

import glob
import itertools
import threading
from dataclasses import dataclass

import numpy as np

from sbpflow.data.sources import DataError, DataField, FileSource, TokenFileSource
from sbpflow.data.tokenize import BYTES, SPECIAL_NAMES, Tokenizer, load_tokenizer, token_cache
from sbpflow.dtype import DType
from sbpflow.limits import LIMITS, Limits, check_count, check_float, check_int, check_name
from sbpflow.random import RandomKey, row_offsets, tensor_rng_id, uniform_at

MASKED, RANDOM = 0.8, 0.9  # BERT: a chosen position becomes [MASK] below 0.8, a random token below 0.9


@dataclass(frozen=True, kw_only=True)
class TextMlm:
    """BERT's masking of text samples: ``mask_prob`` of each window's positions predicted; the special ids
    (None: the tokenizer's ``[CLS]``/``<s>``, ``[SEP]``/``</s>``, ``[MASK]``/``<mask>``; under ``"bytes"``
    256, 257 and 258)."""

    mask_prob: float = 0.15
    cls_id: int | None = None
    sep_id: int | None = None
    mask_id: int | None = None


@dataclass(frozen=True, kw_only=True)
class TextFileSource(FileSource):
    """Text files or glob patterns, tokenized by ``tokenizer`` (``"bytes"`` or a tokenizer.json path) and
    packed into samples of ``seq_len`` tokens (module docstring)."""

    paths: tuple[str, ...] = ()
    tokenizer: str = BYTES
    seq_len: int = 0
    mlm: TextMlm | None = None

    def __post_init__(self) -> None:
        paths = (self.paths,) if isinstance(self.paths, str) else tuple(self.paths)
        object.__setattr__(self, "paths", paths)  # a str or a list is taken as the user means it

    # ---- what the server checks at Submit ----------------------------------------------------------

    def check_limits(self, limits: Limits) -> None:
        check_count("job.data.text_files.paths", self.paths, limits)
        if not self.paths:
            raise DataError("job.data.text_files.paths is empty; give a text file or a glob pattern")
        for i, p in enumerate(self.paths):
            check_name(f"job.data.text_files.paths[{i}]", p, limits, chars=limits.path_chars)
        check_name("job.data.text_files.tokenizer", self.tokenizer, limits, chars=limits.path_chars)
        least = 3 if self.mlm is not None else 1  # [CLS] a token [SEP]
        check_int("job.data.text_files.seq_len", self.seq_len, least, limits.numel)
        if self.mlm is not None:
            check_float("job.data.text_files.mlm.mask_prob", self.mlm.mask_prob, 1e-9, 1.0)
            for k in ("cls_id", "sep_id", "mask_id"):
                if (v := getattr(self.mlm, k)) is not None:
                    check_int(f"job.data.text_files.mlm.{k}", v, 0, limits.int_attr)

    def file_paths(self) -> list[tuple[str, str]]:
        """Each path or pattern as given (a pattern resolves by its folders: ``..`` and symlinks there are
        followed) and the tokenizer file. A pattern is not expanded here: at Submit that would be work
        proportional to a folder the job may not read; each match is checked as a worker opens it."""
        out = [("text file", p) for p in self.paths]
        return out if self.tokenizer == BYTES else [*out, ("tokenizer file", self.tokenizer)]

    # ---- what a worker reads -------------------------------------------------------------------------

    def files(self) -> list[str]:
        """The files read, in order; a pattern that matches nothing is refused, naming it."""
        out = []
        for p in self.paths:
            if not glob.has_magic(p):
                out.append(p)
                continue
            matches = sorted(itertools.islice(glob.iglob(p), LIMITS.count + 1))
            if not matches:
                raise DataError(f"text file pattern {p!r} matches no file; check the folder and the pattern")
            if len(matches) > LIMITS.count:
                raise DataError(f"text file pattern {p!r} matches over {LIMITS.count} files; narrow it")
            out += matches
        return out

    def loaded_tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer, self._file, self.allowed_roots)

    @property
    def vocab_size(self) -> int:
        """Ids a model must embed: the tokenizer's vocabulary (and, under ``"bytes"`` with mlm, the 3
        special ids after it)."""
        tok = self.loaded_tokenizer()
        return tok.vocab_size + (3 if self.mlm is not None and tok.hf is None else 0)

    def _tokens(self) -> np.ndarray:
        key = (self.paths, self.tokenizer, self.allowed_roots)
        with _LOCK:
            if key in _TOKENS:
                return _TOKENS[key]
        tokens = token_cache(self.files(), self.loaded_tokenizer(), self._file)
        with _LOCK:
            return _TOKENS.setdefault(key, tokens)

    @property
    def _window(self) -> int:
        """Tokens of the text per sample: ``seq_len`` (and one more, the last target), or ``seq_len - 2``
        under mlm (between [CLS] and [SEP])."""
        return self.seq_len - 2 if self.mlm is not None else self.seq_len

    @property
    def num_samples(self) -> int:
        n = len(self._tokens())
        return n // self._window if self.mlm is not None else (n - 1) // self.seq_len

    def fields(self) -> tuple[DataField, ...]:
        if self.mlm is None:
            return (
                DataField("tokens", (self.seq_len,), DType.int64),
                DataField("targets", (self.seq_len,), DType.int64),
            )
        p = self.predictions
        return (
            DataField("tokens", (self.seq_len,), DType.int64),
            DataField("token_types", (self.seq_len,), DType.int64),
            DataField("positions", (p,), DType.int64),
            DataField("labels", (p,), DType.int64),
        )

    @property
    def predictions(self) -> int:
        """Positions masked per sample under mlm."""
        assert self.mlm is not None
        return max(1, min(self._window, round(self.mlm.mask_prob * self._window)))

    def read(self, batch: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        if self.mlm is not None:
            self.special_ids()  # a tokenizer without them is named before its text is tokenized
        tokens, n = self._tokens(), self.num_samples
        if n < self.batch_size:
            raise DataError(
                f"text files {list(self.paths)[:3]} hold {len(tokens)} tokens: {n} samples of seq_len "
                f"{self.seq_len}, fewer than one batch of {self.batch_size}; give more text, or a smaller "
                "seq_len or batch_size"
            )
        ids = self._sample_ids(n, batch, rows)
        if self.mlm is None:
            return TokenFileSource.samples(tokens, ids, self.seq_len)
        text = TokenFileSource.windows(tokens, ids, self._window, self._window)
        return self._masked(text, ids, epoch=batch // (n // self.batch_size))

    def _masked(self, text: np.ndarray, ids: np.ndarray, epoch: int) -> dict[str, np.ndarray]:
        """``[CLS] text [SEP]``, ``predictions`` positions of ``text`` masked as BERT does."""
        cls, sep, mask = self.special_ids()
        rows, width, p = len(ids), text.shape[1], self.predictions

        def draw(name: str, cols: int) -> np.ndarray:
            key = RandomKey(self.seed % 2**64, tensor_rng_id(f"text.mlm.{name}"), epoch % 2**32)
            return uniform_at(np, key, row_offsets(ids, (cols,)), np.float64)

        ends = np.full((rows, 1), 0, np.int64)
        tokens = np.concatenate([ends + cls, text.astype(np.int64), ends + sep], axis=1)
        # the p positions with the smallest draws: distinct, uniform, increasing; 1.. skips [CLS]
        positions = np.sort(np.argsort(draw("choose", width), axis=1, kind="stable")[:, :p], axis=1) + 1
        at = np.arange(rows)[:, None]
        labels = tokens[at, positions]
        how = draw("how", p)
        other = np.minimum((draw("other", p) * self.vocab_size).astype(np.int64), self.vocab_size - 1)
        tokens[at, positions] = np.where(how < MASKED, mask, np.where(how < RANDOM, other, labels))
        return {
            "tokens": tokens,
            "token_types": np.zeros_like(tokens),
            "positions": positions.astype(np.int64),
            "labels": labels,
        }

    def special_ids(self) -> tuple[int, int, int]:
        """([CLS], [SEP], [MASK]) ids (:class:`TextMlm`); one the tokenizer lacks is refused, naming it."""
        assert self.mlm is not None
        tok, out = self.loaded_tokenizer(), []
        for i, (k, names) in enumerate(SPECIAL_NAMES.items()):
            given = getattr(self.mlm, f"{k}_id")
            found = given if given is not None else 256 + i if tok.hf is None else tok.token_id(names)
            if found is None:
                raise DataError(
                    f"tokenizer file {self.tokenizer!r} has no {' or '.join(names)} token for mlm; give "
                    f"mlm.{k}_id, or a tokenizer with one"
                )
            if not 0 <= found < self.vocab_size:
                raise DataError(
                    f"mlm.{k}_id={found} is outside the tokenizer's vocabulary of {self.vocab_size}; give "
                    "an id below it"
                )
            out.append(int(found))
        return out[0], out[1], out[2]


_TOKENS: dict[tuple[object, ...], np.ndarray] = {}
_LOCK = threading.Lock()

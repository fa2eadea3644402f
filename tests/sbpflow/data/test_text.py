"""TextFileSource on real text files: bytes are the file's bytes, BPE ids are `tokenizers`' own, the
token cache is shared and never half-read, every layout and process reads the same samples, MLM masks per
(seed, epoch, sample), and each bad input is one clear error naming the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sbpflow.data import tokenize
from sbpflow.data.sources import DataError, TokenFileSource
from sbpflow.data.text import TextFileSource, TextMlm
from sbpflow.dtype import DType

pytest.importorskip("tokenizers")

DOCS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 40,
    "Les élèves lisent « Le Petit Prince » — déjà 😀 au lycée.\nIl pleut.\n" * 40,
    "import os\nprint(os.getcwd())\n" * 60,
]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SBPFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    for i, text in enumerate(DOCS):
        (d / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE trained on DOCS, with an end-of-text token and BERT's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def source(corpus: Path, **kw: object) -> TextFileSource:
    args: dict = {"paths": (str(corpus / "*.txt"),), "seq_len": 16, "batch_size": 8, **kw}
    return TextFileSource(**args)


def test_bytes_are_the_files_bytes_in_sorted_order(corpus: Path) -> None:
    s = source(corpus, batch_size=1)
    want = b"".join((corpus / f"doc{i}.txt").read_bytes() for i in range(3))  # no end-of-text for bytes
    assert s.vocab_size == 256 and s.num_samples == (len(want) - 1) // 16
    got = np.concatenate([s.read(i)["tokens"][0] for i in range(s.num_samples)])
    assert bytes(got.astype(np.uint8)) == want[: len(got)]
    b = s.read(5)
    assert np.array_equal(b["targets"][0][:-1], b["tokens"][0][1:]) and b["tokens"].dtype == np.int64


def test_bpe_ids_equal_tokenizers_encode_batch_joined_by_end_of_text(
    corpus: Path, bpe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer

    monkeypatch.setattr(tokenize, "PIECE", 64)  # many pieces per file: the cuts must not change an id
    s = source(corpus, tokenizer=str(bpe), batch_size=1)
    hf = Tokenizer.from_file(str(bpe))
    eot = hf.token_to_id("<|endoftext|>")
    assert eot is not None
    want = np.concatenate([np.append(e.ids, eot) for e in hf.encode_batch(DOCS, add_special_tokens=False)])
    got = np.concatenate([s.read(i)["tokens"][0] for i in range(s.num_samples)])
    assert s.vocab_size == hf.get_vocab_size() and s.num_samples == (len(want) - 1) // 16
    np.testing.assert_array_equal(got, want[: len(got)])


def test_the_same_rows_under_any_layout_and_in_another_process(
    corpus: Path, bpe: Path, tmp_path: Path
) -> None:
    """One batch read whole equals its two rank halves, shuffled; two processes building one fresh cache
    together (neither may read the other's half-written file) read the same rows too."""
    kw = {"tokenizer": str(bpe), "shuffle": True, "seed": 3}
    for mlm in (None, TextMlm(mask_prob=0.25)):
        s = source(corpus, mlm=mlm, **kw)
        for batch in (0, 7 * s.num_samples // 8):  # epoch 0 and a later one
            whole, a, b = s.read(batch), s.read(batch, slice(0, 4)), s.read(batch, slice(4, 8))
            for k in whole:
                assert np.array_equal(whole[k], np.concatenate([a[k], b[k]])), k
    mine = source(corpus, mlm=TextMlm(), **kw).read(3)
    code = (
        "import sys, json; from sbpflow.data.text import TextFileSource, TextMlm; "
        f"s = TextFileSource(paths=({str(corpus / '*.txt')!r},), tokenizer={str(bpe)!r}, seq_len=16, "
        "batch_size=8, shuffle=True, seed=3, mlm=TextMlm()); "
        "print(json.dumps({k: v.tolist() for k, v in s.read(3, slice(2, 6)).items()}))"
    )
    env = {**os.environ, "SBPFLOW_CACHE": str(tmp_path / "other")}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE) for _ in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        theirs = json.loads(out)
        for k in mine:
            assert np.array_equal(mine[k][2:6], theirs[k]), k
    assert [f.suffix for f in (tmp_path / "other").iterdir() if "tmp" in f.name] == []


def test_mlm_masks_chosen_positions_as_bert_does_and_afresh_each_epoch(corpus: Path, bpe: Path) -> None:
    s = source(corpus, tokenizer=str(bpe), seq_len=34, batch_size=16, mlm=TextMlm(mask_prob=0.2))
    plain = source(corpus, tokenizer=str(bpe), seq_len=32, batch_size=16)
    cls, sep, mask = s.special_ids()
    assert (cls, sep, mask) == tuple(
        s.loaded_tokenizer().hf.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]")
    )
    b = s.read(0)
    assert {k: v.shape for k, v in b.items()} == {
        "tokens": (16, 34),
        "token_types": (16, 34),
        "positions": (16, 6),
        "labels": (16, 6),
    }
    assert (
        (b["tokens"][:, 0] == cls).all() and (b["tokens"][:, -1] == sep).all() and not b["token_types"].any()
    )
    assert (
        (np.diff(b["positions"], axis=1) > 0).all()
        and b["positions"].min() >= 1
        and b["positions"].max() <= 32
    )
    text = plain.read(0)["tokens"]  # windows of 32 tokens at i * 32, as the MLM windows
    rows = np.arange(16)[:, None]
    assert np.array_equal(b["labels"], text[rows, b["positions"] - 1])
    masked = b["tokens"][rows, b["positions"]]
    assert 0.6 < (masked == mask).mean() < 0.95  # 80 % [MASK]
    unchosen = np.ones((16, 34), bool)
    unchosen[rows, b["positions"]] = False
    unchosen[:, [0, -1]] = False
    assert np.array_equal(b["tokens"][:, 1:-1][unchosen[:, 1:-1]], text[unchosen[:, 1:-1]])
    per_epoch = s.num_samples // 16
    again = s.read(per_epoch)  # the same samples (unshuffled) in epoch 1, masked elsewhere
    assert np.array_equal(again["labels"], text[rows, again["positions"] - 1])
    assert not np.array_equal(again["positions"], b["positions"])


def test_bytes_mlm_appends_three_special_ids(corpus: Path) -> None:
    s = source(corpus, mlm=TextMlm(mask_prob=0.5))
    assert s.special_ids() == (256, 257, 258) and s.vocab_size == 259
    assert s.read(0)["tokens"].max() <= 258


def test_token_npy_of_uint16_reads_as_the_flat_int32_file(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 50_000, 1000)
    np.save(tmp_path / "t.npy", ids.astype(np.uint16))
    ids.astype(np.int32).tofile(tmp_path / "t.bin")
    npy, flat = (
        TokenFileSource(path=str(tmp_path / f), seq_len=10, batch_size=4) for f in ("t.npy", "t.bin")
    )
    assert npy.num_samples == flat.num_samples == 99
    for k, v in npy.read(5).items():
        assert np.array_equal(v, flat.read(5)[k]) and v.dtype == np.int64
    np.save(tmp_path / "two.npy", np.zeros((4, 4), np.int32))
    with pytest.raises(DataError, match=r"two.npy.*int32 of shape \(4, 4\).*one axis"):
        TokenFileSource(path=str(tmp_path / "two.npy"), dtype=DType.int32, seq_len=2, batch_size=1).read(0)


# ---- each bad input: one error naming the file and the fix ------------------------------------------


def test_a_missing_file_and_a_pattern_matching_nothing_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"text file '.*nope.txt' does not exist"):
        TextFileSource(paths=(str(tmp_path / "nope.txt"),), seq_len=4, batch_size=1).read(0)
    with pytest.raises(DataError, match=r"pattern '.*\*.md' matches no file"):
        TextFileSource(paths=(str(tmp_path / "*.md"),), seq_len=4, batch_size=1).read(0)


def test_an_empty_file_and_too_little_text_are_named(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"'.*empty.txt' is empty; remove it"):
        TextFileSource(paths=(str(tmp_path / "empty.txt"),), seq_len=4, batch_size=1).read(0)
    (tmp_path / "short.txt").write_text("hello world\n")
    with pytest.raises(DataError, match=r"12 tokens: 2 samples of seq_len 5, fewer than one batch of 4"):
        TextFileSource(paths=(str(tmp_path / "short.txt"),), seq_len=5, batch_size=4).read(0)


def test_non_utf8_text_is_refused_under_a_tokenizer_naming_the_byte(tmp_path: Path, bpe: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 au lait\n".encode() * 10 + "na\u00efve\n".encode("latin-1"))  # byte 142
    with pytest.raises(DataError, match=r"latin1.txt' is not UTF-8 \(byte 142 is b'\\xef'\).*iconv.*bytes"):
        TextFileSource(paths=(str(path),), tokenizer=str(bpe), seq_len=4, batch_size=1).read(0)
    assert (
        TextFileSource(paths=(str(path),), seq_len=4, batch_size=1).num_samples
        == (len(path.read_bytes()) - 1) // 4
    )


def test_a_line_too_long_to_cut_is_refused(
    tmp_path: Path, bpe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenize, "MAX_RUN", 1000)
    monkeypatch.setattr(tokenize, "PIECE", 256)
    path = tmp_path / "one_line.txt"
    path.write_text("x" * 5000)
    with pytest.raises(DataError, match=r"one_line.txt' has \d+ characters without a line break"):
        TextFileSource(paths=(str(path),), tokenizer=str(bpe), seq_len=4, batch_size=1).read(0)


def test_a_corrupt_tokenizer_file_and_missing_special_tokens_are_named(corpus: Path, tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE", "vocab": 7')
    with pytest.raises(DataError, match=r"tokenizer file '.*tokenizer.json' is not a tokenizers JSON file"):
        source(corpus, tokenizer=str(bad)).read(0)
    from tokenizers import Tokenizer, models

    plain = tmp_path / "plain.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(plain))
    with pytest.raises(DataError, match=r"no \[CLS\] or <s> token for mlm; give mlm.cls_id"):
        source(corpus, tokenizer=str(plain), mlm=TextMlm()).read(0)

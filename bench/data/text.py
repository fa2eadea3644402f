"""Text tokenization + packing tokens/s: sbpflow's TextFileSource against `tokenizers` + a numpy loop.

    python bench/data/text.py            # ~4 MB (what the packages hold, 3 MB) of Python sources in 8 files, BPE of 8,000 ids, 3 repeats
    python bench/data/text.py --quick    # ~1 MB, 1 repeat: a smoke run

The text is the Python standard library's own sources (every machine has them), cut into 8 documents
(files). A byte-level BPE tokenizer is trained on it here with `tokenizers`' trainer (no download) and
saved as a tokenizer.json that both sides load. One epoch of samples (seq_len 256, batch 64, shuffled)
is read on each side, from files on disk to int64 ``tokens``/``targets`` batches:

- sbpflow: ``TextFileSource(paths=(DIR/*.txt,), tokenizer=tokenizer.json)`` read batch by batch through
  ``read`` (a fresh ``$SBPFLOW_CACHE`` each repetition, so the timing includes tokenizing the files and
  writing the token cache; the figure "cached" is a second epoch read from the cache);
- the peer: each file read whole, ``Tokenizer.encode_batch(documents)`` (and, as a second peer,
  ``encode_batch_fast``, which skips the offsets), the ids joined with the end-of-text id, then a plain
  numpy loop packing the same shuffled windows into the same batches.

Both sides run in this process on the same cores (the tokenizers' thread pool on each). The sides
alternate ``--repeat`` times; medians are compared, and ``ratio`` is sbpflow's against the faster peer.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sbpflow.data.corpus import PACKAGES as CORPUS_PACKAGES  # noqa: E402
from sbpflow.data.text import TextFileSource  # noqa: E402

SEQ_LEN, BATCH, DOCS, VOCAB = 256, 64, 8, 8000
PACKAGES = (*CORPUS_PACKAGES, "concurrent", "sqlite3", "html")  # with the held-out ones: ~3 MB


def corpus(folder: Path, chars: int) -> list[Path]:
    """``DOCS`` files of about ``chars / DOCS`` characters of standard-library sources each."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = ""
    for f in sorted(f for p in PACKAGES for f in (stdlib / p).rglob("*.py")):
        text += f.read_text(encoding="utf-8", errors="replace")
        if len(text) >= chars:
            break
    size = len(text) // DOCS
    paths = [folder / f"doc{i}.txt" for i in range(DOCS)]
    for i, p in enumerate(paths):
        p.write_text(text[i * size : (i + 1) * size], encoding="utf-8")
    return paths


def train_tokenizer(paths: list[Path], out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(p) for p in paths], trainer)
    tok.save(str(out))
    return out


def sbpflow_epoch(folder: Path, tokenizer: Path, cache: Path) -> tuple[float, float, int]:
    """(seconds of a first epoch, seconds of a second one from the cache, tokens per epoch)."""
    os.environ["SBPFLOW_CACHE"] = str(cache)
    source = TextFileSource(
        paths=(str(folder / "*.txt"),),
        tokenizer=str(tokenizer),
        seq_len=SEQ_LEN,
        batch_size=BATCH,
        shuffle=True,
    )
    times = []
    for epoch in range(2):
        t0 = time.perf_counter()
        per_epoch = source.num_samples // BATCH
        for b in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            batch = source.read(b)
        times.append(time.perf_counter() - t0)
    assert batch["tokens"].shape == (BATCH, SEQ_LEN)
    return times[0], times[1], per_epoch * BATCH * SEQ_LEN


def peer_epoch(paths: list[Path], tokenizer: Path, fast: bool) -> tuple[float, int]:
    """(seconds, tokens per epoch) of tokenizers' encode_batch and a plain numpy packing loop."""
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(tokenizer))
    eot = tok.token_to_id("<|endoftext|>")
    assert eot is not None
    docs = [p.read_text(encoding="utf-8") for p in paths]
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    ids = np.concatenate(
        [np.append(np.asarray(e.ids, np.int64), eot) for e in encode(docs, add_special_tokens=False)]
    )
    n = (len(ids) - 1) // SEQ_LEN
    order = np.random.default_rng(0).permutation(n)
    for b in range(n // BATCH):
        rows = order[b * BATCH : (b + 1) * BATCH]
        windows = ids[rows[:, None] * SEQ_LEN + np.arange(SEQ_LEN + 1)]
        batch = {"tokens": windows[:, :-1].copy(), "targets": windows[:, 1:].copy()}
    assert batch["tokens"].shape == (BATCH, SEQ_LEN)
    return time.perf_counter() - t0, n // BATCH * BATCH * SEQ_LEN


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chars", type=int, default=4_000_000)
    args = ap.parse_args()
    chars, repeat = (1_000_000, 1) if args.quick else (args.chars, args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        first = Path(tmp) / "text0"
        first.mkdir()
        paths = corpus(first, chars)
        tokenizer = train_tokenizer(paths, Path(tmp) / "tokenizer.json")
        mb = sum(p.stat().st_size for p in paths) / 1e6
        print(
            f"text: {mb:.1f} MB in {DOCS} files; BPE vocab {VOCAB}; seq_len {SEQ_LEN}, batch {BATCH}; "
            f"{os.cpu_count()} CPUs"
        )
        ours, cached, peer, fast = [], [], [], []
        for r in range(repeat):
            folder = Path(tmp) / f"text{r}"  # new paths: sbpflow's per-process cache of their tokens misses
            folder.mkdir(exist_ok=True)
            paths = [folder / p.name for p in paths]
            for p in paths:
                p.write_bytes((first / p.name).read_bytes())
            once, second, tokens = sbpflow_epoch(folder, tokenizer, Path(tmp) / f"cache{r}")
            ours.append(tokens / once)
            cached.append(tokens / second)
            seconds, peer_tokens = peer_epoch(paths, tokenizer, fast=False)
            peer.append(peer_tokens / seconds)
            seconds, peer_tokens = peer_epoch(paths, tokenizer, fast=True)
            fast.append(peer_tokens / seconds)
        figures = {
            "sbpflow TextFileSource, first epoch (tokenize + cache + read)": ours,
            "sbpflow TextFileSource, next epoch (from the cache)": cached,
            "tokenizers encode_batch + numpy packing loop": peer,
            "tokenizers encode_batch_fast + numpy packing loop": fast,
        }
        for name, values in figures.items():
            print(f"{name:64s} {statistics.median(values) / 1e6:8.2f} M tokens/s")
        best_peer = max(statistics.median(peer), statistics.median(fast))
        print(f"ratio {statistics.median(ours) / best_peer:.2f}")


if __name__ == "__main__":
    main()

"""The README's main job: a character-level GPT trained on real text, data-parallel on local CPU workers.

    sbpflow run examples/charlm.py                 # 2 Ray worker processes, 150 steps, loss falls from ~4.9
    python examples/charlm.py --ranks 4 --steps 20
    sbpflow generate examples/charlm.py --checkpoint CKPT --prompt "def " --ranks 2 --tp

The text is the Python standard library's own source code (``sf.corpus``: on every machine, offline),
read character by character (vocabulary 128), or your own: ``--data FILE`` (a text file or glob pattern,
read byte by byte, vocabulary 256; ``--set tokenizer=tokenizer.json`` for BPE). The model is :mod:`gpt`'s
GPT-2 with the text swapped in; ``--tp`` / ``--pp`` and gpt's other options work as there, and a key
neither takes is refused.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import sbpflow as sf


def _gpt() -> ModuleType:
    """examples/gpt.py, loaded beside this file (examples are files, not a package)."""
    if "sbpflow_example_gpt" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "sbpflow_example_gpt", Path(__file__).with_name("gpt.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["sbpflow_example_gpt"]


DEFAULTS: dict[str, Any] = {
    "ranks": 2,
    "layers": 2,
    "heads": 4,
    "width": 64,
    "seq_len": 64,
    "batch_size": 16,
    "steps": 150,
    "lr": 3e-3,
    "warmup": 10,
}


# the held-out split: other packages of the standard library than the training text's (sf.corpus.PACKAGES)
HELD_OUT = ("concurrent", "sqlite3", "wsgiref", "html", "tomllib")


def held_out(seq_len: int, batch_size: int) -> sf.data.TokenFileSource:
    """Windows of text the model never trains on, in order."""
    path = sf.corpus.python_sources(packages=HELD_OUT, max_chars=400_000)
    return sf.data.TokenFileSource(
        path=str(path), dtype=sf.int32, seq_len=seq_len, batch_size=batch_size, shuffle=False
    )


def make_job(eval_every: int = 0, eval_batches: int = 4, data: str = "", **kwargs: Any) -> sf.Job:
    """The job; ``data``: your text (a file or glob pattern) instead of Python's sources; any other key is
    one of gpt's ``make_job``. ``eval_every`` > 0 (``--set eval_every=50``) also reports the loss on
    held-out Python sources every that many steps, over ``eval_batches`` batches."""
    known = [k for k in inspect.signature(_gpt().make_job).parameters if k not in ("text", "data")]
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        hint = " (the text is data=FILE)" if "text" in unknown else ""
        raise SystemExit(
            f"charlm: make_job() takes no {unknown}{hint}; it takes eval_every, eval_batches, data and {known}"
        )
    if eval_every and data:
        raise SystemExit("charlm: eval_every evaluates on held-out Python sources, not on data=; drop one")
    args = {**DEFAULTS, **kwargs, "text": "pysrc", "data": data}
    job = _gpt().make_job(**args)
    if eval_every:
        every = job.config.checkpoint_every or eval_every  # an evaluation reads its step's checkpoint
        config = dataclasses.replace(
            job.config, eval_every=eval_every, eval_batches=eval_batches, checkpoint_every=every
        )
        job = dataclasses.replace(job, config=config, eval_data=held_out(args["seq_len"], args["batch_size"]))
        job.verify()
    return job


def make_model(
    ranks: int = 1,
    tp: bool = False,
    vocab: int = sf.corpus.VOCAB,
    layers: int = DEFAULTS["layers"],
    heads: int = DEFAULTS["heads"],
    width: int = DEFAULTS["width"],
    seq_len: int = DEFAULTS["seq_len"],
) -> tuple[sf.nn.GPT, sf.Placement, Any]:
    """The trained model for ``sbpflow generate``, its placement and the tokens' SBP: give the layers,
    heads, width, seq_len and vocab it was trained with (256 for ``--data`` read byte by byte); ``--ranks
    N --tp`` splits it as Megatron does."""
    cfg = sf.nn.GPTConfig(vocab_size=vocab, seq_len=seq_len, n_layer=layers, n_head=heads, n_embd=width)
    model, where = sf.nn.GPT(cfg), sf.placement("cpu", ranks=list(range(ranks)))
    if tp:
        sf.nn.parallel.megatron(model, where, tp_axis=-1)
    return model, where, sf.sbp.broadcast


def encode(text: str) -> list[int]:
    """Character ids as the corpus has them (ASCII; anything else becomes ``?``)."""
    return [c if c < sf.corpus.VOCAB else sf.corpus.UNKNOWN for c in text.encode("utf-8")]


decode = sf.corpus.decode


if __name__ == "__main__":
    import argparse

    from sbpflow.client.cli.summary import summarize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    print(summarize(make_job(**vars(ap.parse_args())), show_parameters=False))

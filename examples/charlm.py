"""The README's main job: a character-level GPT trained on real text, data-parallel on local CPU workers.

    sbpflow run examples/charlm.py                 # 2 Ray worker processes, 150 steps, loss falls from ~4.9
    python examples/charlm.py --ranks 4 --steps 20
    sbpflow generate examples/charlm.py --checkpoint CKPT --prompt "def " --ranks 2 --tp

The text is the Python standard library's own source code (``sf.corpus``: on every machine, offline),
read character by character (vocabulary 128). The model is :mod:`gpt`'s GPT-2 with the text swapped in;
``--tp`` / ``--pp`` work as there.
"""

from __future__ import annotations

import importlib.util
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


def make_job(**kwargs: Any) -> sf.Job:
    return _gpt().make_job(**{**DEFAULTS, **kwargs, "text": "pysrc"})


def make_model(
    ranks: int = 1,
    tp: bool = False,
    layers: int = DEFAULTS["layers"],
    heads: int = DEFAULTS["heads"],
    width: int = DEFAULTS["width"],
    seq_len: int = DEFAULTS["seq_len"],
) -> tuple[sf.nn.GPT, sf.Placement, Any]:
    """The trained model for ``sbpflow generate``, its placement and the tokens' SBP: give the layers,
    heads, width and seq_len it was trained with; ``--ranks N --tp`` splits it as Megatron does."""
    cfg = sf.nn.GPTConfig(
        vocab_size=sf.corpus.VOCAB, seq_len=seq_len, n_layer=layers, n_head=heads, n_embd=width
    )
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

    from sbpflow.client.summary import summarize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    print(summarize(make_job(**vars(ap.parse_args())), show_parameters=False))

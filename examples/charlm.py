"""The README's main job: a character-level GPT trained on real text, data-parallel on local CPU workers.

    sbpflow run examples/charlm.py                 # 2 Ray worker processes, 150 steps, loss falls from ~4.9
    python examples/charlm.py --ranks 4 --steps 20

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


if __name__ == "__main__":
    import argparse

    from sbpflow.client.summary import summarize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    print(summarize(make_job(**vars(ap.parse_args())), show_parameters=False))

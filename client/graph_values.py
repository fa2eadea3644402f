"""The modules of a traced job, as the job's :class:`~sbpflow.runs.bound_values.BoundValues`.

``sf.Graph.trace`` puts one on every Job it makes (``Job.bound``): ``sf.run`` starts the parameters
from the values the modules hold, writes the trained values back into them, and reads files in another
layout (``layout="torch"``, :mod:`sbpflow.client.torch_layout`) through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from sbpflow.client.nn.module import Module
from sbpflow.client.nn.parameter import Parameter
from sbpflow.client.torch_layout import TorchRule, from_torch, to_torch, torch_rules
from sbpflow.errors import SbpflowError

Convert = Callable[[Mapping[str, np.ndarray], tuple[TorchRule, ...]], dict[str, np.ndarray]]
# layout -> (to it, from it)
LAYOUTS: dict[str, tuple[Convert, Convert]] = {
    "torch": (to_torch, from_torch),  # nanoGPT: nn.Linear everywhere
    "gpt2": (  # Hugging Face's GPT-2: Conv1D in the blocks
        functools.partial(to_torch, conv1d=True),
        functools.partial(from_torch, conv1d=True),
    ),
}


class GraphValues:
    """The values are taken when the job is traced: a Job is a value, and running it again starts where
    it started; a job traced after a run starts from what that run wrote back."""

    def __init__(self, modules: Mapping[str, Module], params: Mapping[str, Parameter]) -> None:
        self._modules = dict(modules)
        self._params = dict(params)  # tensor name -> its declaration (and value)
        # write_back replaces a Parameter's array, never changes it: these stay the values at trace time
        self._start = {n: p.value for n, p in self._params.items() if p.value is not None}

    def held(self) -> dict[str, np.ndarray]:
        return dict(self._start)

    def write_back(self, values: Mapping[str, Any]) -> None:
        for n, v in values.items():
            p = self._params.get(n)
            if p is not None:
                p.value = np.array(v, dtype=p.dtype.to_numpy())

    def _convert(self, layout: str, which: int) -> Convert:
        pair = LAYOUTS.get(layout)
        if pair is None:
            raise SbpflowError(
                f"layout {layout!r} is unknown; use one of {sorted(LAYOUTS)} (or none: sbpflow's own)"
            )
        return pair[which]

    def from_layout(self, layout: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._convert(layout, 1)(tensors, torch_rules(self._modules))

    def to_layout(self, layout: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._convert(layout, 0)(tensors, torch_rules(self._modules))

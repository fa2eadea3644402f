"""The modules of a traced job, as the job's :class:`~sbpflow.runs.bound_values.BoundValues`.

``sf.Graph.trace`` puts one on every Job it makes (``Job.bound``): ``sf.run`` starts the parameters
from the values the modules hold, writes the trained values back into them, and reads files in another
layout (``layout="torch"``, ``"gpt2"``, ``"hf-bert"``, ``"torchvision"``: the modules' own rules,
:mod:`sbpflow.client.nn.layouts`, applied to the graph's names by :mod:`sbpflow.client.torch_layout`)
through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sbpflow.client.nn.layouts import NAMES, Plan, from_layout, rooted, to_layout
from sbpflow.client.nn.module import Module
from sbpflow.client.nn.parameter import Parameter
from sbpflow.client.torch_layout import graph_plan
from sbpflow.errors import SbpflowError


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

    def _plan(self, layout: str) -> Plan:
        if layout not in NAMES:
            raise SbpflowError(
                f"layout {layout!r} is unknown; use one of {list(NAMES)} (or none: sbpflow's own)"
            )
        return graph_plan(self._modules, layout)

    def from_layout(self, layout: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        plan = self._plan(layout)
        return from_layout(rooted(plan, tensors), plan)  # a hub file's base-model names too

    def to_layout(self, layout: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return to_layout(tensors, self._plan(layout))

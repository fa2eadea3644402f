"""A traced graph's parameters in PyTorch's layouts: :mod:`sbpflow.client.nn.layouts`'s rules, read off
every module the graph holds and named by the graph's tensor names (``model.blocks.0.attn.c_attn.weight``).

PyTorch's names are the module's own (no graph attribute) when one attribute holds every parameter.
:func:`to_torch` / :func:`from_torch` keep the interface ``GraphValues`` calls: the ``"torch"`` rules,
and ``conv1d=True`` for Hugging Face GPT-2's (the rules of ``"gpt2"``); :func:`graph_plan` gives any
layout's rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from sbpflow.checkpoint.format import CheckpointError
from sbpflow.client.nn.layouts import ParamRule, Plan, from_layout, plan, to_layout
from sbpflow.client.nn.module import Module

TorchRule = ParamRule


def graph_plan(modules: Mapping[str, Module], layout: str = "torch") -> Plan:
    """The rules of every parameter of a graph's ``modules`` (graph attribute -> module) in ``layout``,
    in the order ``sf.Graph.trace`` names them (a tied parameter once, at its first path)."""
    owners = [a for a, m in modules.items() if any(True for _ in m.parameters())]
    plans = [plan(m, layout, attr, "" if len(owners) <= 1 else attr) for attr, m in modules.items()]
    return Plan(
        layout,
        tuple(r for p in plans for r in p.rules),
        {n: v for p in plans for n, v in p.buffers.items()},
        frozenset(n for p in plans for n in p.ignored),
        tuple(u for p in plans for u in p.untied),
    )


class TorchRules(tuple[ParamRule, ...]):
    """The ``"torch"`` rules, with the plan of ``"gpt2"`` where the modules have one (``conv1d=True``)."""

    torch: Plan
    gpt2: Plan | None


def torch_rules(modules: Mapping[str, Module]) -> TorchRules:
    rules = TorchRules(graph_plan(modules, "torch").rules)
    rules.torch = graph_plan(modules, "torch")
    try:
        rules.gpt2 = graph_plan(modules, "gpt2")
    except CheckpointError:
        rules.gpt2 = None
    return rules


def _plan(rules: tuple[ParamRule, ...], conv1d: bool) -> Plan:
    if isinstance(rules, TorchRules):
        chosen = rules.gpt2 if conv1d else rules.torch
        if chosen is None:
            raise CheckpointError("layout 'gpt2' has no rule for these modules: use it for sf.nn.GPT only")
        return chosen
    return Plan("torch", tuple(replace(r) for r in rules))


def to_torch(
    tensors: Mapping[str, np.ndarray], rules: tuple[ParamRule, ...], conv1d: bool = False
) -> dict[str, np.ndarray]:
    """The job's tensors (by tensor name) under PyTorch's names and layout (``conv1d``: Hugging Face
    GPT-2's); a tensor with no rule (optimizer state) is left out."""
    return to_layout(tensors, _plan(rules, conv1d))


def from_torch(
    tensors: Mapping[str, np.ndarray], rules: tuple[ParamRule, ...], conv1d: bool = False
) -> dict[str, np.ndarray]:
    """A PyTorch state dict's arrays (by PyTorch name) under the job's tensor names and layout; names no
    rule knows pass through unchanged, so a strict import names them as unexpected."""
    return from_layout(tensors, _plan(rules, conv1d))

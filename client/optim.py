"""``sf.optim``: optimizers as declarations. They hold the parameters and hyper-parameters; the trace
turns them into a ``sbpflow.job.OptimizerSpec`` naming the parameters by their tensor names, and the
compiler inserts the update ops (with their state) into the graph. Nothing steps in Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import SimpleNamespace
from typing import Any

from sbpflow import job
from sbpflow.client.nn.parameter import Parameter
from sbpflow.errors import SbpflowError

WarmupCosine = job.WarmupCosine
ConstantLR = job.ConstantLR
lr_scheduler = SimpleNamespace(WarmupCosine=WarmupCosine, ConstantLR=ConstantLR)


# what a parameter group may set besides "params" (the others are the optimizer's for every parameter)
GROUP_KEYS = ("lr", "weight_decay")
Params = Iterable[Parameter] | Iterable[Mapping[str, Any]]


class Optimizer:
    """``params``: parameters (``model.parameters()``), or PyTorch's parameter groups, dicts of
    ``"params"`` and any of ``"lr"`` and ``"weight_decay"`` (:func:`decay_groups` makes the usual
    ones); a group's value replaces the optimizer's for its parameters."""

    algorithm: job.SGD | job.AdamW

    def __init__(self, params: Params, clip_grad_norm: float = 0.0) -> None:
        self.params: list[Parameter] = []
        self.groups: list[tuple[list[Parameter], dict[str, float]]] = []
        for item in params:
            if isinstance(item, Mapping):
                self.groups.append(self._group(item))
                self.params += self.groups[-1][0]
            else:
                self.params.append(self._parameter(item))
        if not self.params:
            raise SbpflowError(f"{type(self).__name__} got no parameters; pass model.parameters()")
        if clip_grad_norm < 0:
            raise SbpflowError(f"clip_grad_norm={clip_grad_norm}: use 0 (off) or a positive max norm")
        self.clip_grad_norm = float(clip_grad_norm)

    def _parameter(self, p: Any) -> Parameter:
        if not isinstance(p, Parameter):
            raise SbpflowError(f"{type(self).__name__} got {p!r}, not a Parameter; pass model.parameters()")
        return p

    def _group(self, group: Mapping[str, Any]) -> tuple[list[Parameter], dict[str, float]]:
        unknown = sorted(set(group) - {"params", *GROUP_KEYS})
        if "params" not in group or unknown:
            raise SbpflowError(
                f"{type(self).__name__}: a parameter group is a dict of 'params' and any of {list(GROUP_KEYS)}; "
                f"got keys {sorted(group)}"
            )
        values = {k: float(group[k]) for k in GROUP_KEYS if k in group}
        for k, v in values.items():
            if not v >= 0:
                raise SbpflowError(f"{type(self).__name__}: a parameter group's {k}={v}; give a value >= 0")
        return [self._parameter(p) for p in group["params"]], values

    def spec(self, names: Mapping[int, str], schedule: Any = None) -> job.OptimizerSpec:
        """The job's optimizer: parameters by tensor name (``names``: id(Parameter) -> tensor name)."""
        missing = [p for p in self.params if id(p) not in names]
        if missing:
            raise SbpflowError(
                f"{type(self).__name__} updates {len(missing)} parameter(s) ({missing[0]!r}, ...) that no "
                "module of the graph owns; assign their module as an attribute of the sf.Graph"
            )
        trainable = tuple(dict.fromkeys(names[id(p)] for p in self.params if p.requires_grad))
        groups = tuple(
            job.ParamGroup(tuple(names[id(p)] for p in params if p.requires_grad), **values)  # type: ignore[arg-type]
            for params, values in self.groups
            if values
        )
        return job.OptimizerSpec(
            self.algorithm,
            trainable,
            self.clip_grad_norm,
            schedule if schedule is not None else ConstantLR(),
            groups,
        )


def decay_groups(module: Any, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's two groups: matrices (Linear and Embedding weights) decay by ``weight_decay``; biases
    and LayerNorm weights (every parameter of fewer than 2 dims) do not."""
    params = list(module.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


class SGD(Optimizer):
    def __init__(
        self,
        params: Params,
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        clip_grad_norm: float = 0.0,
    ) -> None:
        super().__init__(params, clip_grad_norm)
        if nesterov and momentum <= 0:
            raise SbpflowError("SGD(nesterov=True) needs momentum > 0")
        self.algorithm = job.SGD(float(lr), float(momentum), float(weight_decay), bool(nesterov))


class AdamW(Optimizer):
    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        clip_grad_norm: float = 0.0,
    ) -> None:
        super().__init__(params, clip_grad_norm)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise SbpflowError(f"AdamW betas={betas}: each must be in [0, 1)")
        self.algorithm = job.AdamW(float(lr), float(b1), float(b2), float(eps), float(weight_decay))


__all__ = ["SGD", "AdamW", "ConstantLR", "Optimizer", "WarmupCosine", "decay_groups", "lr_scheduler"]

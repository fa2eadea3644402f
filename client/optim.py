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


class Optimizer:
    algorithm: job.SGD | job.AdamW

    def __init__(self, params: Iterable[Parameter], clip_grad_norm: float = 0.0) -> None:
        self.params = list(params)
        for p in self.params:
            if not isinstance(p, Parameter):
                raise SbpflowError(
                    f"{type(self).__name__} got {p!r}, not a Parameter; pass model.parameters()"
                )
        if not self.params:
            raise SbpflowError(f"{type(self).__name__} got no parameters; pass model.parameters()")
        if clip_grad_norm < 0:
            raise SbpflowError(f"clip_grad_norm={clip_grad_norm}: use 0 (off) or a positive max norm")
        self.clip_grad_norm = float(clip_grad_norm)

    def spec(self, names: Mapping[int, str], schedule: Any = None) -> job.OptimizerSpec:
        """The job's optimizer: parameters by tensor name (``names``: id(Parameter) -> tensor name)."""
        missing = [p for p in self.params if id(p) not in names]
        if missing:
            raise SbpflowError(
                f"{type(self).__name__} updates {len(missing)} parameter(s) ({missing[0]!r}, ...) that no "
                "module of the graph owns; assign their module as an attribute of the sf.Graph"
            )
        trainable = tuple(dict.fromkeys(names[id(p)] for p in self.params if p.requires_grad))
        return job.OptimizerSpec(
            self.algorithm, trainable, self.clip_grad_norm, schedule if schedule is not None else ConstantLR()
        )


class SGD(Optimizer):
    def __init__(
        self,
        params: Iterable[Parameter],
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
        params: Iterable[Parameter],
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


__all__ = ["SGD", "AdamW", "ConstantLR", "Optimizer", "WarmupCosine", "lr_scheduler"]

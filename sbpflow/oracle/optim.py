"""The one-device reference's optimizer step: every parameter of a job's ``OptimizerSpec`` updated once.

Per step, on whole arrays: the gradients are clipped by their global norm when ``clip_grad_norm > 0``
(every gradient times ``min(1, max_norm / (||all gradients|| + 1e-6))``, the squared norms added in the
widest dtype); the learning rate is the algorithm's ``lr`` times the schedule's factor at the step; each
parameter moves by the op library's update kernel (``sgd_update``, ``adamw_update``: torch.optim's SGD
with dampening 0 and AdamW, checked against those formulas in tests/sbpflow/ops), its state starting at
zero (an SGD buffer at zero gives torch's first step).

State is named ``<param>/momentum`` (SGD) or ``<param>/adam_m`` and ``<param>/adam_v`` (AdamW), as the
runtime names it, so that trained states can be compared by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from sbpflow.job import SGD, AdamW, Job, OptimizerSpec, WarmupCosine
from sbpflow.ops.eager import EagerBuilder

Arrays = dict[str, Any]


@dataclass(frozen=True)
class _Algorithm:
    kernel: str  # the update op: (param, grad, *state) -> (new param, *new state)
    state: tuple[str, ...]  # suffixes of its state variables, in the kernel's order


ALGORITHMS: dict[type, _Algorithm] = {
    SGD: _Algorithm("sgd_update", ("momentum",)),
    AdamW: _Algorithm("adamw_update", ("adam_m", "adam_v")),
}


def state_names(spec: OptimizerSpec | None) -> list[str]:
    """Every state variable of the optimizer, parameter by parameter."""
    if spec is None:
        return []
    suffixes = ALGORITHMS[type(spec.algorithm)].state
    return [f"{p}/{s}" for p in spec.parameters for s in suffixes]


def initial_state(job: Job, xp: ModuleType) -> Arrays:
    """Every state variable at zero, with its parameter's shape and dtype."""
    out: Arrays = {}
    for name in state_names(job.optimizer):
        meta = job.graph.tensors[name.rsplit("/", 1)[0]].meta
        out[name] = xp.zeros(meta.shape, dtype=meta.dtype.to_numpy())
    return out


def schedule_factor(spec: OptimizerSpec, step: int) -> float:
    return spec.schedule.factor(step) if isinstance(spec.schedule, WarmupCosine) else 1.0


def learning_rate(spec: OptimizerSpec, step: int) -> float:
    return spec.algorithm.lr * schedule_factor(spec, step)


def update(
    spec: OptimizerSpec, values: Arrays, grads: Arrays, builder: EagerBuilder, taken: int | None = None
) -> Arrays:
    """The next value of every parameter and state variable of ``spec`` after one step at
    ``builder.step`` (``grads``: by parameter name, as the optimizer receives them); ``taken``: the
    steps taken before it where steps were skipped (AdamW's bias correction counts those only)."""
    grads = {p: grads[p] for p in spec.parameters}
    if spec.clip_grad_norm > 0:
        grads = clip(grads, spec.clip_grad_norm, builder)
    algorithm = ALGORITHMS[type(spec.algorithm)]
    # the schedule is evaluated here; the kernel gets this step's learning rate (of the parameter's group)
    factor = schedule_factor(spec, builder.step)
    new: Arrays = {}
    for p in spec.parameters:
        hyper = spec.hyper(p)
        attrs = {**hyper, "lr": float(hyper["lr"]) * factor, "schedule": "constant"}
        variables = (p, *(f"{p}/{s}" for s in algorithm.state))
        kernel = builder if taken is None else EagerBuilder(builder.xp, builder.seed, taken)
        outs = kernel.call(
            algorithm.kernel, values[p], grads[p], *(values[v] for v in variables[1:]), **attrs
        )
        new.update(zip(variables, outs, strict=True))
    return new


def clip(grads: Arrays, max_norm: float, builder: EagerBuilder) -> Arrays:
    """Every gradient times ``min(1, max_norm / (global norm + 1e-6))``. Each gradient's sum of squares
    is the op library's (``pow_scalar``, ``sum``), as the compiled plan's: its sum of a whole array adds
    in vector lanes, and numpy's pairwise sum gives other last bits (which a clipped step then carries
    into every parameter)."""
    xp = builder.xp
    squares = [builder.call("sum", builder.call("pow_scalar", g, exponent=2.0)[0])[0] for g in grads.values()]
    wide = max((s.dtype for s in squares), key=lambda d: d.itemsize)
    total = squares[0].astype(wide)
    for s in squares[1:]:
        total = total + s.astype(wide)
    (coef,) = builder.call("clip_coef", xp.asarray(total), max_norm=max_norm)
    return {p: g * coef.astype(g.dtype) for p, g in grads.items()}

"""Non-finite numbers in a run: the errors that fail a job whose loss or parameters are NaN or infinite.

A NaN or infinite loss means training has diverged (a learning rate too large, an overflow in fp16 without
loss scaling, a bad batch). ``sf.run`` stops every rank at the step it appeared and raises
:class:`NonFiniteLoss`; the job manager ends the job FAILED with ``reason`` ``NON_FINITE_LOSS``. A run
whose losses stay finite but whose final parameters are not (the last update overflowed) raises
:class:`NonFiniteParameters` (``NON_FINITE_PARAMETERS``): no job reports SUCCEEDED with them.

Each rank checks its own shards at the end of the run (:func:`non_finite_parameters`:
``isfinite(x).all()`` per shard, on the device that holds it), so nothing is gathered for the check.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from sbpflow.errors import SbpflowError
from sbpflow.graph import TensorDecl, TensorKind

NON_FINITE_LOSS = "NON_FINITE_LOSS"
NON_FINITE_PARAMETERS = "NON_FINITE_PARAMETERS"
SHOWN = 8  # tensors named in one message; the rest are counted


class NonFinite(SbpflowError):
    """A run that produced NaN or infinite numbers; ``reason`` is the job's machine-readable reason."""

    reason = ""


class NonFiniteLoss(NonFinite):
    """The loss of (1-based, counted from the job's start) ``step`` is ``value``, NaN or infinite."""

    reason = NON_FINITE_LOSS

    def __init__(self, job: str, step: int, value: float) -> None:
        super().__init__(
            f"job {job!r}: the loss of step {step} is {value} (not finite): training diverged there; lower "
            "the learning rate, clip gradients (the optimizer's clip_grad_norm) or, under fp16, scale the loss"
        )
        self.step, self.value = step, value


class NonFiniteParameters(NonFinite):
    """After the run, the parameters ``names`` hold NaN or infinite values."""

    reason = NON_FINITE_PARAMETERS

    def __init__(self, job: str, step: int, names: Iterable[str]) -> None:
        names = sorted(names)
        more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
        super().__init__(
            f"job {job!r}: after step {step} the parameters {names[:SHOWN]}{more} hold NaN or infinite "
            "values, though every loss was finite (the last update overflowed); lower the learning rate "
            "or clip gradients (the optimizer's clip_grad_norm)"
        )
        self.step, self.names = step, tuple(names)


def finite(value: float) -> bool:
    return math.isfinite(value)


def non_finite_parameters(tensors: Mapping[str, TensorDecl], store: Mapping[str, Any]) -> list[str]:
    """The parameters of ``tensors`` whose shard in ``store`` (one rank's) holds a NaN or an infinity.
    The check runs on the array's own device (cupy arrays answer ``isfinite`` themselves)."""
    bad = []
    for name, decl in tensors.items():
        if decl.kind is not TensorKind.parameter or name not in store:
            continue
        x = store[name]
        if getattr(x, "dtype", None) is None or x.dtype.kind not in "fc":
            continue
        if not bool(np.isfinite(x).all()):
            bad.append(name)
    return bad

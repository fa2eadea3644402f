"""The plan executor with kernels on cupy trains as it does on numpy: the MLP example, one device,
float32, 3 steps, losses and final parameters within 1e-5 of the numpy run's.

Both runs go through the same compile and ``executor.build(..., xp=...)``; only the array module differs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

import sbpflow as sf
from sbpflow.actor_workers.execution import executor
from sbpflow.control_plane.compiler import pipeline
from sbpflow.device import asnumpy
from tests.examples.test_examples import load

STEPS = 3


def mlp() -> sf.Job:
    return load("mlp").make_job(ranks=1, n_in=8, hidden=16, n_out=4, batch_size=8, steps=STEPS)


def train(job: sf.Job, xp: ModuleType) -> tuple[list[float], dict[str, np.ndarray], Any]:
    """Losses, final parameters (on the host), and one final parameter as the run left it."""
    compiled = pipeline.compile(job)
    assert compiled.plan is not None and [d.rank for d in compiled.plan.devices] == [0]
    program = executor.build(
        compiled.plan,
        STEPS,
        None,  # one device: the plan has no communication
        xp=xp,
    )
    executor.execute(program, timeout=300.0)
    context = program.ranks[0].context
    assert job.loss is not None
    per_step = context.fetched[(job.loss, -1)]
    losses = [
        float(asnumpy(executor.gather(program, job.loss, {0: asnumpy(per_step[s])}))) for s in range(STEPS)
    ]
    names = [p.tensor for p in job.parameters]
    parameters = {n: asnumpy(context.store[n]) for n in names}
    return losses, parameters, context.store[names[0]]


def test_the_mlp_trains_on_cupy_as_on_numpy(cp: ModuleType) -> None:
    job = mlp()
    want_losses, want_params, _ = train(job, np)
    got_losses, got_params, raw = train(job, cp)
    assert isinstance(raw, cp.ndarray), (
        f"parameters stayed on the host ({type(raw).__name__}): xp was not used"
    )
    assert raw.dtype == np.float32
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert set(got_params) == set(want_params)
    for name, want in want_params.items():
        np.testing.assert_allclose(got_params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)

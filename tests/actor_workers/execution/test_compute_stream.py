"""A GPU rank's acts run on its compute stream: the executor gives each rank of a cupy run one
ComputeStream (actor_workers/runtime/cuda_streams.py), every stream thread makes it current once, and training is
unchanged. The hardware is faked: numpy as the array module, under cupy's name, with the logging fake of
cupy.cuda from tests/actor_workers/runtime/test_cuda_streams.py; the executor and the discipline are the real ones."""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from sbpflow.actor_workers.execution import executor
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.control_plane.compiler import pipeline
from tests.actor_workers.runtime.test_cuda_streams import FakeCuda
from tests.examples.test_examples import load

STEPS = 3


class FakeCupy(types.ModuleType):
    """numpy's arrays and functions under cupy's name, with a fake ``cuda``."""

    def __init__(self) -> None:
        super().__init__("cupy")
        self.cuda = FakeCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


def losses(xp: Any) -> tuple[list[float], executor.Program]:
    job = load("mlp").make_job(ranks=2, steps=STEPS)
    c = pipeline.compile(job)
    assert c.plan is not None and job.loss is not None
    with InProcessWorld([0, 1], timeout=60) as world:
        program = executor.build(c.plan, STEPS, {r: world.transport(r) for r in (0, 1)}, xp=xp)
        executor.execute(program, timeout=60)
    return [float(v) for v in executor.fetched(program, job.loss, STEPS)], program


def test_each_gpu_rank_runs_its_acts_on_its_own_compute_stream() -> None:
    want, plain = losses(np)
    assert all(rp.context.compute is None for rp in plain.ranks.values())  # numpy: no stream
    xp = FakeCupy()
    got, program = losses(xp)
    assert got == want
    computes = [rp.context.compute for rp in program.ranks.values()]
    assert all(c is not None for c in computes) and computes[0] is not computes[1]
    uses = [stream for what, stream, _ in xp.cuda.log if what == "use"]
    threads = {a.stream for a in program.ranks[0].actors}  # compute, comm, data: one thread each
    for c in computes:
        assert c is not None and uses.count(c.stream.name) == len(threads)  # made current once a thread

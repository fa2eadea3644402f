"""Non-finite numbers fail a run, never pass as a success: a learning rate that drives the loss to inf
fails at the step it appeared (``NonFiniteLoss`` through ``sf.run`` on both backends; FAILED with reason
NON_FINITE_LOSS, the step and its loss in status, events, List and the HTTP JSON, through the service);
finite losses with non-finite final parameters fail with NonFiniteParameters naming them; the step
tracker stops at the first non-finite step and leaves the skip-and-count policy as a hook."""

from __future__ import annotations

import dataclasses
import json
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.client.client import Client
from sbpflow.control_plane.launch.step_tracker import StepTracker
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.dtype import DType
from sbpflow.graph import TensorDecl
from sbpflow.job import Job
from sbpflow.placement import placement
from sbpflow.runs.numerics import NON_FINITE_LOSS, NON_FINITE_PARAMETERS, NonFiniteLoss, NonFiniteParameters
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.sbp import P
from sbpflow.tensor_meta import TensorMeta
from sbpflow.v1 import service_pb2 as sp
from tests.examples.test_examples import load

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")

DIVERGES_AT = 2  # SGD at lr 1e10: step 1's loss is finite, its update makes step 2's loss inf


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


def with_lr(job: Job, lr: float, steps: int) -> Job:
    assert job.optimizer is not None
    algorithm = dataclasses.replace(job.optimizer.algorithm, lr=lr)
    config = dataclasses.replace(job.config, steps=steps)
    return dataclasses.replace(
        job, optimizer=dataclasses.replace(job.optimizer, algorithm=algorithm), config=config
    )


def diverging(mlp: ModuleType, steps: int = 6) -> Job:
    return with_lr(mlp.make_job(steps=steps), 1e10, steps)


def overflowing(mlp: ModuleType, where: Path) -> tuple[Job, str]:
    """One step from weights 1e5 times the initial ones at lr 1e30: its loss is finite, its update
    overflows the float32 weights to inf (``init_from``: validation caps the learning rate at 1e30)."""
    job = mlp.make_job(steps=1)
    start = sf.run(job, backend="inprocess", return_parameters=True, timeout=60).parameters
    assert start is not None
    np.savez(where / "big.npz", **{k: np.asarray(v) * 1e5 for k, v in start.items()})
    return with_lr(job, 1e30, 1), str(where / "big.npz")


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
def test_a_diverging_run_fails_at_the_step_its_loss_went_inf(
    mlp: ModuleType, backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "ray":
        request.getfixturevalue("ray_local")
    steps: list[sp.StepMetrics] = []
    with pytest.raises(NonFiniteLoss, match=f"the loss of step {DIVERGES_AT} is inf") as err:
        sf.run(diverging(mlp), backend=backend, on_step=steps.append, timeout=120)
    assert err.value.step == DIVERGES_AT and err.value.reason == NON_FINITE_LOSS
    assert [m.step for m in steps] == [1, 2] and math.isfinite(steps[0].loss) and math.isinf(steps[1].loss)


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
def test_finite_losses_with_non_finite_parameters_fail_naming_them(
    mlp: ModuleType, backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if backend == "ray":
        request.getfixturevalue("ray_local")
    job, init = overflowing(mlp, tmp_path)
    with pytest.raises(NonFiniteParameters, match=r"after step 1 the parameters \['model.net.0.bias'") as err:
        sf.run(job, backend=backend, init_from=init, timeout=120)
    assert err.value.reason == NON_FINITE_PARAMETERS and "model.net.2.weight" in err.value.names


def test_the_tracker_stops_at_the_first_non_finite_step_and_reports_no_later_one() -> None:
    decl = TensorDecl("loss", TensorMeta((), DType.float32), placement=placement("cpu", [0, 1]), sbp=(P,))
    seen: list[sp.StepMetrics] = []
    stops: list[int] = []
    t = StepTracker(decl, 4, seen.append, job="j", first_step=10, stop=lambda: stops.append(1))
    for step, (a, b) in enumerate([(0.5, 0.25), (np.nan, 1.0), (1.0, 1.0)]):
        t.add(0, step, a)
        t.add(1, step, b)
    assert [m.step for m in seen] == [1, 2] and math.isnan(seen[1].loss) and stops == [1]
    assert t.non_finite is not None and t.non_finite.step == 12  # the job's step: first_step + 2
    skipping = StepTracker(decl, 4, seen.append, on_non_finite=lambda step, value: True)  # issue 18's hook
    skipping.add(0, 0, np.inf)
    skipping.add(1, 0, 0.0)
    skipping.settle([1.0, 2.0], 0)  # an outcome completes the steps whose reports never came
    assert skipping.skipped == 1 and skipping.non_finite is None and len(skipping.losses) == 2


# ---- through the service: status, events, List, the HTTP JSON ------------------------------------------


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp: Path = tmp_path_factory.mktemp("numerics")
    cfg = ServerConfig(store=str(tmp / "jobs.db"), run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2)
    p = ControlPlane(cfg).start()
    yield p
    p.stop()


def test_a_diverging_job_ends_failed_with_the_step_in_status_events_list_and_json(
    plane: ControlPlane, mlp: ModuleType
) -> None:
    with Client(plane.address) as c:
        h = c.submit(diverging(mlp, steps=50))
        st = h.wait(60)
        assert st.state == sp.JOB_STATE_FAILED and st.reason == NON_FINITE_LOSS, st
        assert f"step {DIVERGES_AT}" in st.message and st.step == DIVERGES_AT and math.isinf(st.loss)
        events = list(h.events())
        steps = [e.step for e in events if e.HasField("step")]
        assert [m.step for m in steps] == [1, 2] and math.isinf(steps[-1].loss)
        assert events[-1].status.reason == NON_FINITE_LOSS and events[-1].status.step == DIVERGES_AT
        assert h.job_id in [j.job_id for j in c.list()]
    base = plane.http_address

    def strict(path: str) -> object:  # JSON has no NaN: the body must parse without it
        with urllib.request.urlopen(f"{base}{path}", timeout=30) as r:
            return json.loads(r.read(), parse_constant=lambda name: pytest.fail(f"{path} holds {name}"))

    job = strict(f"/v1/jobs/{h.job_id}")
    assert isinstance(job, dict) and job["loss"] == "Infinity" and job["reason"] == NON_FINITE_LOSS
    assert job["losses"][1] == "Infinity" and isinstance(job["losses"][0], float)
    listed = strict("/v1/jobs")
    assert isinstance(listed, dict) and any(j["job_id"] == h.job_id for j in listed["jobs"])
    with urllib.request.urlopen(f"{base}/", timeout=30) as r:
        assert r.status == 200 and h.job_id in r.read().decode()

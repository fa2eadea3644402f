"""``sf.run``: results, backends, the trace, and failures that stop every rank without a hang."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.actor_workers.runtime.errors import RuntimeFailure, RuntimeTimeout
from sbpflow.actor_workers.runtime.trace import chrome_trace
from sbpflow.actor_workers.transport.base import TransportError
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.launch import launcher as api
from sbpflow.errors import SbpflowError, ShapeError
from sbpflow.ops.base import OPS, KernelContext, get_op
from sbpflow.oracle import reference
from sbpflow.runs.states import JobState
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"threads left running: {left}"


def mlp(**kw: Any) -> sf.Job:
    args = {"n_in": 8, "hidden": 16, "n_out": 4, "batch_size": 8, "steps": 3, **kw}
    return as_float64(load("mlp").make_job(**args), batches=args["steps"])


def test_run_returns_the_losses_of_every_step_and_on_request_the_parameters() -> None:
    job = mlp(ranks=2)
    result = sf.run(job, backend="inprocess")
    assert isinstance(result, api.RunResult) and result.parameters is None and result.trace is None
    want = reference.train(job)
    assert len(result.losses) == job.config.steps and all(isinstance(x, float) for x in result.losses)
    np.testing.assert_allclose(result.losses, want.losses, rtol=1e-12)
    two = sf.run(job, steps=2, return_parameters=True, backend="inprocess")
    assert len(two.losses) == 2 and two.parameters is not None
    assert set(two.parameters) == {p.tensor for p in job.parameters}
    assert all(v.shape == job.graph.tensors[k].meta.shape for k, v in two.parameters.items())


def test_a_run_is_asked_by_one_value_or_by_its_fields_as_keywords() -> None:
    job = mlp(ranks=2)
    asked = sf.RunRequest(options=sf.RunOptions(backend="inprocess"), steps=2)
    by_value = sf.run(job, asked)
    by_keywords = sf.run(job, backend="inprocess", steps=2)
    assert by_value.losses == by_keywords.losses and len(by_value.losses) == 2
    on_top = asked.replace(timeout=30.0, steps=1)  # a RunOptions field goes into options
    assert on_top.options == sf.RunOptions(backend="inprocess", timeout=30.0) and on_top.steps == 1
    assert asked.steps == 2 and asked.options.timeout != 30.0  # a value: replace makes a new one
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['stpes'\].*'steps'.*'backend'"):
        sf.run(job, stpes=2, backend="inprocess")


def test_a_finished_run_frees_its_memory_when_it_returns() -> None:
    import gc

    from sbpflow.actor_workers.runtime.engine import Engine

    def engines() -> int:
        return sum(isinstance(o, Engine) for o in gc.get_objects())

    gc.collect()
    before = engines()
    gc.disable()  # only the run itself may free its engines (and the registers and store they hold)
    try:
        sf.run(mlp(ranks=2), steps=1, backend="inprocess")
        assert engines() == before, "a finished run's engines are still alive"
    finally:
        gc.enable()


def test_an_in_process_run_reads_the_jobs_in_memory_arrays_without_copying_them() -> None:
    """The plan carries an in-memory source's arrays once (``Plan.data``, not ``Plan.job.data`` too), and an
    in-process run reads the job's own arrays, not a copy decoded from the plan: ResNet-18's benchmark images
    were held 3 more times (7.2 MB of its 38.7 MB peak)."""
    import tracemalloc

    job = as_float64(load("mlp").make_job(ranks=2, steps=2))
    assert isinstance(job.data, sf.data.ArraySource)
    n = 1 << 17  # 20 MB of rows
    arrays = {k: np.resize(v, (n, *v.shape[1:])) for k, v in job.data.arrays.items()}
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, arrays=arrays))
    held = sum(a.nbytes for a in arrays.values())
    grown: list[int] = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        got = sf.run(
            job, backend="inprocess", on_step=lambda s: grown.append(tracemalloc.get_traced_memory()[0])
        )
    finally:
        tracemalloc.stop()
    assert len(got.losses) == 2
    assert grown[0] - before < held / 4, f"{(grown[0] - before) / 1e6:.1f} MB more at the first step"
    plan = pipeline.compile(job).plan
    assert plan is not None and not plan.job.HasField("data")
    assert plan.data.in_memory.arrays.keys() == arrays.keys()


def test_sf_run_is_the_launchers_and_import_sbpflow_does_not_load_it() -> None:
    assert sf.run is api.run
    code = (
        "import sys, sbpflow as sf; heavy = ('ray', 'grpc', 'sbpflow.actor_workers.runtime', "
        "'sbpflow.control_plane.compiler.pipeline'); print(sorted(m for m in sys.modules if m.startswith(heavy)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_backends() -> None:
    job = mlp(ranks=1)
    with pytest.raises(SbpflowError, match="'gpu'.*ray.*inprocess"):
        sf.run(job, backend="gpu")


def test_the_trace_shows_every_rank_and_stream_and_exports_to_chrome_json() -> None:
    result = sf.run(mlp(ranks=4, pp=2, micro_batches=4), steps=2, trace=True, backend="inprocess")
    assert result.trace is not None
    assert {e.rank for e in result.trace} == {0, 1, 2, 3}
    assert {e.stream for e in result.trace} == {"compute", "comm", "data"}
    assert {e.iteration for e in result.trace} == {0, 1}
    assert {e.args["micro_batch"] for e in result.trace} >= {0, 1, 2, 3}
    doc = json.loads(json.dumps(chrome_trace(result.trace)))
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == len(result.trace)


# ---- failures -----------------------------------------------------------------------------------------


def patch_kernel(monkeypatch: pytest.MonkeyPatch, op_type: str, kernel: Any) -> None:
    monkeypatch.setitem(OPS._items, op_type, dataclasses.replace(get_op(op_type), kernel=kernel))


def unfused(job: sf.Job) -> sf.Job:
    """``job`` with one act an op: a patched kernel of an op that fusion would put in a chain still runs."""
    return dataclasses.replace(job, config=dataclasses.replace(job.config, fusion=False))


def test_a_failing_kernel_stops_every_rank_and_names_the_rank_and_the_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 2 of DP 4 fails in relu at step 1 while the others go on into the gradient all-reduce and
    wait for it there; all of them stop within seconds."""
    relu = get_op("relu").kernel

    def failing(ctx: KernelContext, x: Any) -> Any:
        if ctx.in_index[0][0].start == 4 and ctx.step == 1:  # rows 4..5 of 8: rank 2
            raise FloatingPointError("injected failure")
        return relu(ctx, x)

    patch_kernel(monkeypatch, "relu", failing)
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        sf.run(unfused(mlp(ranks=4)), timeout=60, backend="inprocess")
    assert time.monotonic() - t0 < 10
    failure = info.value
    assert (failure.rank, failure.op, failure.iteration) == (2, "relu", 1)
    assert isinstance(failure.cause, FloatingPointError)
    assert "rank 2" in str(failure) and "relu" in str(failure) and "injected failure" in str(failure)


def test_a_kernel_that_returns_the_wrong_shape_is_a_shape_error_naming_the_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    patch_kernel(monkeypatch, "relu", lambda ctx, x: x[:1])
    with pytest.raises(RuntimeFailure) as info:
        sf.run(unfused(mlp(ranks=2)), timeout=60, backend="inprocess")
    assert isinstance(info.value.cause, ShapeError) and info.value.op == "relu"
    assert "model.net.1.relu_0" in str(info.value.cause) and "[1, 16]" in str(info.value.cause)


def test_a_rank_stuck_in_a_kernel_times_the_run_out_naming_what_stalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 2 hangs inside a kernel (out of the engine's and the transport's reach) while the others wait
    for it in a collective: the run stops at its timeout with a report of the stalled actors, and the
    threads end once the stuck act returns."""
    relu = get_op("relu").kernel
    release = threading.Event()

    def stuck(ctx: KernelContext, x: Any) -> Any:
        if ctx.in_index[0][0].start == 4:
            release.wait(3)
        return relu(ctx, x)

    patch_kernel(monkeypatch, "relu", stuck)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeFailure) as info:
            sf.run(unfused(mlp(ranks=4)), timeout=1.0, backend="inprocess")
    finally:
        release.set()
    assert time.monotonic() - t0 < 10
    assert isinstance(info.value, RuntimeTimeout) or isinstance(info.value.cause, TransportError)
    if isinstance(info.value, RuntimeTimeout):
        assert "not done after 1.0s" in str(info.value) and "is inside its act" in str(info.value)


# ---- progress and cancel --------------------------------------------------------------------------------


def test_listeners_see_states_every_step_and_every_workers_reports() -> None:
    states: list[str] = []
    steps: list[Any] = []
    reports: list[Any] = []
    result = sf.run(
        mlp(ranks=2),
        steps=3,
        backend="inprocess",
        on_state=states.append,
        on_step=steps.append,
        on_report=reports.append,
        job_id="j1",
    )
    assert states == [JobState.COMPILING, JobState.STARTING, JobState.RUNNING]
    assert [m.step for m in steps] == [1, 2, 3]
    assert [m.loss for m in steps] == pytest.approx(result.losses, rel=1e-6)
    assert all(m.samples_per_second > 0 and m.step_seconds > 0 for m in steps)
    kinds = {(r.rank, r.WhichOneof("payload")) for r in reports}
    assert {(0, "done"), (1, "done")} <= kinds
    assert any(k == "step" for _, k in kinds) and all(r.job_id == "j1" for r in reports)


def test_a_set_cancel_event_stops_the_run_promptly() -> None:
    cancel = threading.Event()

    def cancel_after_first(m: Any) -> None:
        cancel.set()

    # the process's shared pools (sbpflow/data/images.py's decoders) may be up from an earlier test
    before = set(threading.enumerate())
    t0 = time.monotonic()
    with pytest.raises(api.RunCancelled, match="cancelled at step"):
        sf.run(mlp(ranks=2), steps=10_000, backend="inprocess", on_step=cancel_after_first, cancel=cancel)
    assert time.monotonic() - t0 < 60  # 10,000 steps would take far longer
    assert not [t for t in threading.enumerate() if t.name.startswith("sbpflow") and t not in before]


def cuda_mlp(ranks: int) -> sf.Job:
    ex = load("mlp")
    where = sf.placement("cuda", ranks=list(range(ranks)))
    model = ex.MLPRegression(8, 16, 4, 1)
    sf.nn.parallel.data_parallel(model, where)
    data = sf.data.SyntheticSource(batch_size=8, kind="regression", params={"in": 8, "out": 4}, seed=0)
    return ex.TrainMLP(model, 0.05, 2).trace(data, placement=where, input_sbp=(sf.sbp.split(0),))


def test_a_cuda_job_runs_its_kernels_on_cupy_or_says_how_to_get_it() -> None:
    from sbpflow.device import gpu_available

    if gpu_available():
        pytest.skip("a GPU is here: tests/gpu covers the cuda path")
    with pytest.raises(SbpflowError, match=r"cupy.*pip install 'sbpflow\[gpu\]'"):
        sf.run(cuda_mlp(1), backend="inprocess")
    with pytest.raises(SbpflowError, match="runs on backend='ray'"):
        sf.run(cuda_mlp(2), backend="inprocess")

"""The cost model (control_plane/compiler/cost/cost_model.py) and the ops' flop counts (sbpflow/ops/flops.py).

Deterministic properties only, on a fixed hand-made profile (or the saved H200 one): the measured CPU
profile is timed once, for its shape. How well the model ranks measured step times is
bench/compiler/plan_quality.py's business, not a test's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sbpflow.boxing import Collective, plan_boxing
from sbpflow.client.cli.main import main
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.cost.cost_model import (
    DeviceProfile,
    LinkProfile,
    ProfileError,
    StepEstimate,
    estimate,
    load_profile,
    step_seconds,
)
from sbpflow.control_plane.compiler.cost.stage_load import (
    DataCost,
    call_key,
    data_seconds,
    handoffs,
    input_stage,
    loads,
    ranks_of,
)
from sbpflow.control_plane.compiler.cost.step_sim import order
from sbpflow.control_plane.compiler.passes.micro_batching import layout
from sbpflow.control_plane.compiler.search.auto_layouts import Layout, relayout
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.control_plane.profiling import kernel_probe
from sbpflow.control_plane.profiling.cpu_links import median_link
from sbpflow.control_plane.profiling.cpu_profile import MAX_ROWS, measure_cpu_profile, read_cost
from sbpflow.control_plane.profiling.kernel_probe import measure_kernels, probe_array
from sbpflow.dtype import DType
from sbpflow.errors import SbpflowError
from sbpflow.job import Precision
from sbpflow.ops import flops
from sbpflow.ops.base import OPS, get_op
from sbpflow.ops.flops import work
from sbpflow.ops.fused import FUSABLE
from sbpflow.placement import placement
from sbpflow.registry import Registry
from sbpflow.sbp import B, P, S
from sbpflow.tensor_meta import TensorMeta
from tests.examples.test_examples import EXAMPLES, load

# round figures, so that every expectation below is exact arithmetic
FIXED = DeviceProfile(
    name="fixed",
    flops_per_s={"float32": 1e12},
    mem_bytes_per_s=1e11,
    links={"shm": LinkProfile(latency_s=1e-5, bytes_per_s=1e9), "slow": LinkProfile(1e-5, 1e8)},
    op_overhead_s=0.0,
)
# a CPU host of 2 cores, one BLAS thread a rank, whose regression data costs 0.1 ms a sample row and
# 0.5 ms a read
HOST = replace(
    FIXED,
    name="host",
    links={
        **FIXED.links,
        "inprocess": LinkProfile(1e-5, 1e9, {"all-gather": (2e-5, 4e9)}, {"all-reduce": (3e-5, 2e9)}),
    },
    host_cores=2,
    threads=1,
    data_row_s={"SyntheticSource:regression": 1e-4},
    data_read_s={"SyntheticSource:regression": 5e-4},
    handoff_s=0.0,
)
F32 = DType.float32


def meta(*shape: int) -> TensorMeta:
    return TensorMeta(tuple(shape), F32)


def compiled(example: str, **kwargs: Any) -> pipeline.Compiled:
    return pipeline.compile(load(example).make_job(**kwargs))


# ---- the ops' flop counts ------------------------------------------------------------------------------


def test_every_op_declares_its_flops() -> None:
    missing = sorted(name for name, op in OPS.items() if op.flops is None)
    assert not missing, f"declare flops= in the defop of {missing}"


@pytest.mark.parametrize("transpose_a", [False, True])
def test_matmul_flops_are_two_per_multiply_add(transpose_a: bool) -> None:
    a = meta(4, 16, 128) if not transpose_a else meta(4, 128, 16)
    w = work("matmul", (a, meta(128, 384)), (meta(4, 16, 384),), {"transpose_a": transpose_a})
    assert w.flops == 2 * 4 * 16 * 384 * 128
    assert w.bytes == (4 * 16 * 128 + 128 * 384 + 4 * 16 * 384) * 4


def test_every_fusable_op_counts_per_element() -> None:
    """A fused chain's flops are its steps' per-element counts (fused.py's _flops)."""
    assert all(isinstance(get_op(name).flops, int) for name in FUSABLE)
    chain = '[["mul", {}, ["in0", "in1"]], ["gelu", {}, ["s0"]]]'
    w = work("fused_elementwise", (meta(4, 8), meta(4, 8)), (meta(4, 8),), {"chain": chain})
    assert w.flops == (1 + 8) * 32 and w.bytes == 3 * 32 * 4


def test_views_move_nothing_and_ops_without_a_count_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert work("reshape", (meta(4, 8),), (meta(32),), {"shape": (32,)}).bytes == 0
    with pytest.raises(KeyError, match="no flop count; declare it in the op's defop: flops="):
        work("no_such_op", (), (), {})
    undeclared: Registry[Any] = Registry("op")
    undeclared.register("add", replace(get_op("add"), flops=None))
    monkeypatch.setattr(flops, "OPS", undeclared)
    with pytest.raises(KeyError, match="op 'add' has no flop count; declare it in the op's defop"):
        work("add", (meta(4),), (meta(4),), {})


def test_attention_flops_are_exact_in_a_compiled_gpt() -> None:
    """The two batched products of causal attention, q k^T and att v: 2 * B * H * T * T * Dh each per
    layer, on one rank that holds the whole batch; each backward product costs the same again, twice.
    The one ``attention`` op (sbpflow/ops/attention.py) adds its pass over the T * T scores: 7 a score
    forward (scale, mask, max, subtract, exp, sum, divide), 5 backward."""
    b, t, h, d, layers = 4, 16, 4, 128, 2
    est = estimate(compiled("gpt", ranks=1, heads=h, width=d, seq_len=t, batch_size=b, layers=layers), FIXED)
    # folded with its layout ops (which count nothing) as qkv_attention and its gradient (attention_core.py)
    kinds = ("attention", "attention_grad")
    flops = {op: sum(c.flops for c in est.by_op if c.op_type in (op, f"qkv_{op}")) for op in kinds}
    scores, products = b * h * t * t, 2 * (2 * b * h * t * t * (d // h))
    assert flops["attention"] == layers * (products + 7 * scores)
    assert flops["attention_grad"] == layers * (2 * products + 5 * scores)


# ---- profiles ------------------------------------------------------------------------------------------


def test_profile_json_round_trips(tmp_path: Path) -> None:
    for p in (FIXED, HOST, replace(HOST, handoff_s=2e-5), load_profile("h200")):
        assert DeviceProfile.from_json(p.to_json()) == p
        file = tmp_path / f"{p.name}.json"
        file.write_text(p.to_json())
        assert load_profile(str(file)) == p


def test_the_h200_profile_holds_the_published_figures() -> None:
    h = load_profile("h200")
    assert h.peak("bfloat16") == h.peak("float16") == 989.5e12  # 1,979 TFLOPS with sparsity, halved
    assert h.peak("float64") == 67e12 and h.mem_bytes_per_s == 4.8e12 and h.link().bytes_per_s == 450e9


def test_a_matmul_runs_at_its_dtypes_peak() -> None:
    """bf16 compute on the H200: each matmul at 989.5 TFLOP/s (or HBM bandwidth, if slower), plus the
    launch; the same job in fp32 at 67 TFLOP/s."""
    h = load_profile("h200")
    for precision, peak in ((Precision.bf16, 989.5e12), (Precision.fp32, 67e12)):
        job = load("gpt").make_job(ranks=1, width=128)
        job.config = replace(job.config, precision=precision)
        mm = [c for c in estimate(pipeline.compile(job), h).by_op if c.op_type == "matmul"]
        assert mm and all(
            c.seconds == pytest.approx(max(c.flops / peak, c.bytes / 4.8e12) + 1e-5) for c in mm
        )


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(ProfileError, match=r"no device profile 'a100'.*'cpu', 'h200'"):
        load_profile("a100")


def test_a_malformed_profile_file_says_what_it_needs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "flops_per_s": {"float32": 1.0}}')
    with pytest.raises(ProfileError, match="needs name, flops_per_s"):
        load_profile(str(bad))
    with pytest.raises(ProfileError, match="no link 'nvlink'; its links are"):
        FIXED.link("nvlink")


def test_the_measured_cpu_profile_is_positive_everywhere() -> None:
    p = measure_cpu_profile(0.2)
    assert min(p.flops_per_s.values()) > 0 and p.mem_bytes_per_s > 0 and p.op_overhead_s > 0
    assert p.handoff_s >= 0  # a thread woken: what it costs beyond an act (0 where the load hid it)
    assert set(p.links) == {"inprocess", "shm", "tcp"}
    assert all(x.latency_s > 0 and x.bytes_per_s > 0 for x in p.links.values())
    for link in p.links.values():  # each collective of the boxing table measured apart
        assert set(link.collectives) == {"all-gather", "reduce-scatter", "all-to-all", "point-to-point"}
        assert all(lat > 0 and bw > 0 for lat, bw in link.collectives.values())
    # the interpreter time of a call only where ranks are threads of one process
    held = p.links["inprocess"].interpreter
    assert set(held) == {"all-reduce", *p.links["inprocess"].collectives}
    assert all(s > 0 and bw > 0 for s, bw in held.values())
    assert not p.links["shm"].interpreter and not p.links["tcp"].interpreter
    # each synthetic kind the examples read: a cost a read and a cost a row
    kinds = {f"SyntheticSource:{k}" for k in ("regression", "tokens", "clicks")}
    assert set(p.data_read_s) == set(p.data_row_s) == kinds
    assert all(
        p.data_read_s[k] >= 0 and p.data_row_s[k] >= 0 and p.data_read_s[k] + p.data_row_s[k] > 0
        for k in kinds
    )


def test_a_links_figures_are_the_medians_of_its_measurements() -> None:
    """One slow spell in three measurements moves no figure: each is its median, the pairs element by
    element."""
    runs = [
        LinkProfile(1e-5, 1e9, {"all-gather": (2e-5, 4e9)}, {"all-reduce": (3e-5, 2e9)}),
        LinkProfile(9e-5, 1e8, {"all-gather": (9e-5, 1e8)}, {"all-reduce": (9e-4, 1e8)}),  # the slow spell
        LinkProfile(2e-5, 2e9, {"all-gather": (1e-5, 5e9)}, {"all-reduce": (4e-5, 3e9)}),
    ]
    got = median_link(runs)
    assert got == LinkProfile(2e-5, 1e9, {"all-gather": (2e-5, 4e9)}, {"all-reduce": (4e-5, 2e9)})


@dataclass(frozen=True)
class _Recording:
    """A source that reads nothing and keeps each read's (step, rows)."""

    batch_size: int
    seen: list[tuple[int, int]]

    def read(self, step: int, rows: slice) -> dict[str, Any]:
        self.seen.append((step, rows.stop - rows.start))
        return {}


@pytest.mark.parametrize(("batch", "timed"), [(300, 300), (10**6, MAX_ROWS)])
def test_a_read_is_timed_on_the_batch_and_on_steps_not_read_before(batch: int, timed: int) -> None:
    """A rank reads its share of the batch or all of it, each step a new one: the fit is over 1 row and
    the whole batch (at most MAX_ROWS), and no read repeats a step, whose draws would be in the caches."""
    src = _Recording(batch, [])
    cost = read_cost(src, 0.01)
    assert {n for _, n in src.seen} == {1, timed}
    assert len({step for step, _ in src.seen}) == len(src.seen)
    assert cost.read_s >= 0 and cost.row_s >= 0


# ---- communication -------------------------------------------------------------------------------------


def test_collective_time_is_latency_plus_bytes_with_the_ring_factor() -> None:
    pl = placement("cpu", [0, 1, 2, 3])
    t = meta(1024, 256)  # 1 MiB
    link = FIXED.link()
    ar = plan_boxing(t, pl, (P,), pl, (B,))
    (step,) = ar.steps
    assert step.collective is Collective.all_reduce
    assert step_seconds(step, ar, link, FIXED.mem_bytes_per_s) == pytest.approx(
        6 * 1e-5 + 2 * 3 / 4 * t.nbytes / 1e9
    )
    ag = plan_boxing(t, pl, (S(0),), pl, (B,))
    assert step_seconds(ag.steps[0], ag, link, 1e11) == pytest.approx(3 * 1e-5 + 3 / 4 * t.nbytes / 1e9)


def test_a_collective_measured_apart_uses_its_own_figures() -> None:
    link = HOST.link("inprocess")
    assert link.seconds(Collective.all_gather, 4, 4e6) == pytest.approx(3 * 2e-5 + 4e6 / 4e9)
    assert link.seconds(Collective.reduce_scatter, 4, 4e6) == pytest.approx(3 * 1e-5 + 4e6 / 1e9)
    assert link.seconds(Collective.all_reduce, 1, 4e6) == 0.0  # a group of one sends nothing


def test_a_collectives_interpreter_time_is_per_call_not_per_hop() -> None:
    """Every rank meets the others once at an in-process rendezvous: its interpreter seconds are a call's
    plus its bytes at the rate a thread moves them, for any group size; none for a group of one, or a
    collective (or a link) without the figure."""
    link = HOST.link("inprocess")
    for p in (2, 4, 8):
        assert link.cpu_seconds(Collective.all_reduce, p, 4e6) == pytest.approx(3e-5 + 4e6 / 2e9)
    assert link.cpu_seconds(Collective.all_reduce, 1, 4e6) == 0.0
    assert link.cpu_seconds(Collective.all_gather, 4, 4e6) == 0.0
    assert FIXED.link().cpu_seconds(Collective.all_reduce, 4, 4e6) == 0.0


def test_in_process_ranks_take_turns_in_their_collectives() -> None:
    """Data parallel in process: each gradient all-reduce holds the interpreter on every rank, so the
    step's interpreter bound grows by the ranks' calls one after the other; over shm (processes) the
    same figure costs nothing."""
    c = compiled("mlp", ranks=2)
    bare = replace(HOST, links={**HOST.links, "inprocess": replace(HOST.link("inprocess"), interpreter={})})
    held, free = estimate(c, HOST, "inprocess"), estimate(c, bare, "inprocess")
    calls = [
        (h, f) for h, f in zip(held.by_op, free.by_op, strict=True) if h.comm and h.python_s > f.python_s
    ]
    assert calls  # the all-reduces
    assert all(h.seconds >= f.seconds for h, f in calls)
    assert held.step_s > free.step_s and held.bound == "one interpreter (the GIL)"
    assert estimate(c, HOST, "shm") == estimate(c, bare, "shm")


def test_modelled_time_is_monotonic_in_bytes() -> None:
    pl = placement("cpu", [0, 1])
    times = []
    for rows in (8, 64, 512, 4096):
        plan = plan_boxing(meta(rows, 64), pl, (P,), pl, (B,))
        times.append(step_seconds(plan.steps[0], plan, FIXED.link(), 1e11))
    assert times == sorted(times) and len(set(times)) == len(times)
    small, big = (estimate(compiled("mlp", ranks=2, hidden=h), FIXED) for h in (16, 256))
    assert big.comm_s > small.comm_s and big.compute_s > small.compute_s


def test_a_slower_link_costs_more_and_never_less_than_compute() -> None:
    c = compiled("gpt", ranks=2)
    fast, slow = estimate(c, FIXED, "shm"), estimate(c, FIXED, "slow")
    assert slow.comm_s > fast.comm_s and slow.step_s > fast.step_s
    assert slow.compute_s == fast.compute_s


# ---- compute and overlap -------------------------------------------------------------------------------


def test_more_ranks_less_compute_per_rank() -> None:
    per_rank = [
        estimate(compiled("mlp", ranks=n, batch_size=64, hidden=256), FIXED).compute_s for n in (1, 2, 4)
    ]
    assert per_rank[0] > per_rank[1] > per_rank[2]
    tp = [estimate(compiled("gpt", ranks=n, tp=n > 1, width=128), FIXED).compute_s for n in (1, 2, 4)]
    assert tp[0] > tp[1] > tp[2]


LAYOUTS = [
    ("mlp", {"ranks": 1}),
    ("mlp", {"ranks": 2}),
    ("mlp", {"ranks": 4, "tp": True}),
    ("gpt", {"ranks": 2}),
    ("gpt", {"ranks": 4, "tp": True}),
    ("gpt", {"ranks": 4, "tp": True, "dp": 2}),
    ("gpt", {"ranks": 2, "pp": 2, "micro_batches": 4}),
    ("gpt", {"ranks": 4, "pp": 2, "micro_batches": 2}),
]


@pytest.mark.parametrize(("example", "kwargs"), LAYOUTS, ids=[f"{e}-{k}" for e, k in LAYOUTS])
def test_overlap_never_exceeds_communication(example: str, kwargs: dict[str, Any]) -> None:
    e = estimate(compiled(example, **kwargs), FIXED, "slow")
    assert 0.0 <= e.exposed_comm_s <= e.comm_s + 1e-15
    assert e.step_s >= e.compute_s
    if kwargs.get("pp", 1) == 1:  # one stage: two in-order streams never take longer than both in turn
        assert e.step_s <= e.compute_s + e.comm_s + 1e-12
    assert sum(c.seconds for c in e.by_op) == pytest.approx(
        e.comm_s + sum(c.seconds for c in e.by_op if not c.comm)
    )


def test_gradient_all_reduces_overlap_the_rest_of_backward() -> None:
    """Data parallelism where compute dominates: with one all-reduce per gradient (no buckets) all but
    the first layer's hide behind the backward still to run; one bucket for the whole model (the default
    25 MiB) is ready only when backward is done, and is exposed whole."""
    slow_compute = replace(FIXED, flops_per_s={"float32": 1e9}, mem_bytes_per_s=1e9)
    out = {}
    for bucket in (0, 25 * 2**20):
        job = load("mlp").make_job(ranks=2, layers=4, batch_size=256)
        job.config = replace(job.config, grad_bucket_bytes=bucket)
        e = estimate(pipeline.compile(job), slow_compute)
        grads = [c for c in e.by_op if c.comm and c.name.startswith("grad/")]
        assert grads and all(c.op_type == "boxing" for c in grads) and e.comm_s < 0.1 * e.compute_s
        out[bucket] = e, sum(c.seconds for c in grads)
    (each, each_s), (one, one_s) = out[0], out[25 * 2**20]
    assert each.overlapped_comm_s > 0.8 * each_s
    assert one.exposed_comm_s >= one_s * (1 - 1e-9)


def test_pipeline_stages_overlap() -> None:
    """Four micro-batches on two stages: the stages run at once, so the step is shorter than both
    stages' compute in turn, and longer than the busiest stage's alone (the bubble)."""
    e = estimate(compiled("gpt", ranks=2, pp=2, micro_batches=4, layers=4), FIXED)
    per_stage = [sum(c.seconds for c in e.by_op if c.stage == s and not c.comm) for s in (0, 1)]
    assert max(per_stage) == pytest.approx(e.compute_s)
    assert e.compute_s < e.step_s < sum(per_stage) + e.comm_s


# ---- what a host shares ---------------------------------------------------------------------------


def test_data_loading_costs_its_rows_and_bounds_the_step() -> None:
    """x [32, 16] and y [32, 4] float32 a step: one read (both inputs' rows at once) at 0.5 ms, 32 rows
    at 0.1 ms and their bytes at memory bandwidth; the loader runs ahead, so a step that computes for less
    is as long as its loading."""
    e = estimate(compiled("mlp", ranks=1, batch_size=32), HOST)
    assert e.data_s == pytest.approx(5e-4 + 32 * 1e-4 + 32 * (16 + 4) * 4 / 1e11)
    assert e.compute_s < e.data_s and e.step_s == pytest.approx(e.data_s)
    assert e.bound == "data loading"
    assert estimate(compiled("mlp", ranks=1, batch_size=64), HOST).data_s > e.data_s


def test_each_micro_batch_is_a_read_where_the_inputs_are_placed() -> None:
    """Two pipeline stages, the inputs placed on stage 0 (as the search lays them out): stage 0's ranks
    load x and y, the last stage, which reads y, loads nothing (it receives y); each micro-batch is a read
    of its own, so twice the micro-batches of half the rows cost two more reads a step."""
    job = load("mlp").make_job(ranks=2, batch_size=32)
    one, two = (pipeline.compile(relayout(job, Layout(pp=2, micro_batches=m))) for m in (2, 4))
    for c in (one, two):
        y = c.state.graph.tensors["y"]
        assert any(o.stage == 1 and "y" in o.inputs for o in c.state.graph.ops) and y.placement is not None
        assert set(
            data_seconds(c.state, layout(c.state), HOST.data(c.state.job.data), 1e11, input_stage(c.state))
        ) == {0}
    e1, e2 = estimate(one, HOST), estimate(two, HOST)
    assert e2.data_s - e1.data_s == pytest.approx(2 * 5e-4)


@pytest.mark.parametrize(
    "kw", [{"ranks": 1}, {"ranks": 2, "tp": True}, {"ranks": 2, "pp": 2, "micro_batches": 2}]
)
def test_hand_offs_between_streams_are_counted_as_the_plan_has_them(kw: dict[str, Any]) -> None:
    """The registers a rank's plan hands from one stream to another a step (data to compute, compute to
    communication and back), counted from the graph, are each rank's plan's within two (the plan's
    fetch and loop edges the graph does not show)."""
    c = compiled("mlp", **kw)
    calls: dict[str, int] = {}
    for name, _ in order(layout(c.state)):
        calls[name] = calls.get(name, 0) + 1
    modelled = handoffs(c.state, calls)
    assert c.plan is not None
    for d in c.plan.devices:
        stream = {t.id: t.stream for t in d.tasks}
        crossing = sum(
            stream[t] != stream[r.producer_task]
            for r in d.registers
            for t in r.consumer_tasks
            if t in stream and r.producer_task in stream
        )
        stage = next(s for s, ranks in ranks_of(c.state).items() if d.rank in ranks)
        assert abs(modelled[stage] - crossing) <= 2


def test_a_hand_off_is_its_ranks_busy_time_not_the_shared_interpreters() -> None:
    """Each hand-off of a rank adds ``handoff_s`` to the rank's busy seconds (its compute, which the
    host's cores bound); ranks in one interpreter hide each other's hand-offs, so the interpreter they
    share holds none of them (step_sim's docstring)."""
    c = compiled("mlp", ranks=2, tp=True)
    calls: dict[str, int] = {}
    for name, _ in order(layout(c.state)):
        calls[name] = calls.get(name, 0) + 1
    n = sum(handoffs(c.state, calls).values())  # one rank's: the plan's one stage
    roomy = replace(HOST, host_cores=64)  # the host's cores bound nothing
    base, woken = (estimate(c, replace(roomy, handoff_s=h), "inprocess") for h in (0.0, 1e-3))
    assert n > 0 and woken.compute_s - base.compute_s == pytest.approx(n * 1e-3)
    assert woken.bound == base.bound == "one interpreter (the GIL)" and woken.step_s == base.step_s
    one_core = replace(HOST, host_cores=1)
    base, woken = (estimate(c, replace(one_core, handoff_s=h), "shm") for h in (0.0, 1e-3))
    assert woken.bound == "the host's cores" and woken.step_s - base.step_s == pytest.approx(2 * n * 1e-3)


def test_in_process_ranks_hold_the_interpreter_for_what_their_rooflines_do_not_explain() -> None:
    """The shared interpreter's bound is the ranks' kernels beyond their rooflines (a small kernel's
    Python and numpy dispatch: here all of a 1 ms kernel, so twice the kernels' time is twice that
    bound), plus their collectives' CPU, data and acts; the roofline's part of a kernel (a BLAS call, a
    long numpy loop) runs with the GIL released, and the ranks' Load then holds only its act."""
    c = compiled("mlp", ranks=2, tp=True)
    timed = {call_key(c.state, o): 1e-3 for o in c.state.graph.ops if o.op_type != "boxing"}
    slow = {k: 2 * t for k, t in timed.items()}
    quiet = replace(HOST, data_row_s={}, data_read_s={}, host_cores=64)
    one, two = (estimate(c, quiet, "inprocess", kernels=k) for k in (timed, slow))
    kernels = sum(x.seconds for x in one.by_op if not x.comm)
    assert one.bound == two.bound == "one interpreter (the GIL)"
    assert two.step_s - one.step_s == pytest.approx(2 * kernels, rel=1e-6)  # both ranks' kernels
    lay, calls = layout(c.state), {o.name: 1 for o in c.state.graph.ops}
    ops = [x for x in one.by_op if x.op_type != "boxing"]
    boxings = [x for x in one.by_op if x.op_type == "boxing"]
    at_roofline = [replace(x, python_s=quiet.op_overhead_s) for x in ops] + boxings
    (held,) = loads(c.state, lay, at_roofline, DataCost(), 1e9, (0.0, 0.0), calls).values()
    (whole,) = loads(c.state, lay, one.by_op, DataCost(), 1e9, (0.0, 0.0), calls).values()
    assert held.compute_s == whole.compute_s  # the same kernels, busy as long
    acts, boxing = quiet.op_overhead_s * len(ops), sum(x.python_s for x in boxings)  # collectives' CPU
    assert held.interpreter_s == pytest.approx(acts + boxing + held.data_s + held.tail_s)
    beyond = sum(x.seconds for x in ops) - acts  # the kernels less their rooflines (under 1 us here)
    assert whole.interpreter_s - held.interpreter_s == pytest.approx(beyond, rel=1e-4)


def test_ranks_in_one_interpreter_take_turns() -> None:
    """Tensor parallel: both ranks load every row; as threads of one process (inprocess) one at a time,
    as processes (shm) side by side."""
    c = compiled("mlp", ranks=2, tp=True)
    apart, together = estimate(c, HOST, "shm"), estimate(c, HOST, "inprocess")
    assert together.bound == "one interpreter (the GIL)" and together.step_s >= 2 * together.data_s
    assert apart.step_s < together.step_s and apart.step_s == pytest.approx(apart.data_s, rel=1e-3)


def test_a_hosts_cores_are_shared_by_its_ranks() -> None:
    """One core for two ranks: they compute one at a time; on a host each, side by side. A device of its
    own (host_cores 0, a GPU) shares nothing."""
    slow = replace(HOST, data_row_s={}, flops_per_s={"float32": 1e9}, mem_bytes_per_s=1e9, host_cores=1)
    c = compiled("gpt", ranks=2)
    shared, own = estimate(c, slow, "shm"), estimate(c, slow, "shm", ranks_per_host=1)
    assert shared.bound == "the host's cores"
    assert shared.step_s == pytest.approx(2 * (shared.compute_s + shared.data_s))
    assert own.bound == "the critical path" and own.step_s < shared.step_s
    gpu = estimate(c, replace(slow, host_cores=0))
    assert gpu.bound == "the critical path" and gpu.step_s == pytest.approx(own.step_s)


# ---- kernels timed on this machine ------------------------------------------------------------------


def test_every_kernel_of_a_plan_runs_on_probe_inputs() -> None:
    c = compiled("gpt", ranks=2, tp=True)
    kernels = measure_kernels(c.state)
    calls = {call_key(c.state, o) for o in c.state.graph.ops if o.op_type != "boxing"}
    assert set(kernels) == calls and all(t > 0 for t in kernels.values())
    assert measure_kernels(c.state) == kernels  # timed once a process: a search's candidates share them


@pytest.mark.parametrize("together", [False, True])
def test_kernels_are_timed_as_a_run_calls_them(together: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call ``ROUNDS`` times in the graph's order, its figure the median of its thread CPU; the
    ranks of one process ``together`` each in a thread of its own, calling only its stage's kernels (a
    pipeline of 2 stages of 2 ranks: 4 threads, each call made in the 2 of its stage); apart, one thread."""
    job = load("mlp").make_job(ranks=4)
    c = pipeline.compile(relayout(job, Layout(pp=2, dp=2, micro_batches=2)))
    stages: dict[int, list[Any]] = {}
    for o in c.state.graph.ops:
        if o.op_type != "boxing" and call_key(c.state, o) not in stages.setdefault(o.stage, []):
            stages[o.stage].append(call_key(c.state, o))
    lanes: list[tuple[int, list[str]]] = []  # (thread, the ops it calls in order)
    lane, median = kernel_probe._lane, kernel_probe.statistics.median
    counts: list[int] = []

    def spy(run: Any, samples: Any, start: Any) -> None:
        lanes.append((threading.get_ident(), [op.name for _, op, _, _ in run]))
        lane(run, samples, start)  # the lanes wait for each other there: each a thread of its own

    def counted(xs: Any) -> Any:
        counts.append(len(xs))
        return median(xs)

    monkeypatch.setattr(kernel_probe, "_TIMED", {})
    monkeypatch.setattr(kernel_probe, "_lane", spy)
    monkeypatch.setattr(kernel_probe.statistics, "median", counted)
    kernels = measure_kernels(c.state, together=together)
    assert set(kernels) == {k for keys in stages.values() for k in keys} and all(
        t > 0 for t in kernels.values()
    )
    want = (
        [[k[0] for k in stages[s]] for s in (0, 0, 1, 1)]
        if together
        else [[k[0] for s in (0, 1) for k in stages[s]]]
    )
    assert [ops for _, ops in lanes] == want and len({t for t, _ in lanes}) == len(want)
    assert set(counts) == {
        kernel_probe.ROUNDS * (2 if together else 1)
    }  # a call's samples: its stage's ranks'


def test_probe_inputs_are_non_negative() -> None:
    """A second moment or a variance is never negative; a negative probe would make NaNs, and numpy's
    error path would time far slower than the kernel runs."""
    rng = np.random.default_rng(0)
    assert (probe_array(meta(64, 32), rng) >= 0).all()
    assert not probe_array(TensorMeta((16,), DType.int64), rng).any()  # zeros: every index valid


def test_a_timed_kernel_replaces_its_roofline() -> None:
    """Each op then costs its kernel plus the act, and what the roofline does not explain of the kernel
    is the interpreter's; where a kernel is timed faster than its roofline the interpreter gets nothing."""
    c = compiled("mlp", ranks=2)
    ops = {o.name: o for o in c.state.graph.ops}
    timed = {call_key(c.state, o): 1e-3 for o in ops.values() if o.op_type != "boxing"}
    plain, probed = estimate(c, FIXED), estimate(c, FIXED, kernels=timed)
    for a, b in zip(plain.by_op, probed.by_op, strict=True):
        if a.comm or a.op_type == "boxing":
            assert a == b
            continue
        calls = round(b.seconds / 1e-3)  # once per step here: no micro-batches
        assert b.seconds == pytest.approx(calls * 1e-3) and b.python_s == pytest.approx(
            calls * 1e-3 - a.seconds
        )
    assert probed.step_s > plain.step_s
    fast = estimate(c, FIXED, kernels=dict.fromkeys(timed, 1e-15))
    assert all(x.python_s == 0 for x in fast.by_op if not x.comm and x.bytes > 0)  # views: a roofline of 0


def test_zero_stages_and_recompute_are_priced() -> None:
    """ZeRO-3 gathers every weight before its use (more communication than DDP's all-reduce alone, less
    memory a device); recomputing activations runs the forward again (more compute)."""
    out = {}
    for name, change in {
        "ddp": {},
        "zero3": {"zero_stage": 3},
        "recompute": {"activation_checkpointing": True},
    }.items():
        job = load("gpt").make_job(ranks=2, layers=2)
        job.config = replace(job.config, **change)
        out[name] = estimate(pipeline.compile(job), FIXED)
    assert out["zero3"].comm_s > out["ddp"].comm_s
    assert out["zero3"].peak_memory_bytes < out["ddp"].peak_memory_bytes
    assert out["recompute"].compute_s > out["ddp"].compute_s


# ---- memory --------------------------------------------------------------------------------------------


def test_memory_is_the_plans_estimate_or_an_upper_bound_without_one() -> None:
    for example, kwargs in (("mlp", {"ranks": 2}), ("gpt", {"ranks": 4, "tp": True})):
        c = compiled(example, **kwargs)
        e = estimate(c, FIXED)
        assert e.memory_from_plan and e.peak_memory_bytes == max(m.total for m in c.memory.values())
        bare = estimate(c.state, FIXED)
        assert not bare.memory_from_plan and bare.peak_memory_bytes >= e.peak_memory_bytes


def test_a_job_not_yet_laid_out_is_refused_with_the_fix() -> None:
    with pytest.raises(SbpflowError, match="no placement or SBP.*after SBP inference"):
        estimate(CompileState.start(load("mlp").make_job(ranks=2)), FIXED)


def test_estimate_prints_its_breakdown() -> None:
    text = str(estimate(compiled("mlp", ranks=2), FIXED))
    assert text.startswith("modelled step on fixed (link shm): ")
    assert "exposed comm" in text and "most expensive ops" in text
    assert isinstance(replace(estimate(compiled("mlp"), FIXED), by_op=()), StepEstimate)


def test_plan_cli_prints_the_modelled_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLES / "mlp.py"), "--ranks", "2", "--profile", "h200"]) == 0
    assert "modelled step on h200 (link nccl)" in capsys.readouterr().out
    assert main(["plan", str(EXAMPLES / "mlp.py"), "--profile", "a100"]) != 0
    assert "no device profile 'a100'" in capsys.readouterr().err

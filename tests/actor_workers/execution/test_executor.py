"""The plan executor: per-rank stores, the acts of every task kind, and the actors built from a plan.

The act functions are checked first without the engine (each rank a plain thread that runs its tasks in
plan order, the order lowering proves deadlock-free), then through it. Every boxing pair (1-d on 4
ranks and from 2 ranks to 3, 2-d on a 2x2 mesh) runs on an uneven shape and gathers back to the
original; partial sources hold unequal shares, so a step that treats P as B cannot pass.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.actor_workers.execution import executor, executor_analysis, plan_tables
from sbpflow.actor_workers.execution.boxing_tasks import BoxingTaskError, step_of
from sbpflow.actor_workers.execution.variables import StoreError, init_store
from sbpflow.actor_workers.runtime.group import EngineGroup
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.control_plane.compiler import comm_order, pipeline
from sbpflow.control_plane.compiler.lowering import lower as lowering
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.dtype import DType
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import Job, JobConfig, ParameterSpec
from sbpflow.oracle import reference
from sbpflow.placement import Placement, placement
from sbpflow.random import Normal
from sbpflow.sbp import B, NdSbp, P, S
from sbpflow.sharding import assemble, shard
from sbpflow.tensor_meta import TensorMeta
from sbpflow.v1 import plan_pb2 as pp
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load

TIMEOUT = 20.0


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"threads left running: {left}"


def compile_job(job: Job) -> pipeline.Compiled:
    c = pipeline.compile(job)
    assert c.plan is not None, c.notes
    return c


def build(c: pipeline.Compiled, steps: int, world: InProcessWorld | None = None) -> executor.Program:
    assert c.plan is not None
    transports = {d.rank: world.transport(d.rank) for d in c.plan.devices} if world else None
    return executor.build(c.plan, steps, transports)


def small_mlp(**kw: Any) -> Job:
    args = {"n_in": 8, "hidden": 16, "n_out": 4, "batch_size": 8, "steps": 2, **kw}
    return as_float64(load("mlp").make_job(**args), batches=args["steps"])


# ---- the store -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [{"tp": True}, {"zero": 3}])
def test_each_rank_draws_exactly_its_shard_of_every_variable(layout: dict[str, Any]) -> None:
    job = small_mlp(ranks=4, tp=layout.get("tp", False))
    job = dataclasses.replace(job, config=dataclasses.replace(job.config, zero_stage=layout.get("zero", 0)))
    c = compile_job(job)
    assert c.plan is not None
    g, tables = c.state.graph, plan_tables.of(c.plan)
    stores = {r: init_store(tables, r) for r in range(4)}
    whole = reference.init_parameters(job)
    split = 0
    for name, value in whole.items():
        decl = g.tensors[name]
        assert decl.placement is not None and decl.sbp is not None
        split += any(s != B for s in decl.sbp)
        shards = {r: stores[r][name] for r in decl.placement.ranks}
        np.testing.assert_array_equal(assemble(shards, value.shape, decl.placement, decl.sbp), value)
    assert split, "the layout should split some parameter"
    state = [t for t in g.tensors.values() if t.kind is TensorKind.optimizer_state]
    assert state and all(not stores[0][t.name].any() for t in state)


def test_a_constant_without_a_value_is_refused_by_name() -> None:
    g = Graph()
    g.add_tensor(
        TensorDecl("c", TensorMeta((2,), DType.float64), TensorKind.constant, placement("cpu"), (B,))
    )
    plan = lowering.run(CompileState.start(Job("j", g)))
    with pytest.raises(StoreError, match="'c'.*no initializer"):
        init_store(plan_tables.of(plan), 0)


# ---- boxing acts ------------------------------------------------------------------------------------


def box_job(shape: tuple[int, ...], src: Placement, src_sbp: NdSbp, dst: Placement, dst_sbp: NdSbp) -> Job:
    """A job whose whole plan is one boxing of a parameter ``w`` into the fetched ``v``."""
    meta = TensorMeta(shape, DType.float64)
    g = Graph()
    g.add_tensor(TensorDecl("w", meta, TensorKind.parameter, src, src_sbp, True))
    g.add_tensor(TensorDecl("v", meta, TensorKind.activation, dst, dst_sbp))
    g.ops.append(OpNode("v.box", BOXING, ("w",), ("v",), placement=dst))
    return Job("box", g, [ParameterSpec("w", Normal())], fetches=("v",), config=JobConfig(steps=1))


def run_boxing(job: Job, value: np.ndarray) -> np.ndarray:
    plan = lowering.run(CompileState.start(job))
    comm_order.check(plan)
    ranks = [d.rank for d in plan.devices]
    src = job.graph.tensors["w"]
    assert src.placement is not None and src.sbp is not None
    with InProcessWorld(ranks, timeout=TIMEOUT) as world:
        program = executor.build(plan, 1, {r: world.transport(r) for r in ranks})
        for r, local in shard(value, src.placement, src.sbp).items():  # P: unequal shares
            program.ranks[r].context.store["w"] = local
        executor.execute(program, TIMEOUT, abort_hooks=[world.abort])
    return executor.fetched(program, "v", 1)[0]


ONE_D: list[NdSbp] = [(B,), (P,), (S(0),), (S(1),)]
TWO_D: list[NdSbp] = [(a[0], b[0]) for a in ONE_D for b in ONE_D]
FOUR, TWO, THREE, MESH = (
    placement("cpu", [0, 1, 2, 3]),
    placement("cpu", [0, 1]),
    placement("cpu", [2, 3, 4]),
    placement("cpu", [[0, 1], [2, 3]]),
)


@pytest.mark.parametrize("src, dst", [(FOUR, FOUR), (TWO, THREE)], ids=["4 ranks", "2 to 3 ranks"])
def test_every_1d_boxing_gathers_back_to_the_original(src: Placement, dst: Placement) -> None:
    value = np.random.default_rng(0).normal(size=(5, 3))
    for a, b in itertools.product(ONE_D, ONE_D):
        got = run_boxing(box_job(value.shape, src, a, dst, b), value)
        np.testing.assert_allclose(got, value, rtol=1e-12, err_msg=f"{a} -> {b}")


def test_every_2d_boxing_on_a_2x2_mesh_gathers_back_to_the_original() -> None:
    value = np.random.default_rng(1).normal(size=(5, 6))
    for a, b in itertools.product(TWO_D, TWO_D):
        got = run_boxing(box_job(value.shape, MESH, a, MESH, b), value)
        np.testing.assert_allclose(got, value, rtol=1e-12, err_msg=f"{a} -> {b}")


def test_a_boxing_task_without_its_step_data_is_refused() -> None:
    plan = lowering.run(CompileState.start(box_job((4,), FOUR, (P,), FOUR, (B,))))
    task = next(t for t in plan.devices[0].tasks if t.kind == pp.TASK_KIND_BOXING)
    assert step_of(task, 0).index == 0
    task.boxing.ClearField("from_nd_sbp")  # a plan from before the step was data
    with pytest.raises(BoxingTaskError, match=r"'v.box'.*P -> B.*recompile"):
        step_of(task, 0)


# ---- acts without the engine ------------------------------------------------------------------------


def run_in_plan_order(program: executor.Program, plan: Any, steps: int, world: InProcessWorld) -> None:
    """Each rank a thread running its tasks' acts in plan order (the order of the plan's tasks, not the
    actors' priority: a fetch acts first among the ready ones), step after step: the acts alone."""
    errors: list[BaseException] = []
    order = {d.rank: {t.id: i for i, t in enumerate(d.tasks)} for d in plan.devices}

    def rank_main(rp: executor.RankProgram) -> None:
        values: dict[int, Any] = {}
        try:
            for step in range(steps):
                for a in sorted(rp.actors, key=lambda a: order[rp.rank][a.id]):
                    outs = a.act(step, [values[r] if r in values else a.initial[r] for r in a.inputs])
                    assert len(outs) == len(a.outputs), a.name
                    values.update(zip(a.outputs, outs, strict=True))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            world.abort(f"rank {rp.rank}: {e}")

    threads = [threading.Thread(target=rank_main, args=(rp,)) for rp in program.ranks.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors[0]


@pytest.mark.parametrize(
    "kw", [{"ranks": 2}, {"ranks": 4, "tp": True}, {"ranks": 2, "pp": 2, "micro_batches": 4}]
)
def test_acts_run_in_plan_order_on_plain_threads_train_like_the_reference(kw: dict[str, Any]) -> None:
    job = small_mlp(**kw)
    c = compile_job(job)
    with InProcessWorld([d.rank for d in c.plan.devices], timeout=TIMEOUT) as world:  # type: ignore[union-attr]
        program = build(c, 2, world)
        run_in_plan_order(program, c.plan, 2, world)
    want = reference.train(job, steps=2)
    np.testing.assert_allclose(executor.fetched(program, job.loss, 2), want.losses, rtol=1e-12)
    got = executor.variables(program, list(want.parameters))
    for name, value in want.parameters.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


# ---- actors and the engine --------------------------------------------------------------------------


def test_the_plan_alone_is_enough_to_run() -> None:
    """A worker gets only the Plan: its job (decoded) and re-planned boxing give the same losses."""
    job = small_mlp(ranks=4, grad_accum=2)
    c = compile_job(job)
    assert c.plan is not None
    with InProcessWorld(range(4), timeout=TIMEOUT) as world:
        program = executor.build(c.plan, 2, {r: world.transport(r) for r in range(4)})
        executor.execute(program, TIMEOUT, abort_hooks=[world.abort])
    np.testing.assert_allclose(
        executor.fetched(program, job.loss, 2), reference.train(job, 2).losses, rtol=1e-12
    )


def test_variables_loop_from_their_assignment_to_the_next_step() -> None:
    job = small_mlp(ranks=2)
    c = compile_job(job)
    with InProcessWorld(range(2), timeout=TIMEOUT) as world:
        program = build(c, 1, world)
    rp = program.ranks[0]
    by_id = {a.id: a for a in rp.actors}
    tasks = {t.id: t for t in c.plan.devices[0].tasks}  # type: ignore[union-attr]
    loops = [r for r in rp.registers if r.id not in {d.id for d in c.plan.devices[0].registers}]  # type: ignore[union-attr]
    sources = [t for t in tasks.values() if t.kind == pp.TASK_KIND_SOURCE]
    assert len(loops) == len(sources)  # every variable is assigned (parameters and optimizer state)
    folded = executor_analysis.folded_assigns(c.plan.devices[0])  # type: ignore[union-attr]
    assert folded and not any(t in by_id for t in folded)  # each update assigns: no SINK acts
    for reg in loops:
        # the edge starts at the update that makes the new value (its SINK folded into it)
        update = tasks[reg.producer]
        assert update.kind == pp.TASK_KIND_OPTIMIZER and reg.id in by_id[update.id].outputs and reg.consumers
        first = by_id[reg.consumers[0]].initial[reg.id]
        (var,) = [
            f.variable
            for f in folded.values()
            if f.producer == update.id and rp.context.store[f.variable] is first
        ]
        # the SOURCE that passes the loop edge on is bypassed: its readers read the edge (bypass.py)
        (source,) = [t for t in sources if t.op_name == var]
        assert source.id not in by_id
        assert update.id in reg.consumers and reg.count == 2  # the update reads the value it replaces
        for c in reg.consumers:
            assert by_id[c].initial[reg.id] is rp.context.store[var]


def test_data_loads_on_the_compute_thread_train_the_same_and_still_count_as_data() -> None:
    """A one-CPU worker's engine (``data_on_compute``): the same losses, bit for bit, with every data load
    acted by the compute thread, traced and timed as the data stream's."""
    job = small_mlp(ranks=2, grad_accum=2)
    c = compile_job(job)
    runs = {}
    for on_compute in (False, True):
        with InProcessWorld(range(2), timeout=TIMEOUT) as world:
            program = build(c, 2, world)
            engines = [executor.engine(rp, True, on_compute) for _, rp in sorted(program.ranks.items())]
            runs[on_compute] = program, EngineGroup(engines, [world.abort]).run(TIMEOUT)
    np.testing.assert_array_equal(
        executor.fetched(runs[True][0], job.loss, 2), executor.fetched(runs[False][0], job.loss, 2)
    )
    for rank, result in runs[True][1].items():
        loads = [e for e in result.trace if e.stream == "data"]
        assert loads and all(e.thread == f"sbpflow-r{rank}-compute" for e in loads)
        assert runs[True][0].ranks[rank].context.busy["data"] > 0
    assert all(e.thread == f"sbpflow-r0-{e.stream}" for e in runs[False][1][0].trace)


def test_the_communication_stream_acts_in_plan_order_on_every_rank() -> None:
    job = small_mlp(ranks=4, pp=2, micro_batches=4)
    c = compile_job(job)
    with InProcessWorld(range(4), timeout=TIMEOUT) as world:
        program = build(c, 2, world)
        results = executor.execute(program, TIMEOUT, trace=True, abort_hooks=[world.abort])
    for rank, result in results.items():
        priority = {a.id: (a.priority) for a in program.ranks[rank].actors}
        comm = [(e.iteration, priority[e.actor]) for e in result.trace if e.stream == "comm"]
        assert comm and comm == sorted(comm), f"rank {rank}"


# ---- the hot path: donated optimizer state, no-op boxings off the communication stream -----------------


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_momentum_buffer_is_donated_to_its_update_and_trains_like_the_reference(ranks: int) -> None:
    """SGD's momentum buffer is read by its update alone, so the update writes the new buffer into the
    old array (no allocation a step); the step's results are still the reference's."""
    job = small_mlp(ranks=ranks)
    c = compile_job(job)
    assert c.plan is not None
    with InProcessWorld(range(ranks), timeout=TIMEOUT) as world:
        program = build(c, 2, world)
        initial = {
            n: v for n, v in program.ranks[0].context.store.values().items() if n.endswith("/momentum")
        }
        executor.execute(program, TIMEOUT, abort_hooks=[world.abort])
    updates = [t for t in c.plan.devices[0].tasks if t.kind == pp.TASK_KIND_OPTIMIZER]
    donated = executor_analysis.donations(c.plan.devices[0])
    assert updates and all(donated.get(t.id) == frozenset({2}) for t in updates)
    store = program.ranks[0].context.store
    assert initial and all(store[n] is v for n, v in initial.items())  # updated in place
    want = reference.train(job, steps=2)
    np.testing.assert_allclose(executor.fetched(program, job.loss, 2), want.losses, rtol=1e-12)
    got = executor.variables(program, list(want.parameters))
    for name, value in want.parameters.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def test_only_a_variable_read_by_one_task_is_donated() -> None:
    """A SOURCE read by two tasks (a parameter: forward, backward, update) is not given away."""
    c = compile_job(small_mlp(ranks=1))
    assert c.plan is not None
    device = c.plan.devices[0]
    regs = {r.id: r for r in device.registers}
    donated = executor_analysis.donations(device)
    for task in device.tasks:
        for pos in donated.get(task.id, ()):
            reg = regs[task.in_registers[pos]]
            assert len(set(reg.consumer_tasks)) == 1
            assert next(t for t in device.tasks if t.id == reg.producer_task).kind == pp.TASK_KIND_SOURCE


def test_adamws_moments_are_donated_through_the_no_op_boxings_of_a_one_device_mesh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BERT on a 1 x 1 mesh: a 2-d boxing that moves nothing stands between each moment's SOURCE and its
    update, and between the update and the SINK. The moments are still read by their update alone, so
    they are updated in place, and training equals the run that copies them bit for bit."""
    job = load("bert").make_job(ranks=1, dp=1, batch_size=8, steps=2, lr=1e-2)
    c = compile_job(job)
    assert c.plan is not None
    device = c.plan.devices[0]
    updates = [t for t in device.tasks if t.kind == pp.TASK_KIND_OPTIMIZER]
    plain = executor_analysis.donations(device)
    through = executor_analysis.donations(device, executor_analysis.no_op_boxings(device))
    assert updates and all(through.get(t.id) == frozenset({2, 3}) for t in updates)  # m and v
    assert len(plain) < len(updates)  # without looking through the boxings: most are copied

    def train() -> tuple[list[Any], dict[str, Any], dict[str, Any], executor.Program]:
        with InProcessWorld(range(1), timeout=TIMEOUT) as world:
            program = build(c, 2, world)
            store = program.ranks[0].context.store
            initial = {n: v for n, v in store.values().items() if n.endswith(("/adam_m", "/adam_v"))}
            executor.execute(program, TIMEOUT, abort_hooks=[world.abort])
        names = [p.tensor for p in job.parameters]
        return executor.fetched(program, job.loss, 2), executor.variables(program, names), initial, program

    losses, params, initial, program = train()
    store = program.ranks[0].context.store
    assert initial and all(store[n] is v for n, v in initial.items())  # updated in place
    monkeypatch.setattr(executor_analysis, "donations", lambda device, through=(): plain)
    copied_losses, copied_params, copied_initial, copied = train()
    assert not all(copied.ranks[0].context.store[n] is v for n, v in copied_initial.items())
    np.testing.assert_array_equal(losses, copied_losses)
    for name, value in copied_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)


def test_a_gradients_copy_between_kernels_hands_its_input_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """ResNet on one rank: autodiff copies each batch norm's bias gradient out of channel_affine_grad's
    second output (which the mean's gradient reads too) under its own name. The copy's readers never write
    into it, so the executor hands the value on and bypasses the copy: its act is gone, and training is
    bit for bit the run that copies. On two ranks the gradient goes to an all-reduce on the comm stream:
    the copy stays."""
    job = load("resnet").make_job(ranks=1, depth=18, width=4, image_size=8, batch_size=4, classes=3, steps=3)
    c = compile_job(job)
    assert c.plan is not None
    device = c.plan.devices[0]
    copies = {t.id: t.op_name for t in device.tasks if t.op_type == "identity"}
    handed = executor_analysis.copies_to_hand_on(device, executor_analysis.no_op_boxings(device))
    assert handed and handed <= copies.keys()
    assert all(copies[t].startswith("grad/") and copies[t].endswith(".bias") for t in handed)

    def train() -> tuple[list[Any], dict[str, Any], list[str]]:
        with InProcessWorld(range(1), timeout=TIMEOUT) as world:
            program = build(c, 3, world)
            executor.execute(program, TIMEOUT, abort_hooks=[world.abort])
        names = [p.tensor for p in job.parameters]
        acts = [a.name for a in program.ranks[0].actors]
        return executor.fetched(program, job.loss, 3), executor.variables(program, names), acts

    losses, params, acts = train()
    assert not {f"kernel {copies[t]}" for t in handed} & set(acts)
    monkeypatch.setattr(executor_analysis, "copies_to_hand_on", lambda device, steps=(): set())
    copied_losses, copied_params, copied_acts = train()
    assert {f"kernel {copies[t]}" for t in handed} <= set(copied_acts)
    np.testing.assert_array_equal(losses, copied_losses)
    for name, value in copied_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    two = compile_job(
        load("resnet").make_job(ranks=2, depth=18, width=4, image_size=8, batch_size=4, classes=3)
    )
    assert two.plan is not None
    for d in two.plan.devices:
        assert not executor_analysis.copies_to_hand_on(d, executor_analysis.no_op_boxings(d))


def test_chained_no_op_boxings_of_a_one_device_mesh_are_bypassed() -> None:
    # tensor parallel on a 1 x 1 mesh: a 2-d boxing is two steps, one a mesh axis, each next to the other;
    # only the steps after the data loads (another stream) stay on comm
    job = load("gpt").make_job(
        layers=1, heads=2, width=16, vocab=32, seq_len=8, batch_size=8, steps=2, ranks=1, tp=True, dp=1
    )
    c = compile_job(job)
    with InProcessWorld(range(1), timeout=TIMEOUT) as world:
        program = build(c, 1, world)
    comm = [a.name for rp in program.ranks.values() for a in rp.actors if a.stream == "comm"]
    # (which of tokens and targets the plan boxes after their loads depends on its other choices: since
    # attention is one op only targets' is)
    after_loads = {"boxing targets.to_S0.box [B -> S(0)]", "boxing tokens.to_S0.box [B -> S(0)]"}
    assert comm and set(comm) <= after_loads, comm
    kept = [a.name for rp in program.ranks.values() for a in rp.actors if a.name.startswith("boxing")]
    assert len(kept) < 20, kept  # the rest bypassed (~200 boxing steps in the plan)


def test_no_op_boxings_run_on_the_compute_stream_and_collectives_stay_on_comm() -> None:
    for ranks, comm_expected in ((1, False), (2, True)):
        c = compile_job(small_mlp(ranks=ranks))
        with InProcessWorld(range(ranks), timeout=TIMEOUT) as world:
            program = build(c, 1, world)
        streams = {a.stream for rp in program.ranks.values() for a in rp.actors}
        assert ("comm" in streams) == comm_expected, (ranks, streams)


def test_a_fetch_acts_as_soon_as_its_value_is_in() -> None:
    """Wide & Deep on one rank runs steps ahead of its loss fetch. At its place in the plan's order, the
    fetch waited until nothing earlier was ready, and the steps reported four at a time; acting first
    among the ready acts, each step's loss fetch follows the kernel that made the loss."""
    job = load("wide_deep").make_job(ranks=1, steps=8, batch_size=64, fields=4, vocab=50, dense=3)
    result = sf.run(job, backend="inprocess", threads=1, trace=True)
    compute = sorted((e for e in result.trace or [] if e.stream == "compute"), key=lambda e: e.start)
    fetches = [(a, b) for a, b in itertools.pairwise(compute) if b.name == f"sink {job.loss}"]
    assert len(fetches) == 8
    for before, fetch in fetches:
        assert (before.name, before.iteration) == (f"kernel {job.loss}", fetch.iteration), (before, fetch)

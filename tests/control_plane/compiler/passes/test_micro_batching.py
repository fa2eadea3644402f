"""Micro-batching: gradient accumulation and pipelines on the example MLP and GPT — the plan follows the
schedule on every rank and channel, gradients are averaged once per step, activation memory is bounded by
the micro-batches in flight, and impossible pipelines are refused with the fix."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from sbpflow.control_plane.compiler import comm_order
from sbpflow.control_plane.compiler.passes import micro_batching
from sbpflow.control_plane.compiler.passes.micro_batching import PipelineError
from sbpflow.control_plane.compiler.pipeline import Compiled, compile
from sbpflow.control_plane.compiler.schedule import Phase
from sbpflow.control_plane.compiler.verify import verify_compiled
from sbpflow.graph import BOXING
from sbpflow.job import Job
from sbpflow.v1 import plan_pb2 as pp
from tests.examples.test_examples import load

K = pp.TaskKind
CONFIGS = {
    "mlp pp2": ("mlp", dict(ranks=2, pp=2, layers=3, micro_batches=4, batch_size=16)),
    "mlp pp2 stages of 2 and 4 ranks": ("mlp", dict(pp=2, stage_ranks=(2, 4), layers=3, micro_batches=4)),
    "mlp pp4": ("mlp", dict(ranks=4, pp=4, layers=3, micro_batches=4, batch_size=16)),
    "mlp pp2xdp2": ("mlp", dict(ranks=4, pp=2, layers=3, micro_batches=4, batch_size=16)),
    "mlp pp2 gpipe": ("mlp", dict(ranks=2, pp=2, layers=3, micro_batches=4, batch_size=16, schedule="gpipe")),
    "mlp ga4 dp4": ("mlp", dict(ranks=4, grad_accum=4, batch_size=32)),
    "gpt pp2xdp2": ("gpt", dict(ranks=4, pp=2, micro_batches=4, batch_size=8)),
    "gpt pp4": ("gpt", dict(ranks=4, pp=4, layers=4, micro_batches=4, batch_size=8)),
    "gpt pp2 stages of 2 and 4 ranks": (
        "gpt",
        dict(pp=2, stage_ranks=(2, 4), micro_batches=4, batch_size=16),
    ),
    "gpt ga4 dp2": ("gpt", dict(ranks=2, grad_accum=4, batch_size=8)),
}


@pytest.fixture(scope="module")
def compiled() -> dict[str, Compiled]:
    return {key: compile(load(name).make_job(**kw)) for key, (name, kw) in CONFIGS.items()}


def phase_of(c: Compiled) -> dict[str, Phase]:
    return {name: slot[1] for name, slot in micro_batching.layout(c.state).slot_of.items()}


def collapsed(seq: list) -> list:
    return [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]


@pytest.mark.parametrize("key", CONFIGS)
def test_every_configuration_compiles_verifies_and_agrees_on_its_communicator_order(compiled, key) -> None:
    c = compiled[key]
    assert c.plan is not None, c.notes
    c.state.graph.verify()
    verify_compiled(c.state)
    comm_order.check(c.plan)
    m = micro_batching.layout(c.state).micro_batches
    assert m == 4
    lay = micro_batching.layout(c.state)
    per_op = Counter(
        (t.op_name, d.rank) for d in c.plan.devices for t in d.tasks if t.kind == K.TASK_KIND_KERNEL
    )
    for o in c.state.graph.ops:
        if o.op_type == BOXING or o.op_type.endswith("_update"):
            continue
        assert o.placement is not None
        runs = m if o.name in lay.slot_of else 1  # per micro-batch, or once per step
        assert {per_op[(o.name, r)] for r in o.placement.ranks} == {runs}, o.name


@pytest.mark.parametrize(
    "key, order",
    [
        ("mlp pp2", ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]),
        ("mlp pp2 gpipe", ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]),
        ("mlp ga4 dp4", ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]),
    ],
)
def test_a_rank_runs_its_micro_batches_in_the_schedule_order(compiled, key, order) -> None:
    c = compiled[key]
    phase = phase_of(c)

    def kernels(d: pp.DevicePlan) -> list[str]:
        return collapsed(
            [
                f"{phase[t.op_name].value}{t.micro_batch}"
                for t in d.tasks
                if t.kind == K.TASK_KIND_KERNEL and t.op_name in phase
            ]
        )

    assert kernels(c.plan.devices[0]) == order
    if key == "mlp pp2":  # the last stage alternates from the start
        assert kernels(c.plan.devices[1]) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_a_stage_to_stage_channel_interleaves_sends_and_receives_as_1f1b(compiled) -> None:
    c = compiled["mlp pp2"]  # stage 0 on rank 0, stage 1 on rank 1
    (chan,) = [cm for cm in c.plan.communicators if list(cm.ranks) == [0, 1]]
    tasks = {t.id: t for d in c.plan.devices for t in d.tasks}
    mine = [(s.kind, tasks[s.task_id].micro_batch) for s in chan.order if s.rank == 0]
    S, R = pp.COLLECTIVE_KIND_SEND, pp.COLLECTIVE_KIND_RECV
    # activations leave with stage 0's forwards, gradients come back with stage 1's backwards: the global
    # timeline of the schedule, the same on both sides
    line = micro_batching.layout(c.state).schedule.timeline()
    want = [
        (S if a.phase is Phase.F else R, a.micro_batch)
        for st, a in line
        if (st, a.phase) in {(0, Phase.F), (1, Phase.B)}
    ]
    assert collapsed(mine) == want
    assert want[:4] == [(S, 0), (S, 1), (R, 0), (R, 1)] and len(want) == 8
    theirs = [(s.kind, tasks[s.task_id].micro_batch) for s in chan.order if s.rank == 1]
    assert collapsed(theirs) == [({S: R, R: S}[k], mb) for k, mb in collapsed(mine)]


def test_swapping_two_steps_of_a_channel_on_one_side_is_caught(compiled) -> None:
    plan = pp.Plan()
    plan.CopyFrom(compiled["mlp pp2"].plan)
    (chan,) = [cm for cm in plan.communicators if list(cm.ranks) == [0, 1]]
    ours = [i for i, s in enumerate(chan.order) if s.rank == 0]
    tasks = {t.id: t for d in plan.devices for t in d.tasks}
    i, j = next(
        (a, b) for a, b in zip(ours, ours[1:], strict=False) if chan.order[a].kind != chan.order[b].kind
    )
    a, b = pp.CommStep(), pp.CommStep()
    a.CopyFrom(chan.order[i])
    b.CopyFrom(chan.order[j])
    chan.order[i].CopyFrom(b)
    chan.order[j].CopyFrom(a)
    tasks[b.task_id].comm_seq, tasks[a.task_id].comm_seq = i, j
    with pytest.raises(comm_order.CommOrderError):
        comm_order.check(plan)


@pytest.mark.parametrize("key", ["mlp ga4 dp4", "gpt pp2xdp2"])
def test_gradients_are_averaged_once_per_step_then_reduced_once(compiled, key) -> None:
    c = compiled[key]
    lay = micro_batching.layout(c.state)
    accs = [(d.rank, t) for d in c.plan.devices for t in d.tasks if t.kind == K.TASK_KIND_ACCUMULATE]
    per = Counter((t.attrs["tensor"].s, r) for r, t in accs)
    assert set(per.values()) == {4}
    assert {t.attrs["tensor"].s for _, t in accs} == set(lay.accumulate)
    for _, t in accs:
        first, divide = t.attrs["first"].b, t.attrs["divide_by"].i
        assert first == (t.micro_batch == 0) and divide == (4 if t.micro_batch == 3 else 1)
        assert len(t.in_registers) == (1 if first else 2)
        assert t.stream == pp.STREAM_KIND_COMPUTE
    # the data-parallel all-reduce of a gradient runs on the average, once per step
    grad_boxing = [
        t
        for d in c.plan.devices
        for t in d.tasks
        if t.kind == K.TASK_KIND_BOXING
        and t.op_name.startswith("grad/")
        and t.op_name.endswith(".box")
        and t.boxing.collective == pp.COLLECTIVE_KIND_ALL_REDUCE
    ]
    assert grad_boxing and {t.micro_batch for t in grad_boxing} == {-1}
    optimizer = [t for d in c.plan.devices for t in d.tasks if t.kind == K.TASK_KIND_OPTIMIZER]
    assert optimizer and {t.micro_batch for t in optimizer} == {-1}
    # the loss is averaged too, and reported once per step
    sinks = [t for d in c.plan.devices for t in d.tasks if t.kind == K.TASK_KIND_SINK and "fetch" in t.attrs]
    assert sinks and {t.micro_batch for t in sinks} == {-1}


def test_the_compiled_graph_is_the_per_micro_batch_graph(compiled) -> None:
    c = compiled["gpt pp2xdp2"]
    g = c.state.graph
    assert g.tensors["tokens"].meta.shape == (2, 16)  # batch 8 in 4 micro-batches
    for name, plan in c.state.boxings.items():  # re-planned for the micro-batch shapes
        node = next(o for o in g.ops if o.name == name)
        assert plan.meta == g.tensors[node.inputs[0]].meta and node.attrs["plan"] == repr(plan)
    loads = [t for d in c.plan.devices for t in d.tasks if t.kind == K.TASK_KIND_DATA_LOAD]
    assert sorted({t.micro_batch for t in loads}) == [0, 1, 2, 3]


def live_max(d: pp.DevicePlan, tensor: str) -> int:
    """Most registers of ``tensor`` live at once in ``d``'s task order."""
    index = {t.id: i for i, t in enumerate(d.tasks)}
    spans = [
        (index[r.producer_task], max((index[c] for c in r.consumer_tasks), default=index[r.producer_task]))
        for r in d.registers
        if r.tensor == tensor
    ]
    return max((sum(a <= i <= b for a, b in spans) for i in range(len(d.tasks))), default=0)


def test_registers_in_flight_follow_the_buffer_rule(compiled) -> None:
    c = compiled["mlp pp4"]  # 4 stages on ranks 0..3, 4 micro-batches, 1F1B
    sched = micro_batching.layout(c.state).schedule
    g = c.state.graph
    for stage, d in enumerate(c.plan.devices):
        relus = [o for o in g.ops if o.op_type == "relu" and o.stage == stage]
        for o in relus:  # a forward activation kept for this stage's backward
            assert live_max(d, o.outputs[0]) == sched.buffers(stage, stage, Phase.F) == 4 - stage
    phase = phase_of(c)
    producers = {x: o for o in g.ops for x in o.outputs}
    for o in g.ops:  # received across stages
        src = g.tensors[o.inputs[0]] if o.inputs else None
        if o.op_type != BOXING or src is None or src.placement == o.placement or o.name not in phase:
            continue
        assert o.placement is not None
        d = c.plan.devices[o.placement.ranks[0]]
        if phase[o.name] is Phase.B:  # a gradient coming back: one buffer
            assert live_max(d, o.outputs[0]) == sched.buffers(o.stage + 1, o.stage, Phase.B) == 1, o.name
        else:  # an activation arriving from stage a (b - a buffers), also kept for b's backward (S - b)
            a, b = (p.stage if (p := producers.get(o.inputs[0])) else 0), o.stage
            kept = any(phase.get(r.name) is Phase.B for r in g.consumers(o.outputs[0]))
            want = sched.buffers(a, b, Phase.F) + (sched.buffers(b, b, Phase.F) if kept else 0)
            assert live_max(d, o.outputs[0]) == want, o.name


def test_1f1b_bounds_activation_memory_below_gpipe() -> None:
    peaks = {}
    for schedule in ("1f1b", "gpipe"):
        job = load("mlp").make_job(ranks=2, pp=2, layers=3, micro_batches=8, batch_size=64, schedule=schedule)
        c = compile(job)
        peaks[schedule] = [c.memory[r].peak_activations for r in (0, 1)]
    one, gp = peaks["1f1b"], peaks["gpipe"]
    assert one[0] < gp[0] and one[1] < gp[1]
    assert gp[0] > 1.5 * one[0]  # 8 micro-batches kept against 2 in flight on stage 0
    assert one[1] <= one[0]  # the last stage keeps one


def test_accumulation_counts_each_gradient_once_in_memory(compiled) -> None:
    c = compiled["mlp ga4 dp4"]
    job = c.state.job
    n_params = sum(job.graph.tensors[p.tensor].meta.nbytes for p in job.parameters)
    assert {m.gradients for m in c.memory.values()} == {n_params}


# ---- errors --------------------------------------------------------------------------------------------


def test_too_few_micro_batches_for_1f1b_is_refused_with_the_fix() -> None:
    job = load("mlp").make_job(ranks=4, pp=4, layers=3, micro_batches=2, batch_size=16)
    with pytest.raises(
        PipelineError, match=r"4 stages needs at least 4 micro-batches.*has 2.*micro_batches >= 4"
    ):
        compile(job)
    gpipe = load("mlp").make_job(ranks=4, pp=4, layers=3, micro_batches=2, batch_size=16, schedule="gpipe")
    assert compile(gpipe).plan is not None  # GPipe runs any count


def restaged(job: Job, stage_of) -> Job:
    g = job.graph.copy()
    g.ops[:] = [dataclasses.replace(o, stage=stage_of(o)) for o in g.ops]
    return dataclasses.replace(job, graph=g)


def test_stages_out_of_order_name_both_ops_and_the_fix() -> None:
    job = load("mlp").make_job(ranks=2, pp=2, layers=3, micro_batches=4, batch_size=16)
    # the loss goes back to stage 0 while the layers before it stay in stage 1: a cycle 0 -> 1 -> 0
    bad = restaged(job, lambda o: 0 if o.op_type == "mean" else o.stage)
    with pytest.raises(
        PipelineError, match=r"stages out of order: op 'model\.mean_0' \(mean\) in stage 0 reads"
    ) as e:
        compile(bad)
    assert (
        "later stage 1" in str(e.value)
        and "cycle between stages" in str(e.value)
        and "set_stage" in str(e.value)
    )


def test_a_gap_in_the_stage_numbers_is_refused() -> None:
    job = load("mlp").make_job(ranks=2, pp=2, layers=3, micro_batches=4, batch_size=16)
    with pytest.raises(PipelineError, match=r"0 \.\. S-1 without gaps.*stages \[0, 2\].*stage 1"):
        compile(restaged(job, lambda o: 2 * o.stage))


def test_a_micro_batch_smaller_than_the_data_parallel_degree_is_refused() -> None:
    job = load("mlp").make_job(ranks=4, grad_accum=4, batch_size=8)
    with pytest.raises(PipelineError, match=r"batch of 8 cut into 4 micro-batches leaves 2 rows.*4 ranks"):
        compile(job)

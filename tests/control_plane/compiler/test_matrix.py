"""The issue's configuration matrix: the MLP and GPT jobs compile to a checked plan under every layout.

Each configuration goes through ``pipeline.compile(verify=True)``, which runs ``Graph.verify`` after every
pass and ``verify.verify_compiled`` after every pass from boxing on (checked below); the plan's
communicator orders must then agree on every rank (``comm_order.check``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import sbpflow as sf
from sbpflow.boxing import Collective
from sbpflow.control_plane.compiler import comm_order, pipeline
from sbpflow.control_plane.compiler.verify import verify_compiled
from sbpflow.data.sources import SyntheticSource
from sbpflow.graph import BOXING
from sbpflow.job import Job
from sbpflow.sbp import B, S
from sbpflow.v1 import plan_pb2 as pp
from tests.examples.test_examples import load

MLP: dict[str, Any] = {"ranks": 4, "layers": 1, "hidden": 32, "batch_size": 16}
GPT: dict[str, Any] = {
    "ranks": 4,
    "layers": 2,
    "heads": 4,
    "width": 32,
    "vocab": 64,
    "seq_len": 8,
    "batch_size": 8,
}
# tensor parallelism is for weights larger than activations; with fewer, wider rows the cost model
# keeps the Megatron layout instead of trading it for a batch split
TP = {"mlp": {"tp": True}, "gpt": {"tp": True, "width": 64, "batch_size": 2}}


@dataclass(frozen=True)
class Config:
    model: str  # "mlp" or "gpt"
    kwargs: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # JobConfig overrides
    build: Callable[[], Job] | None = None  # a job the examples cannot make

    def job(self) -> Job:
        job = (
            self.build() if self.build else load(self.model).make_job(**{**_BASE[self.model], **self.kwargs})
        )
        return dataclasses.replace(job, config=dataclasses.replace(job.config, **self.config))


def mlp_dp2xtp2() -> Job:
    """The MLP on a 2x2 mesh: batch over mesh axis 0, the hidden layer Megatron-split over axis 1."""
    mlp = load("mlp")
    where = sf.placement("cpu", ranks=[[0, 1], [2, 3]])
    model = mlp.MLPRegression(16, 32, 4, 1)
    sf.nn.parallel.data_parallel(model, where)
    first, last = model.net[0], model.net[len(model.net) - 1]
    first.weight.to_global(where, (B, S(1)))
    first.bias.to_global(where, (B, S(0)))
    last.weight.to_global(where, (B, S(0)))
    data = SyntheticSource(batch_size=16, kind="regression", params={"in": 16, "out": 4}, seed=0)
    return mlp.TrainMLP(model, 0.05, 10).trace(data, placement=where, input_sbp=(S(0), B))


_BASE = {"mlp": MLP, "gpt": GPT}
CONFIGS: dict[str, Config] = {}
for _m in ("mlp", "gpt"):
    CONFIGS |= {
        f"{_m}-dp4": Config(_m),
        f"{_m}-tp4": Config(_m, TP[_m]),
        f"{_m}-dp2xtp2": Config(_m, build=mlp_dp2xtp2) if _m == "mlp" else Config(_m, {**TP[_m], "dp": 2}),
        f"{_m}-pp2": Config(_m, {"ranks": 2, "pp": 2, "micro_batches": 2}),
        f"{_m}-pp4": Config(_m, {"pp": 4, "micro_batches": 4, "layers": 4}),
        f"{_m}-pp2xdp2": Config(_m, {"pp": 2, "micro_batches": 2}),
        **{f"{_m}-zero{z}": Config(_m, config={"zero_stage": z}) for z in (1, 2, 3)},
        f"{_m}-checkpointing": Config(_m, config={"activation_checkpointing": True}),
        f"{_m}-accum4": Config(_m, {"grad_accum": 4, "batch_size": 16}),
    }


_compiled: dict[str, pipeline.Compiled] = {}


def compiled(name: str) -> pipeline.Compiled:
    cfg = CONFIGS[name]
    if name not in _compiled:
        _compiled[name] = pipeline.compile(cfg.job())
    return _compiled[name]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiles_to_a_verified_plan_with_agreeing_communicators(name: str) -> None:
    c = compiled(name)
    assert c.plan is not None, c.notes
    verify_compiled(c.state)
    comm_order.check(c.plan)
    ranks = sorted(d.rank for d in c.plan.devices)
    assert ranks == list(range(CONFIGS[name].kwargs.get("ranks", 4)))
    assert all(c.memory[r].parameters > 0 and c.memory[r].total > 0 for r in ranks)
    kernels = {t.op_name for d in c.plan.devices for t in d.tasks if t.kind == pp.TASK_KIND_KERNEL}
    assert kernels, name


def test_verifiers_run_after_every_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = pipeline._timed

    def spy(out: pipeline.Compiled, name: str, fn: Callable[..., Any], *args: object) -> Any:
        calls.append(name if name != "verify" else getattr(fn, "__name__", "?"))
        return real(out, name, fn, *args)

    monkeypatch.setattr(pipeline, "_timed", spy)
    pipeline.compile(CONFIGS["mlp-tp4"].job())
    ran = [pipeline.pass_name(p) for p in pipeline.PASSES]
    assert [n for n in calls if n in ran] == ran
    boxed = False
    for p in ran:
        boxed = boxed or p == "boxing_pass"
        i = calls.index(p)
        assert calls[i + 1] == "verify", (p, calls)  # Graph.verify
        assert (calls[i + 2] == "verify_compiled") == boxed, (p, calls)


@pytest.mark.parametrize("name", ["mlp-tp4", "gpt-tp4"])
def test_megatron_forward_has_one_all_reduce_per_block_and_no_scatter_gather_pair(name: str) -> None:
    """Column- then row-split: the partial sum is all-reduced once, not reduce-scattered and gathered."""
    c = compiled(name)
    g, boxings = c.state.graph, c.state.boxings
    first_backward = next(i for i, o in enumerate(g.ops) if o.name.startswith("grad/"))
    forward = Counter(
        s.collective
        for o in g.ops[:first_backward]
        if o.op_type == BOXING
        for s in boxings[o.name].steps
        if s.bytes and g.tensors[o.inputs[0]].meta.shape  # the scalar loss aside
    )
    if name == "gpt-tp4":
        # Megatron's: one all-reduce per sub-layer, 2 per block, and nothing else (sbp_ilp.py)
        assert forward[Collective.all_reduce] == 2 * GPT["layers"]
        assert not forward[Collective.reduce_scatter] and not forward[Collective.all_gather]
        assert not forward[Collective.all_to_all]
    else:
        assert forward[Collective.all_reduce] + forward[Collective.reduce_scatter] == 1
        assert not forward[Collective.all_gather]


@pytest.mark.parametrize("z", [1, 2, 3])
def test_zero_shrinks_what_each_stage_shards(z: int) -> None:
    dp, zero = compiled("gpt-dp4").memory[0], compiled(f"gpt-zero{z}").memory[0]
    assert zero.optimizer_state < dp.optimizer_state
    if z >= 2:
        assert zero.gradients < dp.gradients
    if z >= 3:
        assert zero.parameters < dp.parameters

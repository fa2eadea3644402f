"""The runtime reads only the plan: a Plan without its ``job`` trains bit-identically to the full one.

Every act is built from the plan's tasks, registers and tables (``executor.build``); ``Plan.job`` is
kept for dumps only. Cleared, the run must not change at all — losses and final parameters equal bit
for bit, under DP, TP, 2-d, PP and gradient accumulation, for the whole plan and for the per-rank plans
a worker gets (``Compiled.rank_plan``). And nothing under ``actor_workers/`` imports the boxing planner
or the job decoder.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.execution import executor
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.control_plane.compiler import pipeline
from sbpflow.job import Job
from sbpflow.v1 import plan_pb2 as pp
from tests.actor_workers.test_equivalence import gpt_job, mlp_dp2xtp2, mlp_job

STEPS = 3
TIMEOUT = 30.0
ROOT = Path(__file__).resolve().parents[3]

LAYOUTS: dict[str, Callable[[], Job]] = {
    "mlp-dp4": lambda: mlp_job(ranks=4, steps=STEPS),
    "mlp-tp4": lambda: mlp_job(ranks=4, tp=True, steps=STEPS),
    "mlp-dp2xtp2": mlp_dp2xtp2,
    "mlp-pp2xdp2": lambda: mlp_job(ranks=4, pp=2, micro_batches=4, steps=STEPS),
    "gpt-tp4-dropout": lambda: gpt_job(ranks=4, tp=True, heads=4, dropout=0.1, steps=STEPS),
    "gpt-dp2xtp2": lambda: gpt_job(ranks=4, tp=True, dp=2, steps=STEPS),
    "gpt-pp2x4mb": lambda: gpt_job(ranks=2, pp=2, micro_batches=4, steps=STEPS),
    "gpt-accum2": lambda: gpt_job(ranks=2, grad_accum=2, batch_size=16, steps=STEPS),
}


def train(plans: list[pp.Plan], loss: str, names: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """Losses and final parameters of running ``plans`` together: one whole plan, or one per rank."""
    ranks = sorted(d.rank for p in plans for d in p.devices)
    with InProcessWorld(ranks, timeout=TIMEOUT) as world:
        transports = {r: world.transport(r) for r in ranks}
        programs = [executor.build(p, STEPS, transports, ranks=[d.rank for d in p.devices]) for p in plans]
        program = programs[0]
        for other in programs[1:]:
            program.ranks.update(other.ranks)
        # a rank plan holds only its own tensors: results are read back with every plan's
        tensors = {n: d for p in programs for n, d in p.tensors.items()}
        program = dataclasses.replace(program, tables=dataclasses.replace(program.tables, tensors=tensors))
        executor.execute(program, TIMEOUT, abort_hooks=[world.abort])
    return executor.fetched(program, loss, STEPS), executor.variables(program, names)


def without_job(plan: pp.Plan) -> pp.Plan:
    out = pp.Plan()
    out.CopyFrom(plan)
    out.ClearField("job")
    return out


def assert_same(a: tuple[list[Any], dict[str, Any]], b: tuple[list[Any], dict[str, Any]]) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        np.testing.assert_array_equal(x, y, err_msg="losses")
    assert set(a[1]) == set(b[1])
    for name in a[1]:
        np.testing.assert_array_equal(a[1][name], b[1][name], err_msg=name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_plan_without_its_job_trains_bit_identically(name: str) -> None:
    job = LAYOUTS[name]()
    c = pipeline.compile(job)
    assert c.plan is not None, c.notes
    names = [p.tensor for p in job.parameters]
    want = train([c.plan], job.loss, names)
    assert_same(train([without_job(c.plan)], job.loss, names), want)
    if name in ("mlp-pp2xdp2", "gpt-dp2xtp2"):  # the per-rank plans a worker gets carry the same
        per_rank = [without_job(c.rank_plan(d.rank)) for d in c.plan.devices]
        assert_same(train(per_rank, job.loss, names), want)


# ---- the runtime imports neither the planner nor the job decoder -------------------------------------

FORBIDDEN = {"plan_boxing", "job_from_proto"}


def forbidden_uses(path: Path) -> list[str]:
    """Every import or attribute use of a forbidden name in ``path`` (deferred imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            out += [f"{path}:{node.lineno} imports {a.name}" for a in node.names if a.name in FORBIDDEN]
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN:
            out.append(f"{path}:{node.lineno} uses .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN:
            out.append(f"{path}:{node.lineno} names {node.id}")
    return out


def test_nothing_under_actor_workers_re_plans_boxing_or_decodes_the_job() -> None:
    files = sorted((ROOT / "actor_workers").rglob("*.py"))
    assert len(files) > 10
    uses = [u for f in files for u in forbidden_uses(f)]
    assert not uses, "the runtime must read only the plan's data:\n" + "\n".join(uses)


def test_the_import_check_sees_a_deferred_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from sbpflow.boxing import plan_boxing\n    return plan_boxing\n")
    assert len(forbidden_uses(f)) == 2

"""Evaluation during training: ``eval_every`` steps, the held-out loss of that step's parameters, run by
the job's ranks on their live shards; equal to the oracle's and to the eval job run on that step's
checkpoint (the control plane's former path), on 1 rank, DP2, TP2 and a pipeline; the training losses
unchanged by it, bit for bit; on Ray with no forward pass in the control plane's process; over the wire,
and refused when it cannot be done."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.actor_workers.execution import executor
from sbpflow.checkpoint.read import list_checkpoints
from sbpflow.codec import wire
from sbpflow.control_plane.launch.evaluation import eval_job
from sbpflow.data.sources import ArraySource
from sbpflow.oracle import reference
from tests.client.nn.test_state import Train
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load


def sources() -> tuple[ArraySource, ArraySource]:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(80, 8)), rng.integers(0, 4, size=80)
    train = ArraySource(batch_size=16, arrays={"x": x[:48], "y": y[:48]})
    held_out = ArraySource(batch_size=16, arrays={"x": x[48:], "y": y[48:]})
    return train, held_out


def job(every: int = 2, steps: int = 4, checkpoint_every: int = 0) -> sf.Job:
    graph = Train(sf.nn.MLP([8, 16, 4]).to(sf.float64), steps)
    graph.config.eval_every, graph.config.eval_batches = every, 2
    graph.config.checkpoint_every = checkpoint_every
    train, held_out = sources()
    where = sf.placement("cpu", [0, 1])
    return graph.trace(train, placement=where, input_sbp=sf.sbp.split(0), eval_data=held_out)


def oracle(j: sf.Job, step: int) -> float:
    """The mean held-out loss of the oracle's parameters after ``step`` steps."""
    params = reference.train(j, steps=step).parameters
    ev = eval_job(j)
    return float(np.mean([reference.forward(ev, b, parameters=params)[j.loss] for b in range(2)]))


def test_the_held_out_loss_every_eval_every_steps_is_the_oracles(tmp_path: Path) -> None:
    j = job()
    heard: list[tuple[int, float]] = []
    result = sf.run(j, backend="inprocess", on_eval=lambda s, loss: heard.append((s, loss)))
    assert [s for s, _ in result.evals] == [2, 4] and heard == list(result.evals)
    for step, loss in result.evals:
        assert loss == pytest.approx(oracle(j, step), rel=1e-12)
    kept = sf.run(j, backend="inprocess", checkpoint_dir=str(tmp_path))  # into the run's own directory
    assert kept.evals == result.evals and len(list(tmp_path.iterdir())) == 2


def test_an_evaluation_every_four_steps_reads_every_second_checkpoint() -> None:
    result = sf.run(job(every=4, steps=4, checkpoint_every=2), backend="inprocess")
    assert [s for s, _ in result.evals] == [4]


def layout_job(**layout: Any) -> sf.Job:
    """The MLP example in float64 on ``layout``, 4 steps, evaluated every 2 on 2 batches it never trains on."""
    j = as_float64(load("mlp").make_job(steps=4, batch_size=8, hidden=16, **layout), batches=6)
    assert isinstance(j.data, ArraySource)
    arrays = j.data.arrays
    train = ArraySource(batch_size=8, arrays={k: v[:32] for k, v in arrays.items()})
    held_out = ArraySource(batch_size=8, arrays={k: v[32:] for k, v in arrays.items()})
    config = dataclasses.replace(j.config, steps=4, eval_every=2, eval_batches=2, checkpoint_every=2)
    return dataclasses.replace(j, data=train, eval_data=held_out, config=config)


LAYOUTS: dict[str, Callable[[], sf.Job]] = {
    "one": lambda: layout_job(ranks=1),
    "dp2": lambda: layout_job(ranks=2),
    "tp2": lambda: layout_job(ranks=2, tp=True),
    "pp2": lambda: layout_job(ranks=2, pp=2, micro_batches=2),
}


def from_checkpoints(j: sf.Job, root: Path) -> list[tuple[int, float]]:
    """What the control plane computed before the ranks did: the eval job run in process on each
    evaluated step's checkpoint, the mean of its losses."""
    out = []
    for c in list_checkpoints(root):
        losses = sf.run(eval_job(j), backend="inprocess", init_from=str(c.path)).losses
        out.append((c.step, sum(losses) / len(losses)))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_ranks_evaluate_as_the_eval_job_on_the_checkpoint_did(layout: str, tmp_path: Path) -> None:
    j = LAYOUTS[layout]()
    result = sf.run(j, backend="inprocess", checkpoint_dir=str(tmp_path), return_parameters=True)
    assert [s for s, _ in result.evals] == [2, 4]
    for (step, loss), (then, want) in zip(result.evals, from_checkpoints(j, tmp_path), strict=True):
        assert step == then and loss == pytest.approx(want, rel=1e-13, abs=0)
    plain = dataclasses.replace(j, config=dataclasses.replace(j.config, eval_every=0))
    alone = sf.run(plain, backend="inprocess", return_parameters=True)
    assert result.losses == alone.losses  # bit for bit: the pauses to evaluate change nothing
    assert result.parameters is not None and alone.parameters is not None
    for name, value in alone.parameters.items():
        assert np.array_equal(result.parameters[name], value), name


def test_a_resumed_run_evaluates_the_steps_left(tmp_path: Path) -> None:
    j = LAYOUTS["dp2"]()
    whole = sf.run(j, backend="inprocess", checkpoint_dir=str(tmp_path))
    (two,) = [c.path for c in list_checkpoints(tmp_path) if c.step == 2]
    resumed = sf.run(j, backend="inprocess", resume_from=str(two))
    assert resumed.evals == whole.evals[1:] and resumed.losses == whole.losses[2:]  # losses[0]: step 3


@pytest.mark.usefixtures("ray_local")
def test_ray_workers_evaluate_and_the_control_plane_runs_no_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    j = job(every=4)
    here = sf.run(j, backend="inprocess")
    built: list[int] = []  # every rank program built in this process (a forward would build one)
    real = executor.build_rank

    def counted(*args: Any, **keywords: Any) -> executor.RankProgram:
        built.append(1)
        return real(*args, **keywords)

    monkeypatch.setattr(executor, "build_rank", counted)
    heard: list[tuple[int, float]] = []
    result = sf.run(j, backend="ray", timeout=120, on_eval=lambda s, loss: heard.append((s, loss)))
    assert built == [] and heard == list(result.evals)
    assert [s for s, _ in result.evals] == [4] and result.losses == here.losses
    assert result.evals[0][1] == pytest.approx(here.evals[0][1], rel=1e-13)
    assert result.evals[0][1] == pytest.approx(oracle(j, 4), rel=1e-9)


def test_the_held_out_split_and_the_setting_cross_the_wire() -> None:
    j = job()
    back = wire.job_from_proto(wire.job_to_proto(j))
    assert back.eval_data == j.eval_data and back.config == j.config and back.config.eval_every == 2


def test_what_cannot_be_evaluated_is_refused_naming_the_fix() -> None:
    with pytest.raises(sf.SbpflowError, match="set checkpoint_every to it or to a divisor"):
        job(every=3, checkpoint_every=2)
    graph = Train(sf.nn.MLP([8, 16, 4]).to(sf.float64))
    graph.config.eval_every = 2
    with pytest.raises(sf.SbpflowError, match="eval_data="):
        graph.trace(sources()[0])
    odd = ArraySource(batch_size=16, arrays={"x": np.zeros((32, 5)), "y": np.zeros(32, np.int64)})
    with pytest.raises(sf.SbpflowError, match="split the same source"):
        graph.trace(sources()[0], eval_data=odd)


def test_the_char_lm_evaluates_on_text_it_never_trains_on() -> None:
    from tests.examples.test_examples import load

    charlm = load("charlm")
    j = charlm.make_job(
        ranks=1, steps=2, eval_every=2, eval_batches=1, width=16, seq_len=16, batch_size=4, layers=1
    )
    assert j.eval_data is not None and j.data is not None and j.eval_data.path != j.data.path  # type: ignore[attr-defined]
    assert not set(charlm.HELD_OUT) & set(sf.corpus.PACKAGES)
    ((step, loss),) = sf.run(j, backend="inprocess").evals
    assert step == 2 and 3.0 < loss < 6.0  # ln(128) = 4.85 at the start


def test_a_held_out_file_outside_the_data_roots_is_refused(tmp_path: Path) -> None:
    import dataclasses
    import shutil

    from sbpflow.control_plane.service.data_policy import DataPolicy
    from sbpflow.data.access import DataAccessDenied
    from tests.examples.test_examples import load

    j = load("charlm").make_job(ranks=1, steps=2, eval_every=2, width=16, seq_len=16, batch_size=4, layers=1)
    elsewhere = tmp_path / "held_out.int32"
    shutil.copy(j.eval_data.path, elsewhere)  # type: ignore[union-attr]
    j = dataclasses.replace(j, eval_data=dataclasses.replace(j.eval_data, path=str(elsewhere)))  # type: ignore[type-var]
    policy = DataPolicy.under([Path(j.data.path).parent])  # type: ignore[union-attr]
    with pytest.raises(DataAccessDenied, match="held-out"):
        policy.check(j)
    DataPolicy.under([Path(j.data.path).parent, tmp_path]).check(j)  # type: ignore[union-attr]


def test_the_evaluation_turns_dropout_off() -> None:
    class Dropped(Train):
        def build(self, x: sf.Tensor, y: sf.Tensor) -> sf.Tensor:
            h = sf.nn.functional.dropout(self.model(x), 0.5)
            loss = sf.nn.functional.cross_entropy(h, y)
            loss.backward()
            return loss

    graph = Dropped(sf.nn.MLP([8, 16, 4]).to(sf.float64), 2)
    graph.config.eval_every, graph.config.eval_batches = 2, 2
    train, held_out = sources()
    j = graph.trace(train, eval_data=held_out)
    rates = {o.attrs["rate"] for o in eval_job(j).graph.ops if o.op_type == "dropout"}
    assert rates == {0.0} and {o.attrs["rate"] for o in j.graph.ops if o.op_type == "dropout"} == {0.5}
    ((step, loss),) = sf.run(j, backend="inprocess").evals
    assert loss == pytest.approx(oracle(j, 2), rel=1e-12)

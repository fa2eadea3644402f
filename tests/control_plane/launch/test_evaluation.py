"""Evaluation during training: ``eval_every`` steps, the held-out loss from that step's checkpoint, equal
to the oracle's; on both backends, over the wire, and refused when it cannot be done."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.codec import wire
from sbpflow.control_plane.launch.evaluation import eval_job
from sbpflow.data.sources import ArraySource
from sbpflow.oracle import reference
from tests.client.nn.test_state import Train


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


@pytest.mark.usefixtures("ray_local")
def test_ray_runs_evaluate_too() -> None:
    j = job(every=4)
    result = sf.run(j, backend="ray", timeout=120)
    assert [s for s, _ in result.evals] == [4]
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

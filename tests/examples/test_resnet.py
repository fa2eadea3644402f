"""examples/resnet.py: ResNet-18 traces, trains from the CLI on 2 ranks, reads a .npy folder; the
ResNet-50 configuration for ``sbpflow plan`` traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.client.cli.main import main
from sbpflow.data.sources import ArrayFileSource, ArraySource
from tests.examples.test_examples import EXAMPLES, load


def test_resnet18_traces_data_parallel() -> None:
    job = load("resnet").make_job(ranks=2)
    job.verify()
    ops = [o.op_type for o in job.graph.ops]
    assert ops.count("conv2d") == 20 and ops.count("max_pool2d") == 1 and "adaptive_avg_pool2d" in ops
    assert job.graph.tensors["images"].sbp == (sf.sbp.split(0),)


def test_resnet50_paper_configuration_traces() -> None:
    job = load("resnet").make_job(ranks=8, depth=50, width=64, image_size=224, classes=1000, batch_size=256)
    job.verify()
    assert [o.op_type for o in job.graph.ops].count("conv2d") == 53  # 49 in the blocks + 4 projections
    assert job.graph.tensors["model.fc.weight"].meta.shape == (2048, 1000)


def test_trains_from_the_cli_on_two_ranks() -> None:
    assert (
        main(["run", str(EXAMPLES / "resnet.py"), "--ranks", "2", "--steps", "2", "--backend", "inprocess"])
        == 0
    )


@pytest.mark.parametrize("sharded", [False, True])
def test_reads_a_folder_of_npy_files(tmp_path: Path, sharded: bool) -> None:
    rng = np.random.default_rng(0)
    images = rng.standard_normal((12, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 3, 12)
    if sharded:
        for i in range(3):
            np.save(tmp_path / f"images_{i}.npy", images[4 * i : 4 * i + 4])
            np.save(tmp_path / f"labels_{i}.npy", labels[4 * i : 4 * i + 4])
    else:
        np.save(tmp_path / "images.npy", images)
        np.save(tmp_path / "labels.npy", labels)
    job = load("resnet").make_job(ranks=2, data=str(tmp_path), classes=3, batch_size=4, steps=2)
    assert isinstance(job.data, ArraySource if sharded else ArrayFileSource)
    assert job.graph.tensors["images"].meta.shape == (4, 1, 8, 8)
    losses = sf.run(job, backend="inprocess").losses
    assert len(losses) == 2 and np.all(np.isfinite(losses))

"""examples/resnet.py and examples/insightface.py on a folder of real JPEGs (and the same as tar shards):
they train a few steps in process, the classes from the folder; from the CLI with --set data=DIR."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.client.cli.main import main
from sbpflow.data.images import ImageFileSource
from sbpflow.data.sources import DataError
from tests.examples.test_examples import EXAMPLES, load
from tests.sbpflow.data.test_images import folder_samples, write_folder, write_shards


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_folder(
        tmp_path_factory.mktemp("photos") / "train", per_class=3, classes=("a", "b", "c", "d")
    )


@pytest.mark.parametrize("shards", [False, True])
def test_resnet_trains_on_an_image_folder(jpegs: Path, tmp_path: Path, shards: bool) -> None:
    data = str(jpegs)
    if shards:
        write_shards(folder_samples(jpegs), tmp_path, shards=2)
        data = str(tmp_path / "train-*.tar")
    job = load("resnet").make_job(ranks=2, data=data, image_size=8, width=4, batch_size=4, steps=2)
    assert isinstance(job.data, ImageFileSource) and job.data.layout == ("tar" if shards else "folder")
    assert job.graph.tensors["images"].meta.shape == (4, 3, 8, 8)
    assert job.graph.tensors["model.fc.weight"].meta.shape[-1] == 4  # the folder's four classes
    if shards:  # the same samples as the folder's (tests/sbpflow/data/test_images.py): one run is enough
        return
    losses = sf.run(job, backend="inprocess").losses
    assert len(losses) == 2 and np.all(np.isfinite(losses))


def test_a_class_count_other_than_the_folders_is_refused(jpegs: Path) -> None:
    with pytest.raises(DataError, match="has 4 class subfolders, but classes=5"):
        load("resnet").make_job(data=str(jpegs), classes=5).data.read(0)  # type: ignore[union-attr]


def test_insightface_trains_on_identity_folders(jpegs: Path) -> None:
    job = load("insightface").make_job(ranks=2, data=str(jpegs), image_size=8, batch_size=4, steps=2)
    assert job.graph.tensors["head.weight"].meta.shape == (16, 4)  # 4 identities, split over 2 ranks
    losses = sf.run(job, backend="inprocess").losses
    assert len(losses) == 2 and np.all(np.isfinite(losses))
    with pytest.raises(SystemExit, match="4 identities do not split into 3"):
        load("insightface").make_job(ranks=3, data=str(jpegs))


def test_resnet_trains_from_the_cli(jpegs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(jpegs.parent)  # `sbpflow run` reads under its working folder
    argv = [
        "run",
        str(EXAMPLES / "resnet.py"),
        "--set",
        "data=train",
        "--set",
        "image_size=8",
        "--set",
        "width=4",
    ]
    assert main([*argv, "--steps", "2", "--ranks", "1", "--backend", "inprocess"]) == 0

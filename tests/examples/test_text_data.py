"""The examples on a user's own text (issue 30): gpt.py, charlm.py and bert.py train on a text file with
``data=``, a token file too, and charlm refuses a key it does not take instead of ignoring it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import sbpflow as sf
from tests.examples.test_examples import load

TEXT = "the quick brown fox jumps over the lazy dog.\n" * 200  # easy to learn: the loss falls fast


@pytest.fixture
def text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SBPFLOW_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "fox.txt"
    path.write_text(TEXT)
    return path


SMALL = {"ranks": 2, "layers": 1, "width": 32, "seq_len": 16, "batch_size": 8, "lr": 1e-2, "warmup": 1}


def test_gpt_trains_on_a_text_file_and_its_loss_falls(text: Path) -> None:
    job = load("gpt").make_job(data=str(text), steps=12, **SMALL)
    assert job.graph.tensors["model.wte.weight"].meta.shape[0] == 256
    losses = sf.run(job, backend="inprocess").losses
    assert abs(losses[0] - np.log(256)) < 0.5  # an untrained model's guess over the bytes
    assert np.mean(losses[-3:]) < losses[0] - 1.0


def test_gpt_trains_on_a_token_npy_and_keeps_a_larger_vocab(text: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.frombuffer(TEXT.encode(), np.uint8).astype(np.uint16))
    job = load("gpt").make_job(data=str(tmp_path / "t.npy"), steps=2, vocab=300, **SMALL)
    assert job.graph.tensors["model.wte.weight"].meta.shape[0] == 300
    small = load("gpt").make_job(data=str(tmp_path / "t.npy"), steps=2, vocab=8, **SMALL)
    assert small.graph.tensors["model.wte.weight"].meta.shape[0] == ord("z") + 1  # the largest id + 1
    assert len(sf.run(job, backend="inprocess").losses) == 2


def test_charlm_takes_data_and_refuses_keys_it_does_not_know(text: Path) -> None:
    charlm = load("charlm")
    job = charlm.make_job(data=str(text), steps=2, **SMALL)
    assert job.data.paths == (str(text),) and len(sf.run(job, backend="inprocess").losses) == 2
    with pytest.raises(SystemExit, match=r"takes no \['text'\] \(the text is data=FILE\)"):
        charlm.make_job(text=str(text))
    with pytest.raises(SystemExit, match=r"takes no \['colour'\].*'tokenizer'"):
        charlm.make_job(colour="red")


def test_bert_trains_masked_lm_on_a_text_file(text: Path) -> None:
    job = load("bert").make_job(data=str(text), steps=3, seq_len=16, batch_size=8, mask_prob=0.25, layers=1)
    assert job.data.mlm is not None and job.graph.tensors["model.word.weight"].meta.shape[0] == 384
    assert {f.name: f.sample_shape for f in job.data.fields()}["positions"] == (4,)
    losses = sf.run(job, backend="inprocess").losses
    assert len(losses) == 3 and np.isfinite(losses).all()

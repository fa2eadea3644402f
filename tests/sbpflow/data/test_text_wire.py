"""TextFiles on the wire: every TextFileSource round-trips, bad values are refused naming the field, and
the data-root policy refuses a text file (or a glob's match, or the tokenizer) outside the roots, at Submit
and as opened."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from sbpflow.codec import wire
from sbpflow.codec.data_wire import data_from_proto, data_to_proto
from sbpflow.codec.values import WireError
from sbpflow.control_plane.service.data_policy import DataPolicy
from sbpflow.data.access import DataAccessDenied
from sbpflow.data.checks import check_data
from sbpflow.data.text import TextFileSource, TextMlm
from sbpflow.limits import LimitError
from sbpflow.v1 import job_pb2
from tests.examples.test_examples import load

COMMON: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 7, "drop_last": True}


@pytest.mark.parametrize(
    "source",
    [
        TextFileSource(paths=("a.txt", "corpus/*.txt"), seq_len=32, **COMMON),
        TextFileSource(paths=("a.txt",), tokenizer="/tok/tokenizer.json", seq_len=8, batch_size=1),
        TextFileSource(paths=("a.txt",), seq_len=8, mlm=TextMlm(), **COMMON),
        TextFileSource(
            paths=("a.txt",), seq_len=8, mlm=TextMlm(mask_prob=0.3, cls_id=0, sep_id=5, mask_id=9), **COMMON
        ),
    ],
)
def test_a_text_source_round_trips(source: TextFileSource) -> None:
    m = job_pb2.DataSource.FromString(data_to_proto(source).SerializeToString())
    assert m.WhichOneof("kind") == "text_files"
    assert data_from_proto(m) == source
    check_data(source)


def test_a_job_on_text_round_trips(tmp_path: Path) -> None:
    job = load("gpt").make_job(data=str(tmp_path / "*.txt"), seq_len=8, width=16, layers=1)
    assert job.data == TextFileSource(paths=(str(tmp_path / "*.txt"),), seq_len=8, batch_size=4, shuffle=True)
    assert job.graph.tensors["model.wte.weight"].meta.shape[0] == 256  # the bytes' vocabulary
    back = wire.job_from_proto(job_pb2.Job.FromString(wire.job_to_proto(job).SerializeToString()))
    assert back == job


def text_proto(**kw: object) -> job_pb2.DataSource:
    m = job_pb2.DataSource(global_batch_size=2)
    fields = {"paths": ["a.txt"], "tokenizer": "bytes", "seq_len": 8, **kw}
    mlm = fields.pop("mlm", None)
    m.text_files.paths.extend(fields.pop("paths"))  # type: ignore[arg-type]
    for k, v in fields.items():
        setattr(m.text_files, k, v)
    if mlm is not None:
        for k, v in mlm.items():  # type: ignore[attr-defined]
            setattr(m.text_files.mlm, k, v)
    return m


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"paths": []}, WireError, r"TextFiles.paths is empty; give a text file"),
        ({"tokenizer": ""}, WireError, r"TextFiles.tokenizer is empty; give 'bytes'"),
        ({"seq_len": 0}, LimitError, r"job.data.text_files.seq_len=0: is outside 1\.\."),
        ({"seq_len": -5}, LimitError, r"job.data.text_files.seq_len=-5"),
        ({"seq_len": 2, "mlm": {"mask_prob": 0.15}}, LimitError, r"seq_len=2: is outside 3\.\."),
        ({"tokenizer": "t" * 5000}, LimitError, r"job.data.text_files.tokenizer=.*over the limit of 4096"),
        ({"paths": ["x" * 5000]}, LimitError, r"job.data.text_files.paths\[0\]=.*over the limit"),
        ({"paths": ["a\nb"]}, LimitError, r"job.data.text_files.paths\[0\]"),
        ({"mlm": {"mask_prob": 0.0}}, LimitError, r"job.data.text_files.mlm.mask_prob=0"),
        ({"mlm": {"mask_prob": 1.5}}, LimitError, r"mlm.mask_prob=1.5: is outside"),
        ({"mlm": {"mask_prob": float("nan")}}, LimitError, r"mlm.mask_prob=nan: is not finite"),
        ({"mlm": {"mask_prob": 0.1, "mask_id": -1}}, LimitError, r"job.data.text_files.mlm.mask_id=-1"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kw: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        check_data(data_from_proto(text_proto(**kw)))


# ---- the data-root policy ------------------------------------------------------------------------


def job_on(source: TextFileSource):  # type: ignore[no-untyped-def]
    job = load("gpt").make_job(seq_len=8, width=16, layers=1)
    return dataclasses.replace(job, data=source)


def test_the_policy_refuses_a_text_file_a_match_or_a_tokenizer_outside_the_roots(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "a.txt").write_text("inside\n" * 10)
    (outside / "secret.txt").write_text("secret\n" * 10)
    (outside / "tokenizer.json").write_text("{}")
    (root / "sneaky").symlink_to(outside)  # root/*/secret.txt matches outside/secret.txt
    policy = DataPolicy.under([root])
    policy.check(job_on(TextFileSource(paths=(str(root / "*.txt"),), seq_len=4, batch_size=1)))
    for paths, tokenizer, named in [
        ((str(outside / "secret.txt"),), "bytes", "text file"),
        ((str(root / "a.txt"),), str(outside / "tokenizer.json"), "tokenizer file"),
    ]:
        source = TextFileSource(paths=paths, tokenizer=tokenizer, seq_len=4, batch_size=1)
        with pytest.raises(DataAccessDenied, match=rf"{named} '.*' is outside what the server may read") as e:
            policy.check(job_on(source))
        assert "secret\n" not in str(e.value)
    # a pattern is not expanded at Submit (work proportional to folders the job may not read): a match
    # that leads out of the roots is refused as the worker opens it
    sneaky = TextFileSource(
        paths=(str(root / "*" / "secret.txt"),), seq_len=4, batch_size=1, allowed_roots=policy.run_roots
    )
    policy.check(job_on(sneaky))
    with pytest.raises(DataAccessDenied, match="text file") as e:
        sneaky.read(0)
    assert "secret\n" not in str(e.value)


def test_a_text_file_swapped_out_of_the_roots_is_refused_as_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SBPFLOW_CACHE", str(tmp_path / "cache"))
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "real.txt").write_text("inside\n" * 10)
    (outside / "secret.txt").write_text("secret\n" * 10)
    link = root / "text.txt"
    link.symlink_to(outside / "secret.txt")
    roots = DataPolicy.under([root]).run_roots
    source = TextFileSource(paths=(str(link),), seq_len=4, batch_size=1, allowed_roots=roots)
    with pytest.raises(DataAccessDenied, match="text file") as e:
        source.read(0)
    assert "secret" not in str(e.value)
    os.replace(root / "real.txt", link)  # now a file inside: read
    assert bytes(source.read(0)["tokens"][0].astype("u1")) == b"insi"

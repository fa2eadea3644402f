"""``sbpflow server --device-memory SIZE`` (issue 13): the admission check's memory per device from the
command line, in the units a person writes; a real server started from the parsed flags refuses a job
whose plan needs more (RESOURCE_EXHAUSTED, naming both sizes) and admits it with 0 (no check)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sbpflow.client.cli.byte_sizes import parse_bytes
from sbpflow.client.cli.jobs import server_config
from sbpflow.client.cli.main import build_parser
from sbpflow.client.client import Client, ClientError
from sbpflow.control_plane.service.server import ControlPlane
from sbpflow.v1 import service_pb2 as sp
from tests.examples.test_examples import load


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("1048576", 1 << 20), ("8GiB", 8 << 30), ("16G", 16 << 30), ("1.5g", 3 << 29), ("8 GB", 8 * 10**9),
     ("512MB", 512 * 10**6), (".5K", 512), ("3Ti", 3 << 40)],
)  # fmt: skip
def test_sizes_parse_in_binary_and_decimal_units(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "eight", "8XB", "-1G", "1e9", "8 G B", "99999999999EiB", "9" * 40])
def test_a_bad_size_says_what_to_write(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size|larger than any device"):
        parse_bytes(text)


def test_the_flag_is_in_the_servers_help_and_a_bad_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "--help"])
    assert "--device-memory SIZE" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["server", "--device-memory", "lots"])
    assert e.value.code == 2 and "'lots' is not a size" in capsys.readouterr().err
    assert server_config(build_parser().parse_args(["server"])).device_memory is None


@contextlib.contextmanager
def _stopping(plane: ControlPlane) -> Iterator[ControlPlane]:
    try:
        yield plane
    finally:
        plane.stop()


def _plane(tmp_path: Path, size: str) -> ControlPlane:
    args = build_parser().parse_args(
        ["server", "--device-memory", size, "--port", "0", "--http-port", "-1", "--slots", "2",
         "--backend", "inprocess", "--store", str(tmp_path / f"{size}.db")]
    )  # fmt: skip
    return ControlPlane(server_config(args)).start()


def test_a_server_started_with_the_flag_admits_jobs_by_it(tmp_path: Path) -> None:
    job = load("mlp").make_job(steps=1)
    small = _plane(tmp_path, "1K")
    with _stopping(small) as plane, Client(plane.address) as c:
        with pytest.raises(ClientError) as e:
            c.submit(job)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "per device" in e.value.details and "(1024 bytes) each" in e.value.details, e.value.details
    with _stopping(_plane(tmp_path, "0")) as plane, Client(plane.address) as c:
        final = c.submit(job).wait(timeout=60)
        assert sp.JobState.Name(final.state) == "JOB_STATE_SUCCEEDED", final

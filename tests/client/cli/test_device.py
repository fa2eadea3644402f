"""``--device cuda`` on the command line and ``device=`` in the examples: the job's placements are cuda
(compiling needs no GPU), and running one where cupy or a GPU is missing fails at once saying why."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbpflow.client.cli.examples import job_from_args
from sbpflow.client.cli.main import build_parser, main
from sbpflow.device import DeviceUnavailable, gpu_available
from sbpflow.v1 import job_pb2 as jp
from sbpflow.v1 import plan_pb2 as pp
from tests.examples.test_examples import load

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "wide_deep"])
def test_every_example_places_its_job_on_the_device_it_is_given(name: str) -> None:
    for device in ("cpu", "cuda"):
        job = load(name).make_job(device=device)
        kinds = {t.placement.device_type for t in job.graph.tensors.values() if t.placement is not None}
        assert kinds == {device}, (name, device)


def test_pipeline_stages_follow_the_device_too() -> None:
    job = load("gpt").make_job(ranks=2, pp=2, device="cuda")
    assert {t.placement.device_type for t in job.graph.tensors.values() if t.placement} == {"cuda"}


def test_plan_with_device_cuda_compiles_a_cuda_plan_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "plan.pb"
    assert (
        main(["plan", str(EXAMPLES / "mlp.py"), "--device", "cuda", "--ranks", "2", "--out", str(out)]) == 0
    )
    plan = pp.Plan.FromString(out.read_bytes())
    assert [d.device_type for d in plan.devices] == [jp.DEVICE_TYPE_CUDA] * 2


def test_a_device_the_cli_does_not_know_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", str(EXAMPLES / "mlp.py"), "--device", "tpu"])
    assert e.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err


@pytest.mark.skipif(gpu_available(), reason="this machine has cupy and a GPU: a cuda run would start")
def test_run_on_cuda_without_cupy_or_a_gpu_fails_at_once_naming_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["run", str(EXAMPLES / "mlp.py"), "--device", "cuda", "--ranks", "1", "--backend", "inprocess"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "device type 'cuda'" in err and "pip install 'sbpflow[gpu]'" in err


@pytest.mark.skipif(gpu_available(), reason="this machine has cupy and a GPU: nothing to refuse")
def test_run_on_a_ray_cluster_leaves_the_gpu_check_to_the_cluster() -> None:
    """With --ray-address the workers are elsewhere: a GPU missing here is no reason to refuse the job."""
    run = ["run", str(EXAMPLES / "mlp.py"), "--device", "cuda", "--ranks", "2"]
    with pytest.raises(DeviceUnavailable, match="device type 'cuda' needs cupy"):
        job_from_args(build_parser().parse_args(run))
    job = job_from_args(build_parser().parse_args([*run, "--ray-address", "10.0.0.1:6379"]))
    assert {t.placement.device_type for t in job.graph.tensors.values() if t.placement} == {"cuda"}

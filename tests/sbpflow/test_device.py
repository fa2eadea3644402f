"""sbpflow.device: numpy for cpu, cupy for cuda with a clear error where it cannot be had, host copies."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from sbpflow import device
from sbpflow.device import DeviceUnavailable, array_module, asnumpy, gpu_available, to_device


@pytest.fixture
def no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import cupy`` fail as it does on a CPU-only install, whatever this machine has."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def test_cpu_is_numpy() -> None:
    assert array_module("cpu") is np


def test_cuda_without_cupy_names_the_install(no_cupy: None) -> None:
    with pytest.raises(DeviceUnavailable, match=r"pip install 'sbpflow\[gpu\]'"):
        array_module("cuda")


def test_gpu_available_is_false_without_cupy_and_never_raises(no_cupy: None) -> None:
    assert gpu_available() is False
    assert device.gpu_count() == 0


def test_an_unknown_device_type_lists_the_known_ones() -> None:
    with pytest.raises(DeviceUnavailable, match=r"unknown device type 'tpu'.*\['cpu', 'cuda'\]"):
        array_module("tpu")


def test_every_placement_device_type_has_an_array_module() -> None:
    from sbpflow.placement import DEVICE_TYPES

    assert set(DEVICE_TYPES) == set(device.ARRAY_MODULES)


def test_host_copies_pass_numpy_through() -> None:
    x = np.arange(6.0).reshape(2, 3)
    assert asnumpy(x) is x
    assert isinstance(asnumpy(3.0), np.ndarray)
    np.testing.assert_array_equal(to_device([1, 2], np), [1, 2])
    assert not device.is_device_array(x)


def test_importing_sbpflow_device_does_not_import_cupy() -> None:
    code = "import sys, sbpflow.device; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

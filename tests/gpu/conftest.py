"""The GPU tests: skipped, with the reason, wherever cupy or a CUDA device is missing.

Test modules here never import cupy at module level (collection must work on a CPU-only machine); they
take the ``cp`` fixture, which is the cupy module. Every test in this folder is marked ``gpu``.
``tests/gpu/run_on_device.sh`` runs the folder on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).parent


def _why_no_gpu() -> str | None:
    """None where cupy imports and sees a device; else why not, and what to do about it."""
    from sbpflow.device import DeviceUnavailable, array_module

    try:
        array_module("cuda")
    except DeviceUnavailable as e:
        return f"GPU tests need cupy and a CUDA device: {e}"
    return None


NO_GPU = _why_no_gpu()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if NO_GPU is not None:
                item.add_marker(pytest.mark.skip(reason=NO_GPU))


@pytest.fixture(scope="session")
def cp() -> ModuleType:
    if NO_GPU is not None:
        pytest.skip(NO_GPU)
    import cupy

    return cupy


def gpu_count() -> int:
    from sbpflow.device import gpu_count as count

    return count()

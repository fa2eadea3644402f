"""Device types and their array modules: ``"cpu"`` runs kernels on numpy, ``"cuda"`` on cupy.

Kernels never import numpy or cupy themselves; they compute with the ``xp`` that :func:`array_module`
returns for the placement's device type. Rules kept here:

- importing this module never imports cupy (a CPU-only install has none); cupy is imported on first use;
- :func:`gpu_available` answers without raising, whatever is broken (no cupy, no driver, no device);
- :func:`array_module` for a device it cannot serve raises :class:`DeviceUnavailable` naming the fix;
- :func:`asnumpy` / :func:`to_device` move arrays between host and device and accept either kind, so the
  runtime can hand results to numpy code (losses, gathered parameters) without asking where they live.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from sbpflow.errors import SbpflowError

INSTALL_HINT = (
    "install the GPU extra: pip install 'sbpflow[gpu]' (cupy-cuda12x and NCCL, for CUDA 12; for CUDA 13: "
    "pip install cupy-cuda13x nvidia-nccl-cu13)"
)


class DeviceUnavailable(SbpflowError, RuntimeError):
    """A device type this process cannot run on: unknown, or cupy/the GPU is missing."""


def _numpy() -> ModuleType:
    return np


def cupy_module() -> ModuleType:
    """The cupy module, or :class:`DeviceUnavailable` saying how to install it and what went wrong."""
    try:
        return importlib.import_module("cupy")
    except Exception as e:  # ImportError, or a broken CUDA install failing at import
        raise DeviceUnavailable(
            f"device type 'cuda' needs cupy, which cannot be imported ({e!r}); {INSTALL_HINT}"
        ) from e


def _cupy_with_a_device() -> ModuleType:
    cp = cupy_module()
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as e:
        raise DeviceUnavailable(
            f"device type 'cuda': cupy is installed but CUDA does not answer ({e!r}); check the NVIDIA driver "
            "(nvidia-smi) and that the cupy wheel matches the CUDA major version, or place the job on 'cpu'"
        ) from e
    if count < 1:
        raise DeviceUnavailable(
            "device type 'cuda': cupy sees no GPU; place the job on 'cpu' or run on a GPU host"
        )
    return cp


# device type -> how to get its array module (a table: a new device type is one row)
ARRAY_MODULES: dict[str, Callable[[], ModuleType]] = {
    "cpu": _numpy,
    "cuda": _cupy_with_a_device,
}


def array_module(device_type: str) -> ModuleType:
    """numpy for ``"cpu"``, cupy for ``"cuda"``; raises :class:`DeviceUnavailable` where it cannot."""
    get = ARRAY_MODULES.get(device_type)
    if get is None:
        raise DeviceUnavailable(f"unknown device type {device_type!r}; use one of {sorted(ARRAY_MODULES)}")
    return get()


def gpu_available() -> bool:
    """Whether cupy imports and sees at least one CUDA device. Never raises."""
    try:
        array_module("cuda")
    except Exception:
        return False
    return True


def gpu_count() -> int:
    """How many CUDA devices cupy sees (0 without cupy or a driver). Never raises."""
    try:
        return int(_cupy_with_a_device().cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def is_device_array(array: Any) -> bool:
    """Whether ``array`` lives on a GPU (a cupy array), without importing cupy."""
    return type(array).__module__.split(".")[0] == "cupy"


def asnumpy(array: Any) -> np.ndarray:
    """A host (numpy) copy of a cupy array; numpy arrays and scalars pass through ``np.asarray``."""
    if is_device_array(array):
        return np.asarray(array.get())
    return np.asarray(array)


def to_device(array: Any, xp: ModuleType) -> Any:
    """``array`` as an array of module ``xp`` (numpy: to host; cupy: to the current device)."""
    if xp is np:
        return asnumpy(array)
    return xp.asarray(array)

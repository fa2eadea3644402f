"""A module's values: ``state_dict``, ``load_state_dict`` and the dtype switch (``Module.to``).

A :class:`~sbpflow.client.nn.parameter.Parameter` declares a tensor and, once the module holds one,
its logical value (``Parameter.value``): written back by ``sf.run`` after training, set by
``load_state_dict``, or drawn from its initializer the first time ``state_dict`` is asked for it, then
kept. The draw is keyed as the last trace's run draws it (its tensor name and the job's seed), or,
never traced, by its path in the module and seed 0; either way a run starts from what was returned. The
names are the module's own paths (``blocks.0.attn.c_attn.weight``), as in PyTorch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from sbpflow.checkpoint.imports import Mismatch, check
from sbpflow.checkpoint.read import read_tensors
from sbpflow.client.nn.parameter import Parameter
from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import SbpflowError
from sbpflow.random import RandomKey

Named = Iterable[tuple[str, Parameter]]


def value_of(name: str, p: Parameter) -> np.ndarray:
    """``p``'s value, drawn from its initializer (and kept) when it holds none yet: under the key of the
    last trace (what that job's run draws), else under its path here and seed 0."""
    if p.value is None:
        tensor, seed = p.key or (name, 0)
        key = RandomKey.for_tensor(seed, tensor)
        p.value = np.asarray(p.init.sample(np, key, p.shape, None, p.dtype.to_numpy()))
    return p.value


def state_dict(named: Named) -> dict[str, np.ndarray]:
    """Every parameter's logical value by name (copies: changing them changes nothing in the module)."""
    return {n: value_of(n, p).copy() for n, p in named}


def as_array(value: Any) -> np.ndarray:
    """A numpy array of ``value``: an array, or a PyTorch tensor (detached, on the CPU)."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch.Tensor, read without importing torch
        value = value.detach().cpu()
        return np.asarray(value.float().numpy() if str(value.dtype) == "torch.bfloat16" else value.numpy())
    return np.asarray(value)


def arrays_of(values: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """A state dict as numpy arrays: from a mapping of arrays or PyTorch tensors, or a file (safetensors,
    ``.npz``, a ``torch.save`` ``.pt``/``.bin``) or an sbpflow checkpoint."""
    if isinstance(values, (str, os.PathLike)):
        return read_tensors(os.fspath(values))
    if not isinstance(values, Mapping):
        raise SbpflowError(
            f"load_state_dict got {type(values).__name__}; give a mapping of name -> array or tensor "
            "(model.state_dict()), or the path of a safetensors, .pt or .bin file"
        )
    return {str(n): as_array(v) for n, v in values.items()}


def load_state_dict(named: Named, values: Mapping[str, Any], strict: bool = True, fix: str = "") -> Mismatch:
    """Set every named parameter from ``values`` (arrays by name here); the :class:`Mismatch` found
    (missing and unexpected names). Strict: every name, shape and dtype must match; otherwise what
    matches by name is loaded (cast to the parameter's dtype) and a shape that differs is still an error."""
    params = dict(named)
    given = {n: np.asarray(v) for n, v in values.items()}
    found = check(
        {n: (p.shape, p.dtype.to_numpy()) for n, p in params.items()},
        {n: (a.shape, a.dtype) for n, a in given.items()},
        strict,
        "the state dict",
        fix or "pass one of this model's own (model.state_dict() names)",
    )
    for n, a in given.items():
        if n in params:
            params[n].value = a.astype(params[n].dtype.to_numpy(), copy=True)
    return found


def to_dtype(named: Named, dtype: Any) -> None:
    """Every floating parameter (and the value it holds) as ``dtype``, a floating dtype."""
    want = as_dtype(dtype)
    floats = (DType.float16, DType.bfloat16, DType.float32, DType.float64)
    if want not in floats:
        raise SbpflowError(
            f"Module.to({want.value}): give a floating dtype ({', '.join(d.value for d in floats)})"
        )
    for _, p in named:
        if p.dtype in floats:
            p.dtype = want
            if p.value is not None:
                p.value = p.value.astype(want.to_numpy())

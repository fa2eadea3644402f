"""Element types on numpy: bfloat16 is ml_dtypes' (a runtime dependency); without it, the error says so."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import ShapeError


def test_every_dtype_has_a_numpy_dtype_of_its_width() -> None:
    for d in DType:
        assert d.to_numpy().itemsize == d.itemsize, d
        assert as_dtype(d.to_numpy()) is d  # and back, by name (ml_dtypes' bfloat16 is named so)


def test_bfloat16_keeps_eight_bits_of_mantissa() -> None:
    x = np.asarray([1 + 2**-7, 1 + 2**-9], np.float32).astype(DType.bfloat16.to_numpy())
    assert x.astype(np.float32).tolist() == [1 + 2**-7, 1.0]


def test_without_ml_dtypes_bfloat16_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with pytest.raises(ShapeError, match="bfloat16 on numpy needs ml_dtypes.*pip install ml_dtypes"):
        DType.bfloat16.to_numpy()
    assert DType.float16.to_numpy() == np.float16

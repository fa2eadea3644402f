"""Layout-independent randomness on cupy: the same Philox words as numpy, bit for bit, for whole tensors
and shards; uniforms and bernoulli masks (integer arithmetic and exact scaling) bit for bit too; normals
(log, sqrt, cos: the GPU's libm) to a few ulp; every initialiser on cupy against numpy."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest

from sbpflow.random import (
    Normal,
    RandomKey,
    TruncatedNormal,
    Uniform,
    bernoulli_mask,
    normal,
    philox4x32,
    random_words,
    tensor_rng_id,
    uniform,
)

KEY = RandomKey(seed=2**40 + 1234, tensor_id=tensor_rng_id("layer0.weight"), step=7)
M32 = 0xFFFFFFFF
# Random123 kat_vectors, philox4x32 with 10 rounds (as in tests/sbpflow/test_random.py)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
]
SHAPE = (37, 129)  # odd sizes: no lucky alignment
LAYOUTS = {"whole": None, "shard": (slice(5, 30), slice(64, 129)), "row": (slice(36, 37), slice(0, 129))}


def host(a: Any) -> np.ndarray:
    return np.asarray(a.get())


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_known_answers_on_cupy(cp: ModuleType, counter: tuple, key: tuple, expected: tuple) -> None:
    words = philox4x32(cp, tuple(cp.array([c], dtype=cp.uint32) for c in counter), key)
    assert all(isinstance(w, cp.ndarray) for w in words)
    assert tuple(int(w[0]) for w in words) == expected


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_words_are_bit_identical(cp: ModuleType, layout: str) -> None:
    index = LAYOUTS[layout]
    for want, got in zip(
        random_words(np, KEY, SHAPE, index), random_words(cp, KEY, SHAPE, index), strict=True
    ):
        assert got.dtype == want.dtype == np.uint32
        np.testing.assert_array_equal(host(got), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_uniform_and_bernoulli_are_bit_identical(cp: ModuleType, layout: str, dtype: Any) -> None:
    index = LAYOUTS[layout]
    want, got = uniform(np, KEY, SHAPE, index, dtype), uniform(cp, KEY, SHAPE, index, dtype)
    assert got.dtype == want.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(host(got), want)
    for keep in (0.0, 0.1, 0.9, 1.0):
        np.testing.assert_array_equal(
            host(bernoulli_mask(cp, KEY, SHAPE, index, keep)), bernoulli_mask(np, KEY, SHAPE, index, keep)
        )


@pytest.mark.parametrize(("dtype", "rtol"), [(np.float32, 2e-5), (np.float64, 1e-12)])
def test_normal_agrees_to_a_few_ulp(cp: ModuleType, dtype: Any, rtol: float) -> None:
    want, got = normal(np, KEY, SHAPE, None, dtype), normal(cp, KEY, SHAPE, None, dtype)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(host(got), want, rtol=rtol, atol=rtol)


@pytest.mark.parametrize(
    "init", [Normal(0.0, 0.02), TruncatedNormal(0.0, 1.0, -2.0, 2.0), Uniform(-0.5, 0.5)]
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_initializers_sample_the_same_shard(cp: ModuleType, init: Any, dtype: Any) -> None:
    index = LAYOUTS["shard"]
    want = init.sample(np, KEY, SHAPE, index, dtype)
    got = init.sample(cp, KEY, SHAPE, index, dtype)
    assert isinstance(got, cp.ndarray) and got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(host(got), want, rtol=tol, atol=tol)

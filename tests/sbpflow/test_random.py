"""sbpflow.random: Philox known answers, shard == slice of the full draw on any layout, distributions."""

from __future__ import annotations

import itertools
import math
import statistics
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from sbpflow.random import (
    Constant,
    Initializer,
    Normal,
    Ones,
    RandomKey,
    TruncatedNormal,
    Uniform,
    Zeros,
    bernoulli_mask,
    dropout_jit,
    kaiming_uniform,
    make_initializer,
    normal,
    normal_ppf,
    philox4x32,
    random_words,
    register_initializer,
    shard_offsets,
    tensor_rng_id,
    tensor_rng_ids,
    uniform,
    xavier_uniform,
)

KEY = RandomKey(seed=1234, tensor_id=tensor_rng_id("layer0.weight"), step=7)
M32 = 0xFFFFFFFF

# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, expected output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(
    counter: tuple[int, ...], key: tuple[int, int], expected: tuple[int, ...]
) -> None:
    words = philox4x32(np, tuple(np.array([c], dtype=np.uint32) for c in counter), key)
    assert tuple(int(w[0]) for w in words) == expected


def test_philox_vectorised_equals_one_at_a_time() -> None:
    counters = [np.array([c[i] for c, _, _ in KAT], dtype=np.uint32) for i in range(4)]
    # One key for the batch, so compare against each counter run alone under that key.
    batch = philox4x32(np, tuple(counters), (5, 6))
    for j in range(len(KAT)):
        single = philox4x32(np, tuple(c[j : j + 1] for c in counters), (5, 6))
        assert [int(w[j]) for w in batch] == [int(w[0]) for w in single]


# --- layouts: each is a list of per-rank index tuples covering the logical shape ----------------------


def split(n: int, parts: int, start: int = 0) -> list[slice]:
    """Uneven contiguous split like np.array_split: 10 into 4 is 3/3/2/2."""
    sizes = [n // parts + (i < n % parts) for i in range(parts)]
    bounds = np.cumsum([start, *sizes])
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def test_split_is_uneven_as_intended() -> None:
    assert [s.stop - s.start for s in split(10, 4)] == [3, 3, 2, 2]


FULL = slice(None)
LAYOUTS: dict[str, tuple[tuple[int, ...], list[tuple[slice, ...]]]] = {
    "1d_uneven_S0": ((10,), [(s,) for s in split(10, 4)]),
    "2d_S0": ((10, 7), [(s, FULL) for s in split(10, 4)]),
    "2d_S1": ((10, 7), [(FULL, s) for s in split(7, 3)]),
    # 2x2 mesh, mesh axis 0 splits tensor dim 0 and mesh axis 1 splits dim 1: (S(0), S(1)).
    "2x2_mesh_S0_S1": ((9, 5), [(r, c) for r in split(9, 2) for c in split(5, 2)]),
    # 2x2 mesh, both mesh axes split dim 0 hierarchically: (S(0), S(0)), 11 -> 6/5 -> 3/3, 3/2.
    "2x2_mesh_S0_S0": (
        (11, 3),
        [(s, FULL) for outer in split(11, 2) for s in split(outer.stop - outer.start, 2, outer.start)],
    ),
    "3d_S1": ((3, 10, 4), [(FULL, s, FULL) for s in split(10, 3)]),
    "empty_shard": ((3, 4), [(slice(0, 3), slice(2, 2))]),
}

DRAWS: dict[str, Callable[[Any, tuple[int, ...], Any, Any], Any]] = {
    "uniform": lambda key, shape, index, dtype: uniform(np, key, shape, index, dtype),
    "normal": lambda key, shape, index, dtype: normal(np, key, shape, index, dtype),
    "bernoulli": lambda key, shape, index, dtype: bernoulli_mask(np, key, shape, index, 0.3),
    "truncated_normal": lambda key, shape, index, dtype: TruncatedNormal(0.5, 2.0).sample(
        np, key, shape, index, dtype
    ),
    "xavier": lambda key, shape, index, dtype: xavier_uniform(10, 7).sample(np, key, shape, index, dtype),
    "constant": lambda key, shape, index, dtype: Constant(3.0).sample(np, key, shape, index, dtype),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_equals_slice_of_full_draw(layout: str, draw: str, dtype: Any) -> None:
    shape, indices = LAYOUTS[layout]
    full = DRAWS[draw](KEY, shape, None, dtype)
    assert full.shape == shape
    for index in indices:
        shard = DRAWS[draw](KEY, shape, index, dtype)
        assert shard.dtype == full.dtype
        np.testing.assert_array_equal(shard, full[index])  # bit-identical, not merely close


def test_shards_reassemble_to_full_draw() -> None:
    shape, indices = LAYOUTS["2x2_mesh_S0_S1"]
    full = normal(np, KEY, shape, None)
    rebuilt = np.full(shape, np.nan, dtype=np.float32)
    for index in indices:
        rebuilt[index] = normal(np, KEY, shape, index)
    np.testing.assert_array_equal(rebuilt, full)


def test_shard_of_huge_tensor_touches_only_the_shard() -> None:
    # 2**40 logical elements: materialising them would not fit, so passing shows only the shard is built.
    shape = (2**20, 2**20)
    tail = (slice(2**20 - 2, 2**20), slice(2**20 - 3, 2**20))
    offsets = shard_offsets(np, shape, tail)
    assert offsets.shape == (2, 3) and int(offsets[-1, -1]) == 2**40 - 1
    np.testing.assert_array_equal(
        uniform(np, KEY, shape, tail)[:, 1:], uniform(np, KEY, shape, (tail[0], slice(2**20 - 2, 2**20)))
    )


def test_offset_high_word_is_part_of_the_counter() -> None:
    w_lo = random_words(np, KEY, (2**33,), (slice(0, 1),))
    w_hi = random_words(np, KEY, (2**33,), (slice(2**32, 2**32 + 1),))
    assert any(int(a[0]) != int(b[0]) for a, b in zip(w_lo, w_hi, strict=True))


@pytest.mark.parametrize(
    "index,error",
    [((slice(0, 2),), ValueError), ((slice(0, 4, 2), FULL), ValueError), ((0, FULL), TypeError)],
)
def test_bad_index_is_rejected(index: tuple[Any, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        uniform(np, KEY, (4, 4), index)


# --- distributions ------------------------------------------------------------------------------------

N = 100_000


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_uniform_range_mean_variance(dtype: Any) -> None:
    u = uniform(np, KEY, (N,), None, dtype)
    assert u.dtype == dtype and u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002


def test_float64_uniform_uses_53_bits() -> None:
    u = uniform(np, KEY, (1000,), None, np.float64)
    ints = u * 2.0**53
    assert np.all(ints == np.floor(ints))
    assert np.any(ints % 2.0**29 != 0)  # float32-resolution draws would all be multiples of 2**29


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normal_moments(dtype: Any) -> None:
    z = normal(np, KEY, (N,), None, dtype)
    assert z.dtype == dtype and np.all(np.isfinite(z))
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1.0) < 0.01
    assert abs(np.mean(np.abs(z) > 1.96) - 0.05) < 0.005  # tails, not only the first two moments


def test_normal_initializer_scales() -> None:
    z = Normal(mean=1.0, std=0.02).sample(np, KEY, (N,), None, np.float32)
    assert abs(z.mean() - 1.0) < 0.001 and abs(z.std() - 0.02) < 0.001


@pytest.mark.parametrize("keep_prob", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_bernoulli_keep_fraction(keep_prob: float) -> None:
    mask = bernoulli_mask(np, KEY, (N,), None, keep_prob)
    assert mask.dtype == np.bool_
    assert abs(mask.mean() - keep_prob) < 0.01
    if keep_prob in (0.0, 1.0):
        assert mask.mean() == keep_prob


def test_bernoulli_rejects_bad_probability() -> None:
    with pytest.raises(ValueError, match="keep_prob"):
        bernoulli_mask(np, KEY, (3,), None, 1.5)


def test_normal_ppf_matches_reference() -> None:
    p = np.concatenate([np.linspace(1e-6, 1 - 1e-6, 1001), [1e-12, 0.02425, 0.5, 0.97575, 1 - 1e-12]])
    expected = np.array([statistics.NormalDist().inv_cdf(float(x)) for x in p])
    np.testing.assert_allclose(normal_ppf(np, p), expected, rtol=2e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_truncated_normal_bounds_and_moments(dtype: Any) -> None:
    a, b = -2.0, 2.0
    x = TruncatedNormal(mean=1.0, std=0.5, a=a, b=b).sample(np, KEY, (N,), None, dtype)
    assert x.dtype == dtype and x.min() >= 1.0 + 0.5 * a and x.max() <= 1.0 + 0.5 * b
    phi = math.exp(-(b**2) / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(b / math.sqrt(2))
    std = 0.5 * math.sqrt(1 - 2 * b * phi / mass)  # symmetric truncation of N(0, 1) at +-b
    assert abs(x.mean() - 1.0) < 0.005 and abs(x.std() - std) < 0.005


def test_truncated_normal_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="a < b"):
        TruncatedNormal(a=1.0, b=-1.0)


def test_uniform_initializers() -> None:
    x = Uniform(-3.0, 5.0).sample(np, KEY, (N,), None, np.float64)
    assert x.min() >= -3.0 and x.max() < 5.0 and abs(x.mean() - 1.0) < 0.05
    assert xavier_uniform(100, 300) == Uniform(-math.sqrt(6 / 400), math.sqrt(6 / 400))
    bound = math.sqrt(6 / 256)  # He init for ReLU: variance 2 / fan_in
    k = kaiming_uniform(256)
    assert math.isclose(k.high, bound) and math.isclose(k.low, -bound)


def test_constant_initializers_return_shard_shape() -> None:
    index = (slice(1, 3), FULL)
    assert Zeros().sample(np, KEY, (4, 5), index, np.float32).tolist() == [[0.0] * 5] * 2
    assert Ones().sample(np, KEY, (4, 5), index, np.float64).dtype == np.float64
    assert Constant(2.5).sample(np, KEY, (4, 5), index, np.float32).shape == (2, 5)


# --- streams ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [
        RandomKey(KEY.seed + 1, KEY.tensor_id, KEY.step),
        RandomKey(KEY.seed + 2**32, KEY.tensor_id, KEY.step),  # seed hi word is part of the Philox key
        RandomKey(KEY.seed, tensor_rng_id("layer1.weight"), KEY.step),
        KEY.at_step(KEY.step + 1),
    ],
)
def test_different_keys_give_different_streams(other: RandomKey) -> None:
    a, b = uniform(np, KEY, (1000,), None), uniform(np, other, (1000,), None)
    assert np.mean(a == b) < 0.01
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.1


def test_same_key_is_reproducible() -> None:
    key = RandomKey.for_tensor(1234, "layer0.weight", step=7)
    assert key == KEY
    np.testing.assert_array_equal(normal(np, key, (50,), None), normal(np, KEY, (50,), None))


@pytest.mark.parametrize("field,value", [("seed", 2**64), ("tensor_id", -1), ("step", 2**32)])
def test_random_key_rejects_out_of_range_fields(field: str, value: int) -> None:
    fields = {"seed": 0, "tensor_id": 0, "step": 0, field: value}
    with pytest.raises(ValueError, match=f"RandomKey.{field}"):
        RandomKey(**fields)


def test_tensor_rng_id_is_stable_crc32() -> None:
    assert tensor_rng_id("layer0.weight") == zlib.crc32(b"layer0.weight")
    assert 0 <= tensor_rng_id("x") < 2**32
    assert tensor_rng_ids(["a", "b", "a"]) == {"a": zlib.crc32(b"a"), "b": zlib.crc32(b"b")}


def test_tensor_rng_ids_refuses_collisions() -> None:
    # "plumless" and "buckeroo" are a well-known crc32 collision.
    assert zlib.crc32(b"plumless") == zlib.crc32(b"buckeroo")
    with pytest.raises(ValueError, match="crc32 collision"):
        tensor_rng_ids(["plumless", "buckeroo"])


# --- registry -----------------------------------------------------------------------------------------


def test_registry_builds_by_name() -> None:
    assert make_initializer("normal", std=0.02) == Normal(0.0, 0.02)
    assert make_initializer("zeros") == Zeros()
    with pytest.raises(KeyError, match="unknown initializer 'nope'"):
        make_initializer("nope")


def test_registry_refuses_duplicate_names() -> None:
    with pytest.raises(ValueError, match="initializer 'normal' is already registered"):

        @register_initializer("normal")
        class Other(Initializer):
            pass

    assert make_initializer("normal") == Normal()


def test_offsets_are_global_row_major() -> None:
    np.testing.assert_array_equal(shard_offsets(np, (3, 4, 5), None), np.arange(60).reshape(3, 4, 5))
    np.testing.assert_array_equal(shard_offsets(np, (), None), np.array(0))


def test_counter_layout_is_offset_step_tensor_id() -> None:
    # The documented contract other runtimes (a cupy kernel, a checkpoint replayer) must reproduce.
    words = random_words(np, KEY, (4, 6), (slice(2, 3), slice(5, 6)))
    offset = 2 * 6 + 5
    counter = tuple(np.array([v], dtype=np.uint32) for v in (offset, 0, KEY.step, KEY.tensor_id))
    expected = philox4x32(np, counter, (KEY.seed & M32, KEY.seed >> 32))
    assert [int(w.ravel()[0]) for w in words] == [int(e[0]) for e in expected]


# keys, shards of logical shapes, keep probabilities: the numba loop against the numpy generator
JIT_CASES = [
    (RandomKey(seed=0, tensor_id=0, step=0), (7,), None, 0.9),
    (KEY, (16, 64, 33), None, 0.5),
    (
        RandomKey(seed=2**64 - 1, tensor_id=2**32 - 1, step=2**32 - 1),
        (5, 7, 33),
        (slice(1, 4), slice(2, 7), slice(3, 30)),
        0.9,
    ),
    (RandomKey(seed=2**40 + 5, tensor_id=99, step=3), (2**32 + 9,), (slice(2**32 - 4, 2**32 + 9),), 0.3),
    (KEY.at_step(8), (3, 1, 2**16 + 1), (slice(2, 3), slice(0, 1), slice(1, 2**16 + 1)), 1.0),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("key, shape, index, keep", JIT_CASES)
def test_dropout_jit_is_the_numpy_generator_bit_for_bit(
    dtype: Any, key: RandomKey, shape: tuple[int, ...], index: Any, keep: float
) -> None:
    """Offsets past 2**32 (the counter's high word), the largest seed, id and step, a shard of every axis."""
    pytest.importorskip("numba")
    sizes = tuple(
        n if s is None else s.stop - s.start
        for n, s in zip(shape, index or (None,) * len(shape), strict=True)
    )
    x = np.random.default_rng(1).standard_normal(sizes).astype(dtype)
    x.reshape(-1)[:3] = [np.nan, -np.inf, -0.0]
    with np.errstate(invalid="ignore"):  # -inf * 0, as the kernel's
        want = x * (bernoulli_mask(np, key, shape, index, keep).astype(dtype) * dtype(1.0 / keep))
    got = dropout_jit(x, key, shape, index, keep)
    assert got is not None and got.dtype == x.dtype
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_dropout_jit_leaves_what_it_does_not_take_to_numpy() -> None:
    x = np.ones((4, 6), np.float32)
    for other in (x[:, ::2], x.astype(np.float16), np.float32(1.0), np.ones((), np.float32)):
        assert dropout_jit(other, KEY, np.shape(other), None, 0.9) is None
    assert dropout_jit(x, KEY, (4, 6), (slice(0, 2), slice(0, 6)), 0.9) is None  # not the shard's shape


@pytest.mark.parametrize("step", [0, 1, 2**32 - 1])
@pytest.mark.parametrize(
    "offsets",
    [
        np.arange(7, dtype=np.uint64),
        np.arange(12, dtype=np.uint64).reshape(3, 4) * np.uint64(2**31 + 3),  # high words set
        np.array([2**64 - 1, 0, 2**32], dtype=np.uint64),
        np.zeros(0, dtype=np.uint64),
    ],
    ids=["run", "2-d, high words", "extremes", "empty"],
)
def test_the_one_pass_words_are_the_numpy_rounds_bit_for_bit(offsets: Any, step: int) -> None:
    pytest.importorskip("numba")
    from sbpflow.random import _xp_words_at, words_at

    key = RandomKey(0xDEADBEEF, tensor_rng_id("w"), step=step)
    got, want = words_at(np, key, offsets), _xp_words_at(np, key, offsets)
    for g, w in zip(got, want, strict=True):
        assert g.shape == offsets.shape and g.dtype == np.uint32
        np.testing.assert_array_equal(g, w)

"""Layout-independent randomness: every rank draws exactly its shard of one logical random tensor.

A counter-based generator (Philox4x32-10) maps (key, counter) to random words with no state, so the
value of a logical element depends only on the key and that element's global row-major offset. A rank
holding ``full[index]`` computes the offsets of its shard alone and gets bit-identical values to the
corresponding slice of the single-device draw, whatever the placement or SBP. Nothing here ever
materialises the logical tensor.

Counter layout, one Philox block per element (one call gives four 32-bit words, enough for a float64
normal): ``(offset lo32, offset hi32, step, tensor_id)``; the Philox key is the 64-bit seed. For a fixed
seed the map (tensor_id, step, offset) -> counter is injective while each field is in range (checked in
``RandomKey``), and Philox is a bijection of the counter for a fixed key, so no two elements, tensors or
steps ever share a block. Written against an array module ``xp`` (numpy or cupy) with only uint32/uint64
multiply, shift, xor and and, which both support.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

import numpy as np

from sbpflow.registry import Registry

Array = Any  # numpy.ndarray or cupy.ndarray
Shape = tuple[int, ...]
Index = tuple[slice, ...]  # one step-1 slice per logical dim; a rank's shard is full[index]
Words = tuple[Array, Array, Array, Array]

_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(xp: Any, counter: Sequence[Array], key: tuple[int, int], rounds: int = 10) -> Words:
    """Philox4x32 (Salmon et al., SC'11) on arrays of counters; matches the Random123 reference."""
    c0, c1, c2, c3 = (xp.asarray(c, dtype=xp.uint32) for c in counter)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    m0, m1 = xp.uint64(_PHILOX_M[0]), xp.uint64(_PHILOX_M[1])
    for r in range(rounds):
        if r:  # the key is bumped between rounds, not before the first
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        p0 = c0.astype(xp.uint64) * m0  # a 32x32 product fits in 64 bits: hi and lo words exactly
        p1 = c2.astype(xp.uint64) * m1
        hi0, lo0 = (p0 >> xp.uint64(32)).astype(xp.uint32), (p0 & xp.uint64(_MASK32)).astype(xp.uint32)
        hi1, lo1 = (p1 >> xp.uint64(32)).astype(xp.uint32), (p1 & xp.uint64(_MASK32)).astype(xp.uint32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ xp.uint32(k0), lo1, hi0 ^ c3 ^ xp.uint32(k1), lo0
    return c0, c1, c2, c3


def tensor_rng_id(name: str) -> int:
    """A stable 32-bit id from a tensor's name, so draws do not depend on creation order."""
    return zlib.crc32(name.encode("utf-8"))


def tensor_rng_ids(names: Iterable[str]) -> dict[str, int]:
    """Ids for all random tensors of a model; refuses a crc32 collision, which would repeat a draw.

    A model with n random tensors collides with probability about n**2 / 2**33 (1e-4 at n=1000): rare,
    but a silent repeat (two layers initialised identically) is worth one check at build time.
    """
    ids: dict[str, int] = {}
    owner: dict[int, str] = {}
    for name in names:
        tid = tensor_rng_id(name)
        if tid in owner and owner[tid] != name:
            raise ValueError(
                f"tensors {owner[tid]!r} and {name!r} have the same rng id {tid:#010x} (crc32 collision); "
                "rename one of them or give it an explicit RandomKey tensor_id"
            )
        ids[name], owner[tid] = tid, name
    return ids


@dataclass(frozen=True)
class RandomKey:
    """Names one logical random tensor: seed -> Philox key, (tensor_id, step) -> upper counter words.

    ``step`` is any index that must give a fresh draw of the same tensor: the training step, or
    ``step * micro_batches + micro_batch`` for per-micro-batch dropout.
    """

    seed: int
    tensor_id: int
    step: int = 0

    def __post_init__(self) -> None:
        for field, bits in (("seed", 64), ("tensor_id", 32), ("step", 32)):
            value = getattr(self, field)
            if not 0 <= value < 2**bits:
                raise ValueError(
                    f"RandomKey.{field}={value} is outside [0, 2**{bits}); reduce it modulo 2**{bits}"
                )

    @classmethod
    def for_tensor(cls, seed: int, name: str, step: int = 0) -> RandomKey:
        return cls(seed, tensor_rng_id(name), step)

    def at_step(self, step: int) -> RandomKey:
        return replace(self, step=step)

    @property
    def philox_key(self) -> tuple[int, int]:
        return self.seed & _MASK32, self.seed >> 32


def _normalize_index(logical_shape: Shape, index: Index | None) -> list[tuple[int, int]]:
    if index is None:
        return [(0, n) for n in logical_shape]
    if len(index) != len(logical_shape):
        raise ValueError(
            f"index {index} has {len(index)} slices for logical shape {logical_shape}; give one per dim"
        )
    bounds = []
    for d, (s, n) in enumerate(zip(index, logical_shape, strict=True)):
        if not isinstance(s, slice):
            raise TypeError(f"index[{d}]={s!r} is not a slice; shards are full[index] with step-1 slices")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"index[{d}]={s} has step {step}; shards are contiguous, use step 1")
        bounds.append((start, max(start, stop)))
    return bounds


def shard_offsets(xp: Any, logical_shape: Shape, index: Index | None) -> Array:
    """Global row-major flat offsets (uint64) of the elements of ``full[index]``, in shard shape.

    Built from one arange per dim broadcast together, so the cost is the shard's size, not the tensor's.
    """
    bounds = _normalize_index(logical_shape, index)
    ndim = len(logical_shape)
    offsets = xp.zeros((), dtype=xp.uint64)
    stride = 1
    for d in reversed(range(ndim)):
        start, stop = bounds[d]
        axis = [1] * ndim
        axis[d] = stop - start
        offsets = offsets + xp.arange(start, stop, dtype=xp.uint64).reshape(axis) * xp.uint64(stride)
        stride *= logical_shape[d]
    return offsets


def random_words(xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None) -> Words:
    """The four Philox words of each element of the shard; every draw below is a function of these."""
    return words_at(xp, key, shard_offsets(xp, logical_shape, index))


def words_at(xp: Any, key: RandomKey, off: Array) -> Words:
    """The four Philox words of the elements at global row-major flat offsets ``off`` (uint64, any
    shape): those elements of any draw of ``key``, whatever the rest of the tensor. On numpy with numba,
    random_jit.py's one-pass loop (bit for bit; tested against this function's numpy rounds)."""
    if xp is np and off.size:
        try:
            from sbpflow.ops.kernels import random_jit
        except ImportError:  # an install without numba draws with numpy
            pass
        else:
            flat = np.ascontiguousarray(off, dtype=np.uint64).reshape(-1)
            words = [np.empty(flat.size, np.uint32) for _ in range(4)]
            keys = _round_keys(key.philox_key)
            random_jit.words_at(flat, np.uint32(key.step), np.uint32(key.tensor_id), keys, *words)
            w0, w1, w2, w3 = (w.reshape(off.shape) for w in words)
            return w0, w1, w2, w3
    return _xp_words_at(xp, key, off)


def _xp_words_at(xp: Any, key: RandomKey, off: Array) -> Words:
    """:func:`words_at` in ``xp``'s whole-array operations: the reference, and cupy's path."""
    lo = (off & xp.uint64(_MASK32)).astype(xp.uint32)
    hi = (off >> xp.uint64(32)).astype(xp.uint32)
    step = xp.full(lo.shape, key.step, dtype=xp.uint32)
    tid = xp.full(lo.shape, key.tensor_id, dtype=xp.uint32)
    return philox4x32(xp, (lo, hi, step, tid), key.philox_key)


def _float_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise ValueError(f"random floats are drawn as float32 or float64, not {dt}; draw float32 and cast")
    return dt


def _unit(xp: Any, w0: Array, w1: Array, dtype: np.dtype) -> Array:
    """Uniform in [0, 1) with the full mantissa: 24 bits of w0 for float32, 27 + 26 bits for float64."""
    if dtype == np.float32:
        return (w0 >> xp.uint32(8)).astype(xp.float32) * xp.float32(2.0**-24)
    hi = (w0 >> xp.uint32(5)).astype(xp.float64)
    lo = (w1 >> xp.uint32(6)).astype(xp.float64)
    return (hi * 2.0**26 + lo) * 2.0**-53  # exact: the sum is an integer below 2**53


def uniform(
    xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, dtype: Any = np.float32
) -> Array:
    """U[0, 1) for the shard ``full[index]`` of a logical tensor of ``logical_shape``."""
    dt = _float_dtype(dtype)
    w = random_words(xp, key, logical_shape, index)
    return _unit(xp, w[0], w[1], dt)


def uniform_at(xp: Any, key: RandomKey, offsets: Array, dtype: Any = np.float32) -> Array:
    """The elements at flat ``offsets`` (uint64, any shape) of :func:`uniform`'s draw of ``key``, bit for
    bit, without drawing the rest (rows of a dataset that are not one slice)."""
    dt = _float_dtype(dtype)
    w = words_at(xp, key, offsets)
    return _unit(xp, w[0], w[1], dt)


def row_offsets(ids: Array, row_shape: Shape) -> Array:
    """The flat offsets of rows ``ids`` of a tensor of rows of ``row_shape``: shape (len(ids), *row_shape)."""
    size = int(np.prod(row_shape, dtype=np.int64))
    base = np.asarray(ids, dtype=np.uint64).reshape(-1, *([1] * len(row_shape))) * np.uint64(size)
    return base + np.arange(size, dtype=np.uint64).reshape(row_shape)


def normal(
    xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, dtype: Any = np.float32
) -> Array:
    """N(0, 1) by Box-Muller from two uniforms of the same element (so it stays layout-independent)."""
    dt = _float_dtype(dtype)
    return _box_muller(xp, random_words(xp, key, logical_shape, index), dt)


def normal_at(xp: Any, key: RandomKey, offsets: Array, dtype: Any = np.float32) -> Array:
    """The elements at flat ``offsets`` (uint64, any shape) of :func:`normal`'s draw of ``key``, bit for
    bit, without drawing the rest: a gather from a table too large to draw whole each time."""
    dt = _float_dtype(dtype)
    return _box_muller(xp, words_at(xp, key, offsets), dt)


def _box_muller(xp: Any, w: Words, dt: np.dtype) -> Array:
    u1 = 1 - _unit(xp, w[0], w[1], dt)  # in (0, 1]: log never sees 0
    u2 = _unit(xp, w[2], w[3], dt)
    return (xp.sqrt(-2 * xp.log(u1)) * xp.cos((2 * math.pi) * u2)).astype(dt)


def bernoulli_mask(
    xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, keep_prob: float
) -> Array:
    """Boolean keep-mask with P(True) = keep_prob, compared on the raw 32-bit word (exact at 0 and 1)."""
    if not 0.0 <= keep_prob <= 1.0:
        raise ValueError(f"bernoulli_mask keep_prob={keep_prob} must be in [0, 1]")
    w = random_words(xp, key, logical_shape, index)
    return w[0].astype(xp.uint64) < xp.uint64(round(keep_prob * 2**32))


def _round_keys(key: tuple[int, int], rounds: int = 10) -> np.ndarray:
    """philox4x32's key of each round, [rounds, 2] uint32: bumped between rounds, not before the first."""
    k = np.arange(rounds, dtype=np.uint64)[:, None] * np.array(_PHILOX_W, dtype=np.uint64)
    return ((k + np.array(key, dtype=np.uint64)) & np.uint64(_MASK32)).astype(np.uint32)


def dropout_jit(
    x: Array, key: RandomKey, logical_shape: Shape, index: Index | None, keep_prob: float
) -> Array:
    """``x * bernoulli_mask(...) / keep_prob`` for the shard ``x`` = full[index], in x's dtype, bit for bit,
    by random_jit.py's one-pass loop; None where that loop does not take x (not a C-contiguous float32 or
    float64 numpy array with an axis, or no numba), and the caller draws the mask with numpy."""
    if not isinstance(x, np.ndarray) or x.ndim == 0 or x.dtype not in (np.float32, np.float64):
        return None
    if not x.flags.c_contiguous or not 0.0 < keep_prob <= 1.0:
        return None
    try:
        from sbpflow.ops.kernels import random_jit
    except ImportError:  # an install without numba draws with numpy
        return None
    bounds = _normalize_index(logical_shape, index)
    if x.shape != tuple(b - a for a, b in bounds):  # the loop does not bounds-check: numpy says what is wrong
        return None
    first = tuple(slice(a, b) for a, b in bounds[:-1]) + (slice(bounds[-1][0], bounds[-1][0] + 1),)
    bases = shard_offsets(np, logical_shape, first).reshape(-1)
    out = np.empty_like(x)
    n = x.shape[-1]
    random_jit.dropout_rows(
        x.reshape(-1, n),
        bases,
        np.uint32(key.step),
        np.uint32(key.tensor_id),
        _round_keys(key.philox_key),
        np.uint64(round(keep_prob * 2**32)),
        x.dtype.type(1.0 / keep_prob),
        out.reshape(-1, n),
    )
    return out


# Acklam's rational approximation of the normal quantile (relative error < 1.2e-9): only log, sqrt and
# arithmetic, so it runs unchanged on numpy and cupy, which lack a shared erfinv.
# fmt: off
_PPF_A = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
          -3.066479806614716e01, 2.506628277459239e00)
_PPF_B = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
          -1.328068155288572e01, 1.0)
_PPF_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
          4.374664141464968e00, 2.938163982698783e00)
_PPF_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00, 1.0)
# fmt: on
_PPF_LOW = 0.02425


def _poly(coeffs: tuple[float, ...], x: Array) -> Array:
    acc = coeffs[0]
    for c in coeffs[1:]:
        acc = acc * x + c
    return acc


def normal_ppf(xp: Any, p: Array) -> Array:
    """Inverse standard-normal CDF of float64 ``p`` in (0, 1)."""
    q = p - 0.5
    r = q * q
    central = _poly(_PPF_A, r) * q / _poly(_PPF_B, r)
    t = xp.sqrt(-2 * xp.log(xp.minimum(p, 1 - p)))  # both tails by symmetry
    tail = _poly(_PPF_C, t) / _poly(_PPF_D, t)
    return xp.where(xp.abs(q) <= 0.5 - _PPF_LOW, central, xp.where(q < 0, tail, -tail))


def _std_normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


class Initializer:
    """Base of initialisers: frozen values whose ``sample`` returns only the shard ``full[index]``."""

    name: ClassVar[str]

    def sample(self, xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, dtype: Any) -> Array:
        raise NotImplementedError


INITIALIZERS: Registry[type[Initializer]] = Registry("initializer")
_I = TypeVar("_I", bound=type[Initializer])


def register_initializer(name: str) -> Callable[[_I], _I]:
    """Class decorator adding an initialiser under ``name``; a second use of a name is an error."""

    def add(cls: _I) -> _I:
        INITIALIZERS.register(name, cls)
        cls.name = name
        return cls

    return add


def make_initializer(name: str, **params: Any) -> Initializer:
    """A registered initialiser by name, e.g. from a config: ``make_initializer("normal", std=0.02)``."""
    return INITIALIZERS.get(name)(**params)


def _shard_shape(logical_shape: Shape, index: Index | None) -> Shape:
    return tuple(stop - start for start, stop in _normalize_index(logical_shape, index))


@register_initializer("normal")
@dataclass(frozen=True)
class Normal(Initializer):
    mean: float = 0.0
    std: float = 1.0

    def sample(self, xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, dtype: Any) -> Array:
        z = normal(xp, key, logical_shape, index, dtype)
        return (self.mean + self.std * z).astype(dtype)


@register_initializer("truncated_normal")
@dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """Normal(mean, std) conditioned on [a, b] (in units of std) by inverse CDF: exact, no resampling."""

    mean: float = 0.0
    std: float = 1.0
    a: float = -2.0
    b: float = 2.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.a) and math.isfinite(self.b) and self.a < self.b):
            raise ValueError(
                f"TruncatedNormal needs finite a < b (in units of std), got a={self.a}, b={self.b}"
            )

    def sample(self, xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, dtype: Any) -> Array:
        lo, hi = _std_normal_cdf(self.a), _std_normal_cdf(self.b)
        u = uniform(xp, key, logical_shape, index, np.float64)  # float64 keeps the tails of the quantile
        p = xp.clip(lo + u * (hi - lo), 2.0**-1000, 1 - 2.0**-53)
        z = xp.clip(normal_ppf(xp, p), self.a, self.b)
        return (self.mean + self.std * z).astype(dtype)


@register_initializer("uniform")
@dataclass(frozen=True)
class Uniform(Initializer):
    low: float = 0.0
    high: float = 1.0

    def sample(self, xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, dtype: Any) -> Array:
        u = uniform(xp, key, logical_shape, index, dtype)
        return (self.low + (self.high - self.low) * u).astype(dtype)


@register_initializer("constant")
@dataclass(frozen=True)
class Constant(Initializer):
    value: float = 0.0

    def sample(self, xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, dtype: Any) -> Array:
        return xp.full(_shard_shape(logical_shape, index), self.value, dtype=dtype)


@register_initializer("zeros")
@dataclass(frozen=True)
class Zeros(Initializer):
    def sample(self, xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, dtype: Any) -> Array:
        return xp.zeros(_shard_shape(logical_shape, index), dtype=dtype)


@register_initializer("ones")
@dataclass(frozen=True)
class Ones(Initializer):
    def sample(self, xp: Any, key: RandomKey, logical_shape: Shape, index: Index | None, dtype: Any) -> Array:
        return xp.ones(_shard_shape(logical_shape, index), dtype=dtype)


def xavier_uniform(fan_in: int, fan_out: int, gain: float = 1.0) -> Uniform:
    """Glorot & Bengio (2010): keeps activation and gradient variance equal across a layer."""
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return Uniform(-bound, bound)


def kaiming_uniform(fan_in: int, gain: float = math.sqrt(2.0)) -> Uniform:
    """He et al. (2015): variance gain**2 / fan_in; the default gain suits ReLU."""
    bound = gain * math.sqrt(3.0 / fan_in)
    return Uniform(-bound, bound)

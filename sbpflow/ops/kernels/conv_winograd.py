"""Winograd F(2x2, 3x3): conv_jit's path for 3x3 convolutions at stride 1 over wide images.

Each 2x2 block of outputs (a tile) is ``A' [(G g G') * (B' d B)] A`` of the 4x4 patch ``d`` of the padded
input under it and the filter ``g``: 16 multiplies a tile and a channel pair where the window rows take
36. The 16 products of all tiles are 16 GEMMs ``U[k] [O, C] @ V[k] [C, tiles]``, channels first on both
sides, so x is read and y written in their NCHW layout: no channels-last copy, no transpose of the
output (those two cost as much as the GEMM's excess on a ResNet block). The transforms are sums and
differences (``G``'s halves are exact in binary): float64 stays within ~1e-14 of the direct sum.

Tiles are numbered ``j = th * (TW + 1) + tw`` over a grid one tile wider than the output, so that every
transform is a flat loop over all tiles of a channel (numba vectorises those; a loop over a row's 16
tiles ran scalar): the input, padded, is split by row and column parity into 4 planes of ``[HH, TW + 1]``,
where each term of a tile's transform is the same plane offset plus ``j``. The extra column of tiles is
computed and dropped. The weight gradient is the adjoint: ``dU[k] = dM[k] @ V[k]'`` summed over tiles,
``dM = A dy A'`` of each 2x2 tile of dy (zero past dy's edge), then ``dw = G' dU G``.

Which convolutions take it (``applies``): 3x3, stride and dilation 1, 8 channels in or more (16 for the
weight gradient), outputs 16 wide or more; where C is smaller (a stem's 3) or the image narrower, the
window rows' one GEMM is sooner. --clock cpu, 1 thread: conv2d [32, 16, 32, 32] -> 16 1.75 -> 1.06x
PyTorch's, [8, 16, 32, 32] 1.40 -> ~1.05-1.15x. ``tests/sbpflow/ops/kernels/test_conv_winograd.py``
checks it against conv.py's numpy kernels and torch.

Two passes fewer a block than at first: the parity planes are written straight from x's rows
(``parity_planes``; was a numpy copy into padded rows, then a column split) and ``tiles_out`` writes
y's rows itself (was a tile-ordered buffer, then a numpy copy). The same values bit for bit; --clock
cpu, 1 thread, load 3.3-4, alternated, old -> new: conv2d [32, 16, 16, 16] -> 16 784-900 -> 733-783 us,
[8, 16, 32, 32] 622-667 -> 579-591, grad_weight [32, 16, 16, 16] 1063 -> 956.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from numba import njit

from sbpflow.ops.kernels.jit_streams import load, store

Pair = tuple[int, int]
# tiles of this many bytes of V at a time (whole samples): 1 sample of a [16, 32, 32] ResNet block
BLOCK_BYTES = 1 << 19
MIN_CHANNELS, MIN_WIDTH = 8, 16
# the weight gradient's transforms (of x and of dy) repay only with more channels: --clock cpu, load 6.6,
# 5 alternations, against the window rows, since the one-pass transforms: [32, 16, 16, 16] -> 16: 916
# against 954 us; [8, 16, 32, 32]: 741 against 894; [32, 16, 32, 32]: 2751 against 3323; [16, 8, 16,
# 16] -> 8: 240 against 242 (a tie: 8 channels keep the rows)
GRAD_MIN_CHANNELS = 16

G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])


def applies(c: int, kernel: Pair, stride: Pair, dilation: Pair, out_w: int, grad: bool = False) -> bool:
    """Whether a convolution of c input channels (its weight gradient: ``grad``) takes the Winograd path
    (see the module's docstring)."""
    if grad and c < GRAD_MIN_CHANNELS:
        return False
    return (
        kernel == (3, 3)
        and stride == (1, 1)
        and dilation == (1, 1)
        and c >= MIN_CHANNELS
        and out_w >= MIN_WIDTH
    )


@njit(cache=True, nogil=True, error_model="numpy")
def parity_planes(src: Any, ph: int, pw: int, planes: Any) -> None:  # pragma: no cover - compiled
    """planes [B, C, 2, 2, HH, TW + 1]: src [B, C, H, W] padded by (ph, pw), its padded (row, column)
    (r, q) at [r % 2, q % 2, r // 2, q // 2]. One pass, a source row's even and odd columns each a run;
    what it does not write (the padding) keeps the zeros the planes were made with."""
    b_, c_, h_, w_ = src.shape
    for b in range(b_):
        for c in range(c_):
            for h in range(h_):
                r, line = h + ph, src[b, c, h]
                for qp in range(2):
                    w0 = (qp + pw) % 2  # the first column w with (w + pw) % 2 == qp
                    dst, at = planes[b, c, r % 2, qp, r // 2], (w0 + pw) // 2
                    for k in range((w_ - w0 + 1) // 2):
                        dst[at + k] = line[w0 + 2 * k]


@njit(cache=True, error_model="numpy")
def combine(planes: Any, offs: Any, signs: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out [16, C, B*J]: component k of tile j of channel c of sample b is the sum over t of
    ``signs[k, t] * planes[b, c].flat[offs[k, t] + j]`` (the input's or dy's tile transform)."""
    b_, c_ = planes.shape[0], planes.shape[1]
    chan = planes[0, 0].size
    width = out.shape[2]
    j_ = width // b_
    src, dst = planes.reshape(-1), out.reshape(-1)
    for k in range(16):
        o0, o1, o2, o3 = offs[k, 0], offs[k, 1], offs[k, 2], offs[k, 3]
        s0, s1, s2, s3 = signs[k, 0], signs[k, 1], signs[k, 2], signs[k, 3]
        for b in range(b_):
            for c in range(c_):
                at, to = (b * c_ + c) * chan, (k * c_ + c) * width + b * j_
                for j in range(j_):
                    q = at + j
                    val = s0 * load(src, q + o0, 0) + s1 * load(src, q + o1, 0)  # type: ignore[call-arg]
                    store(dst, to + j, val + s2 * load(src, q + o2, 0) + s3 * load(src, q + o3, 0), 1)  # type: ignore[call-arg]


@njit(cache=True, error_model="numpy", inline="always")
def _mixed(src: Any, k: int, plane: int, row: int, top: bool) -> Any:  # pragma: no cover - compiled
    """Element (i, q) of A' m, ``row = 4 i + q``: m's rows 0 + 1 + 2 (i = 0, sign 1) or 1 - 2 - 3 (i = 1)."""
    first: Any = load(src, k + row * plane, 0)  # type: ignore[call-arg]
    rest: Any = load(src, k + (row + 4) * plane, 0) + load(src, k + (row + 8) * plane, 0)  # type: ignore[call-arg]
    return first + rest if top else first - rest  # a sign as a number made the sum float64


@njit(cache=True, nogil=True, error_model="numpy")
def tiles_out(m: Any, y: Any) -> None:  # pragma: no cover - compiled
    """y [B, O, 2 TH, 2 TW] = A' m A for each tile (th, tw) of m [16, O, B*J], J = TH (TW + 1) (the
    extra column of tiles dropped): output row 2 th + i, column 2 tw + jj, straight into y's layout (a
    numpy copy from a tile-ordered buffer cost ~15 us of a block's ~170). A loop along a row of tiles:
    each tile's two stores a row are adjacent, which LLVM pairs; four, two rows apart by an unknown
    distance, kept the loop scalar."""
    o_, width = m.shape[1], m.shape[2]
    b_, th_, tw_ = y.shape[0], y.shape[2] // 2, y.shape[3] // 2
    j_, plane = th_ * (tw_ + 1), o_ * width
    src, dst = m.reshape(-1), y.reshape(-1)
    for b in range(b_):
        for o in range(o_):
            for t in range(th_):
                at = o * width + b * j_ + t * (tw_ + 1)
                for i in range(2):
                    to, top = (((b * o_ + o) * th_ + t) * 2 + i) * 2 * tw_, i == 0
                    for j in range(tw_):
                        p0, p1 = (
                            _mixed(src, at + j, plane, 4 * i, top),
                            _mixed(src, at + j, plane, 4 * i + 1, top),
                        )
                        p2, p3 = (
                            _mixed(src, at + j, plane, 4 * i + 2, top),
                            _mixed(src, at + j, plane, 4 * i + 3, top),
                        )
                        store(dst, to + 2 * j, p0 + p1 + p2, 1)  # type: ignore[call-arg]
                        store(dst, to + 2 * j + 1, p1 - p2 - p3, 1)  # type: ignore[call-arg]


@lru_cache(maxsize=64)
def _terms(transform: str, plane: int, row: int, dtype: Any) -> tuple[Any, Any]:
    """For each of the 16 components (a, b) of ``T d T'`` (T = BT for the input's 4x4 patches, A = AT'
    for dy's 2x2): the (offset, sign) of its terms in a channel's parity planes [2, 2, ., row] of
    ``plane`` values each; 4 terms a component, unused ones 0 with sign 0."""
    t = BT if transform == "input" else AT.T
    offs, signs = np.zeros((16, 4), np.int64), np.zeros((16, 4), dtype)
    for a in range(4):
        for b in range(4):
            terms = [(r, q) for r in np.nonzero(t[a])[0] for q in np.nonzero(t[b])[0]]
            for k, (r, q) in enumerate(terms):
                offs[a * 4 + b, k] = ((r % 2) * 2 + q % 2) * plane + (r // 2) * row + q // 2
                signs[a * 4 + b, k] = t[a, r] * t[b, q]
    return offs, signs


def _parity_planes(src: Any, padding: Pair, planes: Any) -> Any:
    """planes[:B] for src [B, C, H, W] (see :func:`parity_planes`); planes made zero once a call."""
    parity_planes(src, padding[0], padding[1], planes)
    return planes[: src.shape[0]]


@dataclass(frozen=True)
class _Plan:
    """Tile geometry of a convolution of x [N, C, H, W]: outputs [OH, OW], tiles [TH, TW] (+1 column),
    HH rows a parity plane, B samples a block."""

    oh: int
    ow: int
    th: int
    tw: int
    block: int

    @property
    def tiles(self) -> int:  # J, a sample's tiles with the extra column
        return self.th * (self.tw + 1)

    @property
    def hh(self) -> int:  # enough rows that the extra column's reads stay inside a channel's planes
        return self.th + 2


def _plan(x_shape: tuple[int, ...], padding: Pair, itemsize: int) -> _Plan:
    n, c, h, w = x_shape
    oh, ow = h + 2 * padding[0] - 2, w + 2 * padding[1] - 2
    th, tw = (oh + 1) // 2, (ow + 1) // 2
    block = max(1, min(n, BLOCK_BYTES // max(1, 16 * c * th * (tw + 1) * itemsize)))
    return _Plan(oh, ow, th, tw, block)


def _input_terms(plan: _Plan, dtype: Any) -> tuple[Any, Any]:
    return _terms("input", plan.hh * (plan.tw + 1), plan.tw + 1, np.dtype(dtype))


def _blocks(n: int, plan: _Plan) -> list[tuple[int, int]]:
    return [(n0, min(n, n0 + plan.block)) for n0 in range(0, n, plan.block)]


def conv(x: Any, w: Any, padding: Pair) -> Any:
    """conv2d of x [N, C, H, W] by a 3x3 w [O, C, 3, 3] at stride 1: U = G w G' once, then a block of
    samples at a time the input tiles' V, the 16 GEMMs U @ V, and A' m A into y's rows."""
    n, c = x.shape[:2]
    o, plan = w.shape[0], _plan(x.shape, padding, x.itemsize)
    g = G.astype(x.dtype)
    u = np.tensordot(np.tensordot(g, w, (1, 2)), g, (3, 1))  # [4, O, C, 4]
    u = np.ascontiguousarray(u.transpose(0, 3, 1, 2)).reshape(16, o, c)
    offs, signs = _input_terms(plan, x.dtype)
    b, j_, th, tw = plan.block, plan.tiles, plan.th, plan.tw
    planes = np.zeros((b, c, 2, 2, plan.hh, tw + 1), x.dtype)
    v, m = np.empty((16, c, b * j_), x.dtype), np.empty((16, o, b * j_), x.dtype)
    y = np.empty((n, o, 2 * th, 2 * tw), x.dtype)
    for n0, n1 in _blocks(n, plan):
        s, k = n1 - n0, (n1 - n0) * j_
        vb = v if s == b else np.empty((16, c, k), x.dtype)
        mb = m if s == b else np.empty((16, o, k), x.dtype)
        combine(_parity_planes(x[n0:n1], padding, planes), offs, signs, vb)
        tiles_out(np.matmul(u, vb, out=mb), y[n0:n1])
    return (
        y if (plan.oh, plan.ow) == (2 * th, 2 * tw) else np.ascontiguousarray(y[:, :, : plan.oh, : plan.ow])
    )


def grad_weight(dy: Any, x: Any, padding: Pair) -> Any:
    """dw [O, C, 3, 3] of conv's: G' (sum over tiles of dM[k] @ V[k]') G, dM = A dy A' a tile."""
    n, c = x.shape[:2]
    o, plan = dy.shape[1], _plan(x.shape, padding, x.itemsize)
    b, j_, th, tw = plan.block, plan.tiles, plan.th, plan.tw
    offs, signs = _input_terms(plan, x.dtype)
    # dy's tiles read from its own parity planes [2, 2, TH + 1, TW + 1] (zero past its edge)
    doffs, dsigns = _terms("dy", (th + 1) * (tw + 1), tw + 1, np.dtype(x.dtype))
    planes = np.zeros((b, c, 2, 2, plan.hh, tw + 1), x.dtype)
    dplanes = np.zeros((b, o, 2, 2, th + 1, tw + 1), x.dtype)
    v, dm = np.empty((16, c, b * j_), x.dtype), np.empty((16, o, b * j_), x.dtype)
    du = np.zeros((16, o, c), x.dtype)
    for n0, n1 in _blocks(n, plan):
        s, k = n1 - n0, (n1 - n0) * j_
        vb = v if s == b else np.empty((16, c, k), x.dtype)
        mb = dm if s == b else np.empty((16, o, k), x.dtype)
        combine(_parity_planes(x[n0:n1], padding, planes), offs, signs, vb)
        combine(_parity_planes(dy[n0:n1], (0, 0), dplanes), doffs, dsigns, mb)
        du += np.matmul(mb, vb.transpose(0, 2, 1))
    gd = G.astype(x.dtype)
    dw = np.tensordot(np.tensordot(gd, du.reshape(4, 4, o, c), (0, 0)), gd, (1, 0))  # [3, O, C, 3]
    return np.ascontiguousarray(dw.transpose(1, 2, 0, 3))

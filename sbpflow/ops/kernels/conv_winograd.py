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

Which convolutions take it (``applies``): 3x3, stride and dilation 1, 8 channels in or more, outputs 8
wide or more; where C is smaller (a stem's 3) or the image narrower, the window rows' one GEMM is sooner
(4 wide: 32 channels 326 against 150 us; 64 channels, with the blocked filter transforms below, conv2d
461 against 503 but the weight gradient 582 against 490; 6 wide is level). At 8 wide, since the transforms above,
batch 32, --clock cpu: conv2d 0.72-0.83x the window rows' time from 16 to 128 channels (32 channels:
432-461 against 555 us, ResNet-18's second stage), the weight gradient 0.87-1.03x (it was 16 wide or
more: 656-914 against 710-999 us with the generic transforms).
``tests/sbpflow/ops/kernels/test_conv_winograd.py`` checks it against conv.py's numpy kernels, torch
and, in float32, the float64 result.

The transforms are hard-coded sums and differences, each in its two one-dimensional passes, and each
channel's parity planes are made in a scratch that stays in L1 (``input_tiles``, ``dy_tiles``; they
were a pass writing all of a block's planes, then a generic loop of 16 components of 4 signed terms
each, 112 operations a tile where the passes take 32 for the input and 16 for dy); ``filter_tiles`` and
``fold_filters`` replace two tensordots and a transposed copy each. Not the same rounding as before
(float32: within ~3e-7 of the largest value). --clock cpu, 1 thread, load 3-4, alternated, old -> new:
conv2d [32, 16, 16, 16] -> 16 1070-1162 -> 762-834 us, [8, 16, 32, 32] 818-855 -> 507-595;
grad_weight [32, 16, 16, 16] 1272-1598 -> 774-929, [8, 16, 32, 32] 1043-1159 -> 703-720. So the weight
gradient now takes it from 8 channels as the convolution does (was 16): [16, 8, 16, 16] 369-379 us by
the window rows, 185-191 by Winograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from sbpflow.ops.kernels.jit_streams import load, store

Pair = tuple[int, int]
# tiles of this many bytes of V at a time (whole samples): 1 sample of a [16, 32, 32] ResNet block
BLOCK_BYTES = 1 << 19
MIN_CHANNELS, MIN_WIDTH = 8, 8

G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])  # BT and AT: what input_tiles, dy_tiles and tiles_out hard-code


def applies(c: int, kernel: Pair, stride: Pair, dilation: Pair, out_w: int) -> bool:
    """Whether a convolution of c input channels (or its weight gradient) takes the Winograd path (see
    the module's docstring)."""
    return (
        kernel == (3, 3)
        and stride == (1, 1)
        and dilation == (1, 1)
        and c >= MIN_CHANNELS
        and out_w >= MIN_WIDTH
    )


@njit(cache=True, error_model="numpy", inline="always")
def _split(
    src: Any, at: int, h_: int, w_: int, ph: int, pw: int, plane: int, row: int, scratch: Any
) -> None:  # pragma: no cover - compiled
    """One channel's parity planes [2, 2, ., row] of ``plane`` values each in scratch, from src's [h_, w_]
    values at ``at`` padded by (ph, pw): padded (r, q) at [r % 2, q % 2, r // 2, q // 2]. What it does not
    write (the padding) keeps the zeros scratch was made with: every channel writes the same places."""
    for h in range(h_):
        r = h + ph
        for qp in range(2):
            w0 = (qp + pw) % 2  # the first column w with (w + pw) % 2 == qp
            to = ((r % 2) * 2 + qp) * plane + (r // 2) * row + (w0 + pw) // 2
            for k in range((w_ - w0 + 1) // 2):
                store(scratch, to + k, load(src, at + h * w_ + w0 + 2 * k, 0), 1)  # type: ignore[call-arg]


@njit(cache=True, nogil=True, error_model="numpy")
def input_tiles(x: Any, ph: int, pw: int, hh: int, v: Any) -> None:  # pragma: no cover - compiled
    """v [16, C, B*J] = B' d B of every tile of x [B, C, H, W] padded by (ph, pw), J = TH (TW + 1) tiles a
    sample over parity planes [2, 2, hh, TW + 1]: component 4 a + b of tile j at v[4 a + b, c, b J + j].
    A channel's planes are made in a scratch that stays in L1, then B' d B is taken in its two passes of
    sums and differences (``e = d B``, then ``B' e``: 32 additions a tile, where 16 components of 4 signed
    terms each took 112 operations) over all of the channel's tiles at once."""
    b_, c_, h_, w_ = x.shape
    width = v.shape[2]
    j_ = width // b_
    row = j_ // (hh - 2)
    plane = hh * row
    ks = c_ * width  # from one component to the next in v
    scratch = np.zeros(4 * plane, x.dtype)
    src, dst = x.reshape(-1), v.reshape(-1)
    p1, p2, p3 = plane, 2 * plane, 3 * plane
    for b in range(b_):
        for c in range(c_):
            _split(src, (b * c_ + c) * h_ * w_, h_, w_, ph, pw, plane, row, scratch)
            to = c * width + b * j_
            for j in range(j_):  # d[r][q] in plane (r % 2, q % 2) at row r // 2, column q // 2
                d00, d01, d02, d03 = (
                    load(scratch, j, 0),  # type: ignore[call-arg,var-annotated]
                    load(scratch, p1 + j, 0),  # type: ignore[call-arg,var-annotated]
                    load(scratch, 1 + j, 0),  # type: ignore[call-arg,var-annotated]
                    load(scratch, p1 + 1 + j, 0),  # type: ignore[call-arg,var-annotated]
                )
                d10, d11, d12, d13 = (
                    load(scratch, p2 + j, 0),  # type: ignore[call-arg]
                    load(scratch, p3 + j, 0),  # type: ignore[call-arg]
                    load(scratch, p2 + 1 + j, 0),  # type: ignore[call-arg]
                    load(scratch, p3 + 1 + j, 0),  # type: ignore[call-arg]
                )
                d20, d21, d22, d23 = (
                    load(scratch, row + j, 0),  # type: ignore[call-arg]
                    load(scratch, p1 + row + j, 0),  # type: ignore[call-arg]
                    load(scratch, row + 1 + j, 0),  # type: ignore[call-arg]
                    load(scratch, p1 + row + 1 + j, 0),  # type: ignore[call-arg]
                )
                d30, d31, d32, d33 = (
                    load(scratch, p2 + row + j, 0),  # type: ignore[call-arg]
                    load(scratch, p3 + row + j, 0),  # type: ignore[call-arg]
                    load(scratch, p2 + row + 1 + j, 0),  # type: ignore[call-arg]
                    load(scratch, p3 + row + 1 + j, 0),  # type: ignore[call-arg]
                )
                e = (
                    (d00 - d02, d01 + d02, d02 - d01, d01 - d03),
                    (d10 - d12, d11 + d12, d12 - d11, d11 - d13),
                    (d20 - d22, d21 + d22, d22 - d21, d21 - d23),
                    (d30 - d32, d31 + d32, d32 - d31, d31 - d33),
                )
                q = to + j
                for k in range(4):  # unrolled: e's rows are a tuple
                    store(dst, q + k * ks, e[0][k] - e[2][k], 1)  # type: ignore[call-arg]
                    store(dst, q + (4 + k) * ks, e[1][k] + e[2][k], 1)  # type: ignore[call-arg]
                    store(dst, q + (8 + k) * ks, e[2][k] - e[1][k], 1)  # type: ignore[call-arg]
                    store(dst, q + (12 + k) * ks, e[1][k] - e[3][k], 1)  # type: ignore[call-arg]


@njit(cache=True, nogil=True, error_model="numpy")
def dy_tiles(dy: Any, th1: int, dm: Any) -> None:  # pragma: no cover - compiled
    """dm [16, O, B*J] = A dy A' of every 2x2 tile of dy [B, O, OH, OW] (zero past its edge), laid out as
    :func:`input_tiles`' v over parity planes [2, 2, th1, TW + 1]: ``e = y A'`` then ``A e``, 12 additions
    and 4 negations a tile (the 16 components of 4 signed terms took 112 operations)."""
    b_, o_, h_, w_ = dy.shape
    width = dm.shape[2]
    j_ = width // b_
    row = j_ // (th1 - 1)
    plane = th1 * row
    ks = o_ * width
    scratch = np.zeros(4 * plane, dy.dtype)
    src, dst = dy.reshape(-1), dm.reshape(-1)
    for b in range(b_):
        for o in range(o_):
            _split(src, (b * o_ + o) * h_ * w_, h_, w_, 0, 0, plane, row, scratch)
            to = o * width + b * j_
            for j in range(j_):  # y[r][q] in plane (r, q) at the tile's own row and column
                y00, y01 = load(scratch, j, 0), load(scratch, plane + j, 0)  # type: ignore[call-arg,var-annotated]
                y10, y11 = load(scratch, 2 * plane + j, 0), load(scratch, 3 * plane + j, 0)  # type: ignore[call-arg]
                e = ((y00, y00 + y01, y00 - y01, -y01), (y10, y10 + y11, y10 - y11, -y11))
                q = to + j
                for k in range(4):
                    store(dst, q + k * ks, e[0][k], 1)  # type: ignore[call-arg]
                    store(dst, q + (4 + k) * ks, e[0][k] + e[1][k], 1)  # type: ignore[call-arg]
                    store(dst, q + (8 + k) * ks, e[0][k] - e[1][k], 1)  # type: ignore[call-arg]
                    store(dst, q + (12 + k) * ks, -e[1][k], 1)  # type: ignore[call-arg]


# filters a block in filter_tiles and fold_filters: each block's 16 components in an L1 scratch of 16 runs
FILTER_BLOCK = 128


@njit(cache=True, error_model="numpy", inline="always")
def _runs(tmp: Any, flat: Any, n: int, p0: int, m: int, out: bool) -> None:  # pragma: no cover - compiled
    """Copy the scratch's 16 runs of ``m`` filters to each component's ``[p0, p0 + m)`` in ``flat``
    ([16, n] flat) where ``out``, else from there into the scratch."""
    for k in range(16):
        mine, theirs = tmp[k * FILTER_BLOCK : k * FILTER_BLOCK + m], flat[k * n + p0 : k * n + p0 + m]
        if out:
            for q in range(m):
                theirs[q] = mine[q]
        else:
            for q in range(m):
                mine[q] = theirs[q]


@njit(cache=True, nogil=True, error_model="numpy")
def filter_tiles(w: Any, u: Any) -> None:  # pragma: no cover - compiled
    """u [16, O, C] = G f G' of each 3x3 filter f of w [O, C, 3, 3], G's halves and zeros hard-coded as
    sums and halvings. A block of FILTER_BLOCK filters at a time into a scratch of 16 short runs, then
    each run copied to its component: written straight to u, the 16 components' stores, O C values
    apart (a multiple of 4 KB from 32 channels on), fell in one cache set (a [64, 64] weight: 168 us
    with G as an array, 124 without, 30 by blocks; [128, 128] 718 -> 126)."""
    n = w.shape[0] * w.shape[1]
    src, dst = w.reshape(-1), u.reshape(-1)
    h = w.dtype.type(0.5)
    tmp = np.empty(16 * FILTER_BLOCK, w.dtype)
    for p0 in range(0, n, FILTER_BLOCK):
        m = min(FILTER_BLOCK, n - p0)
        for q in range(m):
            f = src[9 * (p0 + q) : 9 * (p0 + q) + 9]
            t = (  # G f: four rows of three
                (f[0], f[1], f[2]),
                (h * (f[0] + f[3] + f[6]), h * (f[1] + f[4] + f[7]), h * (f[2] + f[5] + f[8])),
                (h * (f[0] - f[3] + f[6]), h * (f[1] - f[4] + f[7]), h * (f[2] - f[5] + f[8])),
                (f[6], f[7], f[8]),
            )
            for a in range(4):  # unrolled: t's rows are a tuple; (G f) G' a row at a time
                r = t[a]
                tmp[(4 * a) * FILTER_BLOCK + q] = r[0]
                tmp[(4 * a + 1) * FILTER_BLOCK + q] = h * (r[0] + r[1] + r[2])
                tmp[(4 * a + 2) * FILTER_BLOCK + q] = h * (r[0] - r[1] + r[2])
                tmp[(4 * a + 3) * FILTER_BLOCK + q] = r[2]
        _runs(tmp, dst, n, p0, m, True)


@njit(cache=True, nogil=True, error_model="numpy")
def fold_filters(du: Any, dw: Any) -> None:  # pragma: no cover - compiled
    """dw [O, C, 3, 3] = G' du G, the adjoint of :func:`filter_tiles`, for du [16, O, C]: a block of
    filters' 16 runs copied into a scratch first, as filter_tiles writes them."""
    n = du.shape[1] * du.shape[2]
    src, dst = du.reshape(-1), dw.reshape(-1)
    h = du.dtype.type(0.5)
    tmp = np.empty(16 * FILTER_BLOCK, du.dtype)
    for p0 in range(0, n, FILTER_BLOCK):
        m = min(FILTER_BLOCK, n - p0)
        _runs(tmp, src, n, p0, m, False)
        for q in range(m):
            c = tmp[q:]
            s = FILTER_BLOCK
            g = (  # component 4 a + b of the filter's tile: g's row a, column b
                (c[0], c[s], c[2 * s], c[3 * s]),
                (c[4 * s], c[5 * s], c[6 * s], c[7 * s]),
                (c[8 * s], c[9 * s], c[10 * s], c[11 * s]),
                (c[12 * s], c[13 * s], c[14 * s], c[15 * s]),
            )
            rows = (  # G' g: rows 0 + (1 + 2) / 2, (1 - 2) / 2, (1 + 2) / 2 + 3, for each of g's columns
                (
                    g[0][0] + h * (g[1][0] + g[2][0]),
                    g[0][1] + h * (g[1][1] + g[2][1]),
                    g[0][2] + h * (g[1][2] + g[2][2]),
                    g[0][3] + h * (g[1][3] + g[2][3]),
                ),
                (
                    h * (g[1][0] - g[2][0]),
                    h * (g[1][1] - g[2][1]),
                    h * (g[1][2] - g[2][2]),
                    h * (g[1][3] - g[2][3]),
                ),
                (
                    h * (g[1][0] + g[2][0]) + g[3][0],
                    h * (g[1][1] + g[2][1]) + g[3][1],
                    h * (g[1][2] + g[2][2]) + g[3][2],
                    h * (g[1][3] + g[2][3]) + g[3][3],
                ),
            )
            at = 9 * (p0 + q)
            for i in range(3):  # unrolled: (G' g) G, a row at a time
                r = rows[i]
                dst[at + 3 * i] = r[0] + h * (r[1] + r[2])
                dst[at + 3 * i + 1] = h * (r[1] - r[2])
                dst[at + 3 * i + 2] = h * (r[1] + r[2]) + r[3]


@njit(cache=True, nogil=True, error_model="numpy")
def tiles_out(m: Any, y: Any) -> None:  # pragma: no cover - compiled
    """y [B, O, 2 TH, 2 TW] = A' m A for each tile (th, tw) of m [16, O, B*J], J = TH (TW + 1) (the
    extra column of tiles dropped): output row 2 th + i, column 2 tw + jj. A channel's 4 outputs a tile
    are computed over all its tiles in one flat loop (``r = A' m`` by rows, then ``r A``) into a scratch
    [4, J], then interleaved into y's rows a pair of columns at a time. The same sums in the same order
    as the loop along each row of 8 tiles it replaces, which ran too short to vectorise well (--clock
    cpu, a block of [7, 16] 8x8 tiles: 30-31 -> 23-24 us, [12, 32] 4x4: 51-66 -> 38-41)."""
    o_, width = m.shape[1], m.shape[2]
    b_, th_, tw_ = y.shape[0], y.shape[2] // 2, y.shape[3] // 2
    row = tw_ + 1
    j_, pl = th_ * row, o_ * width
    src, dst = m.reshape(-1), y.reshape(-1)
    out = np.empty(4 * j_, m.dtype)
    for b in range(b_):
        for o in range(o_):
            at = o * width + b * j_
            for j in range(j_):
                q = at + j
                r0, r1 = _rows_of(src, q, pl, 0), _rows_of(src, q, pl, 1)
                store(out, j, r0[0] + r0[1] + r0[2], 1)  # type: ignore[call-arg]
                store(out, j_ + j, r0[1] - r0[2] - r0[3], 1)  # type: ignore[call-arg]
                store(out, 2 * j_ + j, r1[0] + r1[1] + r1[2], 1)  # type: ignore[call-arg]
                store(out, 3 * j_ + j, r1[1] - r1[2] - r1[3], 1)  # type: ignore[call-arg]
            base = (b * o_ + o) * th_ * 4 * tw_
            for t in range(th_):
                for i in range(2):
                    to, e, f = base + (2 * t + i) * 2 * tw_, 2 * i * j_ + t * row, (2 * i + 1) * j_ + t * row
                    for s in range(tw_):
                        store(dst, to + 2 * s, load(out, e + s, 0), 1)  # type: ignore[call-arg]
                        store(dst, to + 2 * s + 1, load(out, f + s, 0), 1)  # type: ignore[call-arg]


@njit(cache=True, error_model="numpy", inline="always")
def _rows_of(src: Any, q: int, pl: int, i: int) -> Any:  # pragma: no cover - compiled
    """Row i of A' m for the tile whose component k is src[q + k pl]: m's rows 0 + (1 + 2) (i = 0) or
    1 - (2 + 3) (i = 1), for each of its 4 columns."""
    if i == 0:
        return (
            load(src, q, 0) + (load(src, q + 4 * pl, 0) + load(src, q + 8 * pl, 0)),  # type: ignore[call-arg]
            load(src, q + pl, 0) + (load(src, q + 5 * pl, 0) + load(src, q + 9 * pl, 0)),  # type: ignore[call-arg]
            load(src, q + 2 * pl, 0) + (load(src, q + 6 * pl, 0) + load(src, q + 10 * pl, 0)),  # type: ignore[call-arg]
            load(src, q + 3 * pl, 0) + (load(src, q + 7 * pl, 0) + load(src, q + 11 * pl, 0)),  # type: ignore[call-arg]
        )
    return (
        load(src, q + 4 * pl, 0) - (load(src, q + 8 * pl, 0) + load(src, q + 12 * pl, 0)),  # type: ignore[call-arg]
        load(src, q + 5 * pl, 0) - (load(src, q + 9 * pl, 0) + load(src, q + 13 * pl, 0)),  # type: ignore[call-arg]
        load(src, q + 6 * pl, 0) - (load(src, q + 10 * pl, 0) + load(src, q + 14 * pl, 0)),  # type: ignore[call-arg]
        load(src, q + 7 * pl, 0) - (load(src, q + 11 * pl, 0) + load(src, q + 15 * pl, 0)),  # type: ignore[call-arg]
    )


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


def _blocks(n: int, plan: _Plan) -> list[tuple[int, int]]:
    return [(n0, min(n, n0 + plan.block)) for n0 in range(0, n, plan.block)]


def conv(x: Any, w: Any, padding: Pair, out: Any = None) -> Any:
    """conv2d of x [N, C, H, W] by a 3x3 w [O, C, 3, 3] at stride 1: U = G w G' once, then a block of
    samples at a time the input tiles' V, the 16 GEMMs U @ V, and A' m A into y's rows; y is ``out``
    where given (a lent C-contiguous buffer of y's shape) and the tiles cover it exactly, else copied
    into it."""
    x, (n, c) = np.ascontiguousarray(x), x.shape[:2]
    o, plan = w.shape[0], _plan(x.shape, padding, x.itemsize)
    u = np.empty((16, o, c), x.dtype)
    filter_tiles(np.ascontiguousarray(w), u)
    b, j_, th, tw = plan.block, plan.tiles, plan.th, plan.tw
    v, m = np.empty((16, c, b * j_), x.dtype), np.empty((16, o, b * j_), x.dtype)
    exact = (plan.oh, plan.ow) == (2 * th, 2 * tw)
    y = out if exact and out is not None else np.empty((n, o, 2 * th, 2 * tw), x.dtype)
    for n0, n1 in _blocks(n, plan):
        s, k = n1 - n0, (n1 - n0) * j_
        vb = v if s == b else np.empty((16, c, k), x.dtype)
        mb = m if s == b else np.empty((16, o, k), x.dtype)
        input_tiles(x[n0:n1], padding[0], padding[1], plan.hh, vb)
        tiles_out(np.matmul(u, vb, out=mb), y[n0:n1])
    if exact:
        return y
    if out is None:
        return np.ascontiguousarray(y[:, :, : plan.oh, : plan.ow])
    np.copyto(out, y[:, :, : plan.oh, : plan.ow])
    return out


def grad_weight(dy: Any, x: Any, padding: Pair, out: Any = None) -> Any:
    """dw [O, C, 3, 3] of conv's: G' (sum over tiles of dM[k] @ V[k]') G, dM = A dy A' a tile; into
    ``out`` where given (a lent C-contiguous buffer of dw's shape)."""
    x, dy, (n, c) = np.ascontiguousarray(x), np.ascontiguousarray(dy), x.shape[:2]
    o, plan = dy.shape[1], _plan(x.shape, padding, x.itemsize)
    b, j_ = plan.block, plan.tiles
    v, dm = np.empty((16, c, b * j_), x.dtype), np.empty((16, o, b * j_), x.dtype)
    du = np.zeros((16, o, c), x.dtype)
    for n0, n1 in _blocks(n, plan):
        s, k = n1 - n0, (n1 - n0) * j_
        vb = v if s == b else np.empty((16, c, k), x.dtype)
        mb = dm if s == b else np.empty((16, o, k), x.dtype)
        input_tiles(x[n0:n1], padding[0], padding[1], plan.hh, vb)
        dy_tiles(dy[n0:n1], plan.th + 1, mb)  # dy's own parity planes [2, 2, TH + 1, TW + 1]
        du += np.matmul(mb, vb.transpose(0, 2, 1))
    dw = np.empty((o, c, 3, 3), x.dtype) if out is None else out
    fold_filters(du, dw)
    return dw

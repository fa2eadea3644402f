"""The stream discipline and bf16 on a real GPU: a one-rank NCCL world whose results are handed over to a
worker's compute stream (actor_workers/runtime/cuda_streams.py), the static-shape header round, bf16 through NCCL and
the MLP trained in bf16 on cupy against numpy's bf16 (ml_dtypes). bf16 tests skip, saying why, where the
installed cupy has no bfloat16 arrays."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest

from sbpflow.actor_workers.runtime.cuda_streams import ComputeStream
from sbpflow.actor_workers.transport.base import TransportError
from sbpflow.actor_workers.transport.nccl.transport import NcclTransport
from sbpflow.dtype import DType


def bf16_or_skip(cp: ModuleType) -> np.dtype:
    try:
        dtype = DType.bfloat16.to_numpy()
        x = cp.ones((4, 4), dtype)
        assert (x @ x).dtype == dtype and float((x + x).sum()) == 32.0
    except Exception as e:
        pytest.skip(
            f"cupy {cp.__version__} has no usable bfloat16 arrays here ({e!r}); cupy >= 14 with ml_dtypes has"
        )
    return dtype


@pytest.fixture
def handed(cp: ModuleType) -> Iterator[tuple[NcclTransport, ComputeStream]]:
    t = NcclTransport(0, [0], NcclTransport.unique_id(), device=0, timeout=60.0, static_shapes=True)
    compute = ComputeStream(cp.cuda)
    t.use_compute_stream(compute)
    yield t, compute
    t.close()


def test_a_handed_over_result_is_read_correctly_by_a_compute_stream_act(
    cp: ModuleType, handed: tuple[NcclTransport, ComputeStream]
) -> None:
    t, compute = handed
    compute.enter()
    assert cp.cuda.get_current_stream() == compute.stream
    for step in range(3):  # static shapes: only the first call has the header round
        x = cp.arange(1 << 22, dtype=cp.float32) + step  # enqueued on the compute stream
        reduced = t.all_reduce(x, (0,), "grad")
        assert compute.pending() <= 1
        (twice,) = compute.wrap(lambda s, v: [v[0] * 2])(step, [reduced])
        cp.testing.assert_array_equal(twice, (cp.arange(1 << 22, dtype=cp.float32) + step) * 2)
    cp.cuda.Device().synchronize()
    assert compute.pending() == 0


def test_a_static_shape_call_that_changes_its_shape_is_refused(
    cp: ModuleType, handed: tuple[NcclTransport, ComputeStream]
) -> None:
    t, _ = handed
    t.all_gather(cp.ones((3, 2)), (0,), 0, "ag")
    t.all_gather(cp.ones((3, 2)), (0,), 0, "ag")
    with pytest.raises(TransportError, match="differs from the first call under that tag.*static_shapes"):
        t.all_gather(cp.ones((4, 2)), (0,), 0, "ag")


def test_bf16_moves_through_nccl(cp: ModuleType, handed: tuple[NcclTransport, ComputeStream]) -> None:
    dtype = bf16_or_skip(cp)
    t, compute = handed
    x = cp.asarray(np.linspace(-3, 3, 64, dtype=np.float32).astype(dtype).reshape(8, 8))
    for got in (t.all_reduce(x, (0,), "bf"), t.all_gather(x, (0,), 1, "bfg")):
        compute.wait_for(cp.cuda.get_current_stream(), [got])
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.get().astype(np.float32), x.get().astype(np.float32))


def test_the_mlp_trains_in_bf16_on_cupy_as_on_numpy(cp: ModuleType) -> None:
    from dataclasses import replace

    from tests.gpu.test_executor_gpu import mlp, train

    bf16_or_skip(cp)
    job = mlp()
    job = replace(job, config=replace(job.config, precision="bf16"))
    want, _, _ = train(job, np)
    got, _, raw = train(job, cp)
    assert isinstance(raw, cp.ndarray) and raw.dtype == np.float32  # fp32 master weights on the GPU
    # bf16 rounding differs between cuBLAS and numpy's float32-accumulating matmul: a bf16 ulp or so
    np.testing.assert_allclose(got, want, rtol=2e-2)

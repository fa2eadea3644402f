"""Validation of a Submit call's job, before anything is stored or scheduled.

``validate_submit`` parses the serialised ``sbpflow.v1.Job``, converts it, verifies the graph, checks
that the job can train (a data source and a loss), and runs the compiler's graph passes (no lowering)
so that an impossible SBP, a bad pipeline staging or a placement larger than the cluster is refused at
Submit. The compile is sized before its work (``compiler/plan_size.py``: stages x micro-batches before
the passes; the plan's walk, tasks, registers and bytes after them, before any lowering), so a job whose
plan would be over ``sbpflow.limits.Limits`` is refused here, naming the quantity, its value, the limit
and what to change, in well under a second. :func:`compile_submit` returns that compile (a ``Compiled`` after the graph passes): the job
manager keeps it for the run, which only lowers it (``pipeline.finish``), so a job is compiled once.
Every failure is a ``ValidationError`` whose message keeps the underlying error's text (the op,
the tensors, the fix); the server maps it to INVALID_ARGUMENT. Nothing is written anywhere.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from sbpflow.codec.wire import WireError, job_from_proto
from sbpflow.control_plane.launch.elastic import replace_world, world
from sbpflow.data.access import DataAccessDenied
from sbpflow.errors import SbpflowError
from sbpflow.job import Job
from sbpflow.limits import LIMITS, CompileBudget, LimitError, Limits
from sbpflow.v1 import job_pb2

if TYPE_CHECKING:
    from sbpflow.control_plane.compiler.pipeline import Compiled
    from sbpflow.control_plane.compiler.state import CompileState
    from sbpflow.control_plane.service.data_policy import DataPolicy
    from sbpflow.placement import Placement


class ValidationError(SbpflowError, ValueError):
    """A submitted job that cannot run; ``kind`` says which check refused it, ``field`` what it is about.

    kinds: ``malformed`` (not a Job protobuf), ``wire`` (a protobuf that does not describe a job),
    ``graph`` (the graph verifier), ``missing`` (no data source or loss), ``compile`` (a compiler pass:
    SBP, stages, placement vs the cluster), ``too_large`` (over the size limit), ``limit`` (a value
    outside ``sbpflow.limits``), ``data`` (the data source does not feed the graph's inputs), ``device``
    (a device type the cluster lacks), ``memory`` (:class:`AdmissionError`).
    """

    def __init__(self, message: str, *, kind: str, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.field = field

    def __str__(self) -> str:
        return self.message


class AdmissionError(ValidationError):
    """A valid job the cluster cannot hold (more memory per device than its workers have): the server
    answers RESOURCE_EXHAUSTED, naming both numbers."""


@dataclass(frozen=True)
class Cluster:
    """What Submit checks a job against: ``size`` devices (ranks ``0 .. size-1``), the ``device_types``
    they are, ``device_memory`` bytes per device by device type (a type missing there, or ``None``:
    that check is skipped)."""

    size: int | None = None
    device_types: frozenset[str] | None = None
    device_memory: Mapping[str, int] | None = None


def describe_cluster(backend: str, size: int, device_memory: int | None = None) -> Cluster:
    """The cluster a job manager admits jobs to: Ray's resources (backend ``ray``) or this machine's.

    ``device_memory``: bytes per device, for every device type; ``None``: Ray's ``memory`` resource or
    this machine's memory shared by ``size`` devices (host devices; a GPU's own memory in-process), and
    no check for Ray GPUs, whose memory Ray does not report; ``0``: no memory check. A Ray backend not
    yet connected (given its slots) is checked for its size only."""
    from sbpflow.device import gpu_available

    if backend == "ray":
        import ray

        if not ray.is_initialized():  # the manager was given its slots and has not met Ray yet
            return Cluster(size)
        res = ray.cluster_resources()
        types = {"cpu"} | ({"cuda"} if res.get("GPU", 0) > 0 else set())
        host = int(res["memory"] / size) if res.get("memory") else None
        memory = {"cpu": host} if host else {}
    else:
        types = {"cpu"} | ({"cuda"} if gpu_available() else set())
        total = machine_memory()
        memory = {"cpu": total // size} if total else {}
        if "cuda" in types:
            memory["cuda"] = _gpu_memory()
    if device_memory is not None:
        memory = {t: device_memory for t in types} if device_memory > 0 else {}
    return Cluster(size, frozenset(types), {t: m for t, m in memory.items() if m})


def _gpu_memory() -> int:
    from sbpflow.device import cupy_module

    try:
        return int(cupy_module().cuda.runtime.memGetInfo()[1])
    except Exception:  # no device answers: no memory check on cuda
        return 0


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _message(e: BaseException) -> str:
    return str(e) or type(e).__name__


def validate_submit(job_bytes: bytes, cluster: int | Cluster | None, max_bytes: int | None = None) -> Job:
    """Parse, convert, verify and compile (without lowering) ``job_bytes``; return the ``Job``."""
    return compile_submit(job_bytes, cluster, max_bytes).state.job


def compile_submit(
    job_bytes: bytes,
    cluster: int | Cluster | None,
    max_bytes: int | None = None,
    data_policy: DataPolicy | None = None,
    limits: Limits = LIMITS,
) -> Compiled:
    """Parse, convert, verify and compile (without lowering) ``job_bytes``; return the compiled job, its
    graph passes done (``Compiled.state.job`` is the submitted ``Job``; lower it with ``pipeline.finish``).

    ``cluster``: the devices the job may use (a :class:`Cluster`, or just their number), or ``None`` to
    skip those checks. ``max_bytes``: refuse a larger message before parsing it (``None``: no limit here).
    ``limits``: the bounds on the job's values and on its compile (the Compiled keeps them for the launch).
    """
    if not isinstance(cluster, Cluster):
        cluster = Cluster(size=cluster)
    job = _parse(job_bytes, max_bytes, data_policy)
    _check_devices(job, cluster)
    from sbpflow.control_plane.compiler import pipeline, plan_size

    try:
        budget = CompileBudget.start(limits)
        compiled = pipeline.compile(job, cluster_size=cluster.size, lower="none", budget=budget)
        plan_size.check(compiled.state, limits)  # before the launch lowers anything
    except LimitError as e:
        raise ValidationError(_message(e), kind="limit", field=e.field) from e
    except SbpflowError as e:
        raise ValidationError(_message(e), kind="compile", field="job.graph") from e
    if cluster.device_memory:
        _admit_memory(compiled, cluster.device_memory)
    return compiled


def _parse(job_bytes: bytes, max_bytes: int | None, data_policy: DataPolicy | None = None) -> Job:
    """The checks before any compiler pass: size, protobuf, conversion, limits, graph, data."""
    if max_bytes is not None and len(job_bytes) > max_bytes:
        raise ValidationError(
            f"the job is {len(job_bytes)} bytes, over the limit of {max_bytes} bytes; make the job smaller "
            "(e.g. fewer inline arrays) or raise the server's message size limit",
            kind="too_large",
            field="job",
        )
    m = job_pb2.Job()
    try:
        m.ParseFromString(job_bytes)
    except (DecodeError, ValueError, TypeError) as e:
        raise ValidationError(
            f"malformed Job protobuf: {_message(e)}; send sbpflow.codec.wire.job_to_proto(job).SerializeToString()",
            kind="malformed",
            field="job",
        ) from e
    try:
        job = job_from_proto(m)
    except WireError as e:
        raise ValidationError(_message(e), kind="wire", field="job") from e
    except SbpflowError as e:  # e.g. a JobConfig out of range, raised while converting
        raise ValidationError(_message(e), kind="wire", field="job.config") from e
    try:
        job.verify()
    except LimitError as e:
        raise ValidationError(_message(e), kind="limit", field=e.field) from e
    except SbpflowError as e:
        raise ValidationError(_message(e), kind="graph", field="job.graph") from e
    if job.data is None:
        raise ValidationError(
            f"job {job.name!r} has no data source; give the job one (e.g. pass a sbpflow.data.sources source to "
            "Graph.trace(data, ...)) so that its inputs can be fed",
            kind="missing",
            field="job.data",
        )
    if not job.loss:
        raise ValidationError(
            f"job {job.name!r} has no loss tensor; return the loss from Graph.build and call "
            "loss.backward() so that the job has something to train on",
            kind="missing",
            field="job.loss",
        )
    if data_policy is not None:  # before anything opens a file the job names (PERMISSION_DENIED); its
        job = data_policy.bind(job)  # files are checked again as opened, here and in the workers
    try:
        job.check_inputs()
    except DataAccessDenied:  # a symlink swapped since the check above
        raise
    except SbpflowError as e:
        raise ValidationError(_message(e), kind="data", field="job.data") from e
    return job


def _check_devices(job: Job, cluster: Cluster) -> None:
    """Refuse a placement on a device type the cluster does not have (before it holds any slot)."""
    if cluster.device_types is None:
        return
    g = job.graph
    users = [(f"tensor {t.name!r}", t.placement) for t in g.tensors.values()]
    users += [(f"op {o.name!r}", o.placement) for o in g.ops]
    for who, pl in users:
        if pl is not None and pl.device_type not in cluster.device_types:
            raise ValidationError(
                f"{who} is placed on {pl.device_type!r} devices, but the cluster has only "
                f"{sorted(cluster.device_types)}; place the job on {sorted(cluster.device_types)[0]!r} or submit "
                f"it to a cluster with {pl.device_type!r} workers",
                kind="device",
                field="job.graph.placement",
            )


def _admit_memory(compiled: Compiled, memory: Mapping[str, int]) -> None:
    """Refuse a job whose parameters, gradients and optimizer state alone (the compiler's persistent
    state per rank, its largest shards) need more bytes on some device than ``memory`` gives its type."""
    need = persistent_bytes(compiled.state)
    placements = {t.placement for t in compiled.state.graph.tensors.values() if t.placement is not None}
    kind = {r: pl.device_type for pl in placements for r in pl.ranks}
    over = [(n, r) for r, n in need.items() if kind.get(r) in memory and n > memory[kind[r]]]
    if over:
        most, rank = max(over)
        per_device = memory[kind[rank]]
        raise AdmissionError(
            f"job {compiled.state.job.name!r} needs at least {_gb(most)} per device (rank {rank}: its "
            f"parameters, gradients and optimizer state), but the workers have {_gb(per_device)} each; "
            "shard it over more devices (ZeRO, tensor or pipeline parallelism), use a smaller model, or "
            "run it on workers with more memory (--device-memory of `sbpflow server` or `sbpflow run` sets "
            "what a device holds where it cannot be read)",
            kind="memory",
            field="job.graph",
        )


def persistent_bytes(state: CompileState) -> dict[int, int]:
    """Per rank, the bytes of its shards of every parameter, gradient and optimizer-state tensor of the
    compiled graph, each at its largest shard (balanced splits put the larger pieces first): a floor
    under the compiler's memory estimate, computed without lowering. Linear in tensors plus ranks."""
    from sbpflow.graph import TensorKind
    from sbpflow.sharding import local_shape

    grads = set(state.grads.values())
    kept = (TensorKind.parameter, TensorKind.optimizer_state)
    by_placement: dict[Placement, int] = {}
    for t in state.graph.tensors.values():
        if t.placement is None or t.sbp is None or not (t.kind in kept or t.name in grads):
            continue
        shard = local_shape(t.meta.shape, t.placement.shape, t.sbp, (0,) * t.placement.ndim)
        size = math.prod(shard) * t.meta.dtype.itemsize
        by_placement[t.placement] = by_placement.get(t.placement, 0) + size
    need: dict[int, int] = {}
    for pl, size in by_placement.items():
        for r in pl.ranks:
            need[r] = need.get(r, 0) + size
    return need


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB ({n} bytes)"


def check_fallbacks(job: Job) -> None:
    """Refuse at Submit (``ValidationError``) a fallback rank count the job cannot go on with: one not
    below its ranks, or one its placements or splits cannot be re-placed on (``elastic.replace_world``)."""
    ranks = len(world(job))
    for size in job.config.elastic:
        try:
            if size >= ranks:
                raise SbpflowError(f"the job is placed on {ranks} ranks: a fallback goes on with fewer")
            replace_world(job, size)
        except SbpflowError as e:
            raise ValidationError(
                f"job {job.name!r} cannot fall back to {size} ranks (JobConfig.elastic={job.config.elastic}): "
                f"{e}",
                kind="elastic",
                field="job.config.elastic",
            ) from None

"""The GPU stream discipline (actor_workers/runtime/cuda_streams.py) on a fake of cupy.cuda's Stream, Event and current
stream: a test double for the hardware that logs what each stream is asked to do, in order, so the
orderings the discipline promises are checked on any machine.

What it promises: a gradient's all-reduce waits for the kernels made before it, the rest of the backward
goes on without waiting for it, and the first act that reads the reduced gradient waits for it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from sbpflow.actor_workers.runtime.cuda_streams import ComputeStream, for_worker, launch_on


class FakeCuda:
    """cupy.cuda as far as the discipline uses it; ``log`` holds (what, stream, event or label)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.local = threading.local()
        self.null = FakeStream(self, "null")
        self.made = self.events = 0

    def Stream(self, non_blocking: bool = False) -> FakeStream:  # noqa: N802 (cupy's name)
        self.made += 1
        return FakeStream(self, f"s{self.made}", non_blocking)

    def Event(self, disable_timing: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(self)

    def get_current_stream(self) -> FakeStream:
        stack = getattr(self.local, "stack", None)
        return stack[-1] if stack else self.null

    def stack(self) -> list[FakeStream]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def kernel(self, label: str) -> None:
        """A kernel launched on the current stream."""
        self.log.append(("kernel", self.get_current_stream().name, label))


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str, non_blocking: bool = False) -> None:
        self.cuda, self.name, self.non_blocking, self.ptr = cuda, name, non_blocking, id(self)

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait", self.name, event.name))

    def use(self) -> None:
        self.cuda.stack()[:] = [self]
        self.cuda.log.append(("use", self.name, ""))

    def __enter__(self) -> FakeStream:
        self.cuda.stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.cuda.stack().pop()


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        cuda.events += 1
        self.cuda, self.name, self.done = cuda, f"e{cuda.events}", False

    def record(self, stream: FakeStream) -> None:
        self.cuda.log.append(("record", stream.name, self.name))


class Array:
    """A stand-in result array (the discipline only keeps it and compares identities)."""


def test_without_a_compute_stream_the_caller_waits_for_the_result_at_once() -> None:
    cuda = FakeCuda()
    side = cuda.Stream(non_blocking=True)
    out, done = launch_on(cuda, side, lambda: cuda.kernel("allreduce"))
    assert cuda.log == [
        ("record", "null", "e1"),  # the caller's work so far: the inputs
        ("wait", "s1", "e1"),
        ("kernel", "s1", "allreduce"),  # run with the side stream current
        ("record", "s1", done.name),
        ("wait", "null", done.name),  # the caller's later work waits for the result
    ]


def test_a_gradients_all_reduce_overlaps_the_rest_of_the_backward_and_the_update_waits() -> None:
    cuda = FakeCuda()
    compute, comm = ComputeStream(cuda), cuda.Stream(non_blocking=True)
    grad, reduced = Array(), Array()

    def backward(step: int, values: list[Any]) -> list[Any]:
        cuda.kernel("backward")
        return [grad]

    def all_reduce(step: int, values: list[Any]) -> list[Any]:
        return [
            launch_on(cuda, comm, lambda: (cuda.kernel("allreduce"), reduced)[1], values, None, compute)[0]
        ]

    def update(step: int, values: list[Any]) -> list[Any]:
        cuda.kernel("update")
        return []

    acts = [compute.wrap(a) for a in (backward, all_reduce, backward, backward, update)]
    acts[0](0, [])
    (out,) = acts[1](0, [grad])
    assert out is reduced
    acts[2](0, [])
    acts[3](0, [])
    acts[4](0, [reduced])
    log = [e for e in cuda.log if e[0] != "use"]
    c, s = compute.stream.name, comm.name
    assert compute.stream.non_blocking is False  # host reads on the null stream still see its kernels
    assert log == [
        ("kernel", c, "backward"),
        ("record", c, "e1"),
        ("wait", s, "e1"),  # the all-reduce starts after the gradient's kernel
        ("kernel", s, "allreduce"),
        ("record", s, "e2"),
        ("kernel", c, "backward"),  # the rest of the backward: no wait on the compute stream
        ("kernel", c, "backward"),
        ("wait", c, "e2"),  # the update reads the reduced gradient: it waits, right before its kernel
        ("kernel", c, "update"),
    ]


def test_a_result_read_by_another_communicator_orders_that_one_after_it() -> None:
    cuda = FakeCuda()
    compute = ComputeStream(cuda)
    first, second = cuda.Stream(non_blocking=True), cuda.Stream(non_blocking=True)
    compute.enter()
    x, done = launch_on(cuda, first, Array, (), None, compute)
    cuda.log.clear()
    launch_on(cuda, second, Array, (x,), None, compute)
    assert ("wait", second.name, done.name) in cuda.log  # a reduce-scatter then an all-gather, say
    assert ("wait", compute.stream.name, done.name) not in cuda.log


def test_a_finished_result_is_forgotten_and_nothing_waits_for_it() -> None:
    cuda = FakeCuda()
    compute = ComputeStream(cuda)
    x, done = launch_on(cuda, cuda.Stream(), Array, (), None, compute)
    assert compute.pending() == 1
    done.done = True
    cuda.log.clear()
    compute.wrap(lambda step, values: [])(0, [x])
    assert not [e for e in cuda.log if e[0] == "wait"]
    assert compute.pending() == 0


def test_a_send_hands_nothing_over_and_makes_nobody_wait() -> None:
    cuda = FakeCuda()
    compute = ComputeStream(cuda)
    compute.enter()
    _, done = launch_on(cuda, cuda.Stream(), Array, (), None, compute, wait=False)
    assert compute.pending() == 0
    assert ("wait", compute.stream.name, done.name) not in cuda.log


def test_the_compute_stream_is_current_in_every_thread_that_acts() -> None:
    cuda = FakeCuda()
    compute = ComputeStream(cuda)
    seen: list[str] = []
    act = compute.wrap(lambda step, values: seen.append(cuda.get_current_stream().name) or [])
    act(0, [])
    act(1, [])
    worker = threading.Thread(target=act, args=(2, []))
    worker.start()
    worker.join()
    assert seen == [compute.stream.name] * 3
    assert [e for e in cuda.log if e[0] == "use"] == [("use", compute.stream.name, "")] * 2  # once a thread


def test_a_numpy_worker_has_no_compute_stream_and_a_gpu_one_hands_it_to_its_transport() -> None:
    class Transport:
        compute: ComputeStream | None = None

        def use_compute_stream(self, compute: ComputeStream) -> None:
            self.compute = compute

    assert for_worker(np, Transport()) is None

    class Cupy:
        __name__ = "cupy"
        cuda = FakeCuda()

    t = Transport()
    compute = for_worker(Cupy(), t)
    assert compute is not None and t.compute is compute
    assert for_worker(Cupy(), None) is not None  # one GPU, no transport


def test_a_communication_act_leaves_the_compute_stream_running() -> None:
    cuda = FakeCuda()
    compute = ComputeStream(cuda)
    scattered, _ = launch_on(cuda, cuda.Stream(non_blocking=True), Array, (), None, compute)
    cuda.log.clear()
    gather = cuda.Stream(non_blocking=True)
    act = compute.wrap(
        lambda step, values: [launch_on(cuda, gather, Array, values, None, compute)[0]], reads=False
    )
    act(0, [scattered])  # a reduce-scatter's result read by an all-gather on another communicator
    waits = [e for e in cuda.log if e[0] == "wait"]
    assert waits and all(stream == gather.name for _, stream, _ in waits)

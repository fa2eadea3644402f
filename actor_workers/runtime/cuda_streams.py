"""CUDA stream discipline of one GPU worker: its compute stream, and the events between it and the other
streams (each NCCL communicator's) that make a result before a kernel reads it.

Written against a ``cuda`` module (``cupy.cuda``: ``Stream``, ``Event``, ``get_current_stream``), which
is all it touches, so the ordering is unit-tested with a fake of those three (the hardware, not this
logic) on any machine. The rules:

- **One compute stream per worker**, not cupy's legacy null stream (which every other stream of the
  device would wait for). It is a *blocking* stream: host code on another thread that reads an array on
  the null stream (a checkpoint's ``.get()``) still sees every kernel before it. :meth:`ComputeStream.enter`
  makes it current in the calling thread (cupy's current stream is per thread), once per thread.
- **Work on a side stream** (:func:`launch_on`) starts after an event recorded on the caller's stream
  at the call (its inputs are made by then) and after the events of inputs that are themselves still
  being made on another side stream; it runs with the side stream current, so cupy's own copies and
  allocations there are ordered with the NCCL call; an event recorded after it says when it is done.
- **Results are handed over, not waited for.** Without a :class:`ComputeStream` the caller's stream
  waits for the result's event at once (correct for any caller). With one, the result and its event are
  filed (:meth:`ComputeStream.hand_over`) and only an act that reads that array makes the compute stream
  wait (:meth:`ComputeStream.wrap`), right before its kernels. A gradient's all-reduce thus runs while the
  compute stream goes on with the rest of the backward; the update that reads the reduced gradient waits.
- **Memory** (cupy's pool keeps freed blocks per stream). The caller keeps a side call's inputs alive
  until its event is done (``NcclComms.run``), so the compute stream cannot reuse their blocks early. A
  result made on the side stream returns to that stream's pool when its readers drop it, after they
  enqueued their kernels; the side stream reuses the block only in a later call, after waiting for an
  event recorded on the caller's stream at that call, so after those kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

Act = Callable[[int, list[Any]], list[Any]]


def record(cuda: Any, stream: Any) -> Any:
    """A new event, recorded on ``stream`` now (no timing: the cheap kind)."""
    event = cuda.Event(disable_timing=True)
    event.record(stream)
    return event


class ComputeStream:
    """A worker's compute stream and the results of other streams that its readers must wait for.

    ``pending`` maps ``id(array)`` to ``(array, done event)``; holding the array keeps the id unique
    while the entry lives. An entry goes once its event is done (nothing need wait for it any more).
    """

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self.stream = cuda.Stream(non_blocking=False)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Any, Any]] = {}

    def enter(self) -> None:
        """Make the compute stream current in this thread (once per thread)."""
        if not getattr(self._local, "entered", False):
            self.stream.use()
            self._local.entered = True

    def hand_over(self, array: Any, done: Any) -> None:
        """``array`` is made on another stream, ready at ``done``: its readers wait for ``done``."""
        with self._lock:
            self._prune()
            self._pending[id(array)] = (array, done)

    def wait_for(self, stream: Any, arrays: Sequence[Any]) -> None:
        """Make ``stream`` wait for every array of ``arrays`` still being made on another stream."""
        with self._lock:
            self._prune()  # a result that is made needs no wait
            found = [self._pending.get(id(a)) for a in arrays]
        for entry, array in zip(found, arrays, strict=True):
            if entry is not None and entry[0] is array:
                stream.wait_event(entry[1])

    def pending(self) -> int:
        """How many handed-over results may still be in the making."""
        with self._lock:
            self._prune()
            return len(self._pending)

    def _prune(self) -> None:
        for key in [k for k, (_, done) in self._pending.items() if done.done]:
            del self._pending[key]

    def wrap(self, act: Act, reads: bool = True) -> Act:
        """``act`` run with the compute stream current, after the results it reads are made (``reads``:
        a communication act's transport orders its own stream after its inputs instead, so that the
        compute stream goes on)."""

        def on_stream(step: int, values: list[Any]) -> list[Any]:
            self.enter()
            if reads and self._pending:
                self.wait_for(self.stream, values)
            return act(step, values)

        return on_stream


def for_worker(xp: Any, transport: Any = None) -> ComputeStream | None:
    """The compute stream of a worker whose kernels run on ``xp`` (None on numpy), handed to its
    transport when that one hands results over (``use_compute_stream``: the NCCL transport's)."""
    if xp.__name__ == "numpy":
        return None
    compute = ComputeStream(xp.cuda)
    use = getattr(transport, "use_compute_stream", None)
    if use is not None:
        use(compute)
    return compute


def launch_on(
    cuda: Any,
    side: Any,
    body: Callable[[], Any],
    inputs: Sequence[Any] = (),
    ready: Any = None,
    handoff: ComputeStream | None = None,
    wait: bool = True,
) -> tuple[Any, Any]:
    """Run ``body()`` with ``side`` current, ordered after the caller's stream's work so far (or after
    ``ready``, an event recorded earlier) and after the inputs still in the making; return its result and the event
    recorded after it on ``side``. With ``wait`` the result is ordered before the caller's
    later work: at once on the caller's stream (no ``handoff``), or for its readers (``handoff``). A
    ``wait=False`` call (a send: nothing on the caller's side reads it) only returns the event."""
    caller = cuda.get_current_stream()
    # always, even for a header that reads no kernel's output: what body allocates may reuse a block a
    # reader on the caller's stream has dropped but not yet run (see Memory above)
    side.wait_event(record(cuda, caller) if ready is None else ready)
    if handoff is not None:
        handoff.wait_for(side, inputs)
    with side:
        result = body()
    done = record(cuda, side)
    if wait:
        if handoff is None:
            caller.wait_event(done)
        elif result is not None:
            handoff.hand_over(result, done)
    return result, done

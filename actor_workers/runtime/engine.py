"""The engine: one device's actors, run by one thread per stream.

Req and ack are counters updated under one lock per engine, and each stream thread sleeps on its own
condition of that lock; an act costs one lock round trip and a wake-up only when it makes an actor of
another stream ready. Each stream keeps a heap of its ready actors and acts the lowest
``(priority, iteration, id)`` — the plan's order. An *ordered* stream (``ordered_streams``, meant for
communication) acts in exactly the order ``(iteration, priority, id)`` and waits for the next actor in
that order even when others are ready: that is what keeps collectives in the same order on every rank.

A stream may run on another's thread (``run_on``, e.g. ``{"data": "compute"}``): its actors join that
stream's heap, and their acts still count (``busy``) and trace as their own stream's. On a worker with
one core a thread of its own only takes the GIL and the core from the compute thread, a wake-up each time.

A failing act, a timeout or ``abort()`` stops every stream; the first failure is raised by ``run`` as
a RuntimeFailure naming the rank, the actor and the cause, after all stream threads have ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from heapq import heappop, heappush
from typing import Any

from sbpflow.actor_workers.runtime.actors import Actor, ActorSpec, Register, RegisterSpec
from sbpflow.actor_workers.runtime.errors import RuntimeAborted, RuntimeFailure, RuntimeTimeout
from sbpflow.actor_workers.runtime.linking import link
from sbpflow.actor_workers.runtime.trace import ActEvent

AbortHook = Callable[[str], None]  # e.g. Transport.abort: unblocks acts waiting on peers


@dataclass(frozen=True)
class RunResult:
    """What a finished run leaves: the trace (when asked for), the last value written to each register
    the engine was asked to keep (``keep_last``: the final value of a loop's variable, a chain's output),
    the peak of live values per register, the number of acts and the wall time in seconds."""

    trace: list[ActEvent]
    last: dict[int, Any]
    peak_live: dict[int, int]
    acts: int
    seconds: float
    rank: int = 0


class _Stream:
    __slots__ = (
        "name", "cond", "heap", "waiting", "remaining", "current", "events", "order", "level", "pos", "busy"
    )  # fmt: skip

    def __init__(
        self, name: str, lock: threading.Lock, actors: list[Actor], ordered: bool, busy: dict[str, float]
    ) -> None:
        self.name = name
        self.cond = threading.Condition(lock)
        self.heap: list[tuple[int, int, int, Actor]] = []
        self.waiting = False
        self.remaining = sum(a.iterations for a in actors)
        self.current: Actor | None = None  # the actor inside its act
        self.events: list[tuple[Actor, int, float, float]] = []
        # an ordered stream walks its actors in (iteration, priority, id): level i holds those that act at i
        self.order = sorted(actors, key=lambda a: (a.priority, a.id)) if ordered else None
        self.level: list[Actor] = []
        self.pos = 0
        self.busy = busy  # name -> seconds the stream has spent in acts (step reports read it)
        busy.setdefault(name, 0.0)
        if self.order is not None:
            self.level = [a for a in self.order if a.iterations > 0]

    def expected(self) -> Actor | None:
        return self.level[self.pos] if self.pos < len(self.level) else None

    def advance(self, it: int) -> None:
        self.pos += 1
        if self.pos == len(self.level):
            assert self.order is not None
            self.level = [a for a in self.order if a.iterations > it + 1]
            self.pos = 0


class Engine:
    """The actors and registers of one rank. ``run`` may be called once. ``keep_last``: the registers
    whose newest value the run keeps for ``RunResult.last``; every other value is dropped by the engine
    once its readers have acted (see :func:`_keep`)."""

    def __init__(
        self,
        actors: Sequence[ActorSpec],
        registers: Sequence[RegisterSpec],
        trace: bool = False,
        *,
        rank: int = 0,
        ordered_streams: Collection[str] = (),
        abort_hooks: Sequence[AbortHook] = (),
        busy: dict[str, float] | None = None,
        run_on: Mapping[str, str] | None = None,
        keep_last: Collection[int] = (),
    ) -> None:
        self.rank = rank
        self.busy = {} if busy is None else busy  # stream -> seconds in acts so far (a RankContext's)
        self._actors, self._registers = link(actors, registers)
        _keep(self._registers, keep_last)
        for a in self._actors:  # the initial values are in the inboxes now: dropped once read
            if a.spec.initial:
                a.spec = replace(a.spec, initial={})
        self._trace = trace
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        host = _hosts(run_on or {}, ordered_streams)
        for name in dict.fromkeys(host(a.stream) for a in actors):
            members = [a for a in self._actors if host(a.spec.stream) == name]
            self._streams[name] = _Stream(name, self._lock, members, name in ordered_streams, self.busy)
        for a in self._actors:
            a.stream = self._streams[host(a.spec.stream)]
            self.busy.setdefault(a.spec.stream, 0.0)
        self._left = sum(a.iterations for a in self._actors)
        self._done = threading.Event()
        self._stopped = False
        self._failure: RuntimeFailure | None = None
        self._hooks = list(abort_hooks)
        self._listeners: list[Callable[[RuntimeFailure], None]] = []  # an EngineGroup's
        self._threads: list[threading.Thread] = []
        self._started = False
        self._t0 = self._t1 = 0.0

    # ---- public ---------------------------------------------------------------------------------------
    def run(self, timeout: float) -> RunResult:
        """Run every actor through all its iterations; raise RuntimeFailure on failure or after ``timeout``."""
        self.start()
        try:
            self.wait(time.monotonic() + timeout, timeout)
        except BaseException:  # e.g. KeyboardInterrupt in the caller: stop the streams before leaving
            self.abort("interrupted")
            raise
        finally:
            self.join()
        return self.result()

    def abort(self, reason: str) -> None:
        """Stop from outside (a failed peer, a cancelled job): ``run`` raises RuntimeFailure(cause=reason)."""
        self._stop(RuntimeFailure(self.rank, None, None, RuntimeAborted(reason)))

    def add_abort_hook(self, hook: AbortHook) -> None:
        self._hooks.append(hook)

    # ---- the parts of run, for EngineGroup ------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            raise RuntimeError(f"rank {self.rank}: an Engine runs once; build a new one")
        self._started = True
        self._t0 = time.perf_counter()
        if self._left == 0:
            self._done.set()
        for s in self._streams.values():
            if s.remaining:
                t = threading.Thread(
                    target=self._loop, args=(s,), name=f"sbpflow-r{self.rank}-{s.name}", daemon=True
                )
                self._threads.append(t)
        with self._lock:
            for a in self._actors:
                if a.missing == 0 and a.it < a.iterations:
                    self._push(a)
        for t in self._threads:
            t.start()

    def wait(self, deadline: float, timeout: float) -> bool:
        """Wait until done or failed; past the deadline, stop with a RuntimeTimeout. True when not timed out."""
        if self._done.wait(max(0.0, deadline - time.monotonic())):
            return True
        self._stop(RuntimeTimeout(self.rank, None, None, TimeoutError(self.stall_report(timeout))))
        return False

    def join(self, grace: float = 5.0) -> None:
        """Join the stream threads. An act stuck outside the engine's reach (not in a transport that the
        abort hooks unblock) cannot be interrupted in Python; it is named in the failure instead."""
        end = time.monotonic() + grace
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        self._t1 = time.perf_counter()
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck and self._failure is not None:
            acting = [s.current.name for s in self._streams.values() if s.current is not None]
            self._failure.cause.add_note(f"threads {stuck} still inside acts {acting} after {grace}s")

    def result(self) -> RunResult:
        if self._failure is not None:
            raise self._failure
        events = [
            ActEvent(
                a.id,
                a.name,
                a.spec.stream,
                it,
                t0,
                t1,
                f"sbpflow-r{self.rank}-{s.name}",
                self.rank,
                a.spec.trace_args,
            )
            for s in self._streams.values()
            for a, it, t0, t1 in s.events
        ]
        events.sort(key=lambda e: e.start)
        return RunResult(
            trace=events,
            last={r.spec.id: r.last for r in self._registers if r.keep},
            peak_live={r.spec.id: r.peak for r in self._registers},
            acts=sum(a.it for a in self._actors),
            seconds=self._t1 - self._t0,
            rank=self.rank,
        )

    def stall_report(self, timeout: float) -> str:
        with self._lock:
            lines = []
            for a in sorted(self._actors, key=lambda a: (a.it, a.priority, a.id)):
                if a.it >= a.iterations:
                    continue
                s = a.stream
                if s.current is a:
                    why = "is inside its act"
                elif a.busy:
                    why = "is ready and waits for its turn on the stream"
                    if s.order is not None and s.expected() is not None:
                        why += f" (next in order: {s.expected().name!r})"  # type: ignore[union-attr]
                else:
                    why = "waits for " + a.waits_for()
                lines.append(f"  {a.name!r} (stream {s.name}, iteration {a.it}/{a.iterations}) {why}")
        more = f"\n  ... and {len(lines) - 12} more" if len(lines) > 12 else ""
        return f"not done after {timeout}s; unfinished actors:\n" + "\n".join(lines[:12]) + more

    # ---- the stream thread ----------------------------------------------------------------------------
    def _loop(self, s: _Stream) -> None:
        """Act, one actor at a time, until the stream's actors are done. Finishing the last act
        (:meth:`_finish`), picking the next and taking its inputs (a slot in every output register, a value
        from every inbox, written out here) are one pass under the lock: this runs once an act (ResNet-18:
        ~600 a step, all on one thread)."""
        lock, cond, heap, trace = self._lock, s.cond, s.heap, self._trace
        events, busy, ordered = s.events, s.busy, s.order is not None
        perf = time.perf_counter
        a: Actor | None = None
        outs: Any = ()
        values: Any = None
        it = 0
        while True:
            with lock:
                if self._stopped:
                    s.current = None
                    return
                if a is not None:
                    self._finish(a, outs)
                    outs = None  # a value dies with its readers: this thread keeps no act's values
                    s.current = None
                while not heap or (ordered and heap[0][3] is not s.level[s.pos]):
                    if s.remaining == 0:
                        s.current = None
                        return
                    s.waiting = True
                    cond.wait(1.0)
                    s.waiting = False
                    if self._stopped:
                        return
                a = heappop(heap)[3]
                if ordered:
                    s.advance(a.it)
                s.remaining -= 1
                s.current = a
                it = a.it
                # reserve a slot in every output register, read one value from every input
                for reg in a.out_regs:
                    reg.free -= 1
                    if not reg.free:
                        a.missing += 1
                    live = reg.count - reg.free
                    if live > reg.peak:
                        reg.peak = live
                values = []
                for box in a.inboxes:
                    values.append(box.popleft())
                    if not box:
                        a.missing += 1
            try:
                t0 = perf()
                outs = a.act(it, values)
                values = None
                t1 = perf()
                busy[a.stream_name] += t1 - t0  # only this thread writes its streams' entries
                if trace:
                    events.append((a, it, t0, t1))
                if a.n_out:
                    if type(outs) is not list and type(outs) is not tuple or len(outs) != a.n_out:
                        raise ValueError(_bad_outputs(outs, a.n_out))
                else:
                    outs = ()
            except BaseException as e:  # noqa: BLE001 - anything from an act stops the engine
                self._stop(RuntimeFailure(self.rank, a.name, a.spec.op or None, e, it))
                return

    def _finish(self, a: Actor, outs: Any) -> None:
        """Req the outputs to their consumers, ack the inputs to their producers (under the lock); a
        consumer or producer this makes ready is pushed on its stream's heap (:meth:`_push`, written out
        for the consumers: most acts make one ready)."""
        push = self._push
        # req the outputs to their consumers (as many as out_regs: checked after the act)
        for reg, v in zip(a.out_regs, outs, strict=False):
            if reg.keep:
                reg.last = v
            boxes = reg.boxes
            if boxes:
                reg.pending.append(reg.n_readers)
                for c, box in boxes:
                    box.append(v)
                    if len(box) == 1:
                        c.missing -= 1
                        if not c.missing and not c.busy and c.it < c.iterations:
                            c.busy = True  # push(c), written out: most acts make one ready
                            cs = c.stream
                            if cs.order is None:
                                heappush(cs.heap, (c.priority, c.it, c.id, c))
                            else:
                                heappush(cs.heap, (c.it, c.priority, c.id, c))
                            if cs.waiting:
                                cs.cond.notify()
            else:  # nobody reads it: free at once
                reg.freed += 1
                reg.free += 1
                if reg.free == 1:
                    a.missing -= 1
        # ack the inputs to their producers
        acks = a.acks
        j = 0
        for reg in a.in_regs:
            pending = reg.pending
            k = acks[j] - reg.freed
            acks[j] += 1
            j += 1
            pending[k] -= 1
            if not k and not pending[0]:
                was = reg.free
                while pending and not pending[0]:
                    pending.popleft()
                    reg.freed += 1
                    reg.free += 1
                if not was:
                    p = reg.producer
                    p.missing -= 1
                    if not p.missing and not p.busy and p.it < p.iterations:
                        push(p)
        a.it += 1
        a.busy = False
        if not a.missing and a.it < a.iterations:
            push(a)
        self._left -= 1
        if not self._left:
            self._done.set()

    def _push(self, a: Actor) -> None:
        a.busy = True
        s = a.stream
        if s.order is None:
            heappush(s.heap, (a.priority, a.it, a.id, a))
        else:
            heappush(s.heap, (a.it, a.priority, a.id, a))
        if s.waiting:
            s.cond.notify()

    def _stop(self, failure: RuntimeFailure) -> None:
        with self._lock:
            if self._failure is not None or self._done.is_set() and self._left == 0:
                return
            self._failure = failure
            self._stopped = True
            for s in self._streams.values():
                s.cond.notify_all()
            self._done.set()
        for listen in self._listeners:
            listen(failure)
        for hook in self._hooks:
            try:
                hook(str(failure))
            except Exception as e:  # noqa: BLE001 - a hook must not hide the failure it reports
                failure.add_note(f"abort hook {hook!r} raised {type(e).__name__}: {e}")


def _keep(registers: list[Register], keep_last: Collection[int]) -> None:
    """Only the registers in ``keep_last`` hold their newest value after their readers are done with it.

    Holding every register's newest value kept the whole step's values alive into the next step: the
    peak was the sum of the registers, not the largest set of values alive at once. Nothing in a run
    reads them (the executor's results come from the store and the fetches), and the runtime's reuse
    of dead buffers counts the references to a value (``tasks.UNHELD``): a kept register's value is
    never lent while the register holds it."""
    ids = {r.spec.id for r in registers}
    unknown = sorted(set(keep_last) - ids)
    if unknown:
        raise ValueError(
            f"keep_last names registers {unknown} that the engine does not have; name only its registers"
        )
    for r in registers:
        r.keep = r.spec.id in keep_last
        if not r.keep:
            r.last = None  # an initial value of a loop edge lives in its readers' inboxes


def _hosts(run_on: Mapping[str, str], ordered: Collection[str]) -> Callable[[str], str]:
    """The stream whose thread runs each stream's actors; an ordered stream neither moves nor hosts,
    since its order is the plan's and another stream's actors would break it."""
    for moved, onto in run_on.items():
        if moved in ordered or onto in ordered:
            raise ValueError(
                f"run_on {moved!r} -> {onto!r}: an ordered stream ({sorted(ordered)}) runs alone on its "
                "thread; move only unordered streams onto unordered ones"
            )
    return lambda stream: run_on.get(stream, stream)


def _bad_outputs(outs: Any, n: int) -> str:
    if type(outs) is not list and type(outs) is not tuple:
        return f"act returned a {type(outs).__name__}, not a list of {n} values (one per output register)"
    return f"act returned {len(outs)} values for {n} output registers"

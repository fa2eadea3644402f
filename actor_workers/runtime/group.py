"""Several engines (ranks) run together: the first failure aborts them all, and the transports too.

In the in-process backend every rank is an Engine in one process; a failed act on one rank must stop
the others, which may be blocked in a collective waiting for it. The group aborts every engine and
calls the abort hooks (the transports' ``abort``), so that blocked transport calls raise and every
stream thread ends; ``run`` then raises the first failure, not the echoes it caused elsewhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from sbpflow.actor_workers.runtime.engine import AbortHook, Engine, RunResult
from sbpflow.actor_workers.runtime.errors import (
    ActorGraphError,
    RuntimeAborted,
    RuntimeFailure,
    RuntimeTimeout,
)

CANCELLED = "cancelled"


class EngineGroup:
    """Runs engines of distinct ranks together. ``abort_hooks`` are called once, on the first failure."""

    def __init__(self, engines: Sequence[Engine], abort_hooks: Sequence[AbortHook] = ()) -> None:
        ranks = [e.rank for e in engines]
        if len(set(ranks)) != len(ranks):
            raise ActorGraphError(f"engine group: ranks {ranks} repeat; give each engine its own rank")
        self.engines = list(engines)
        self._hooks = list(abort_hooks)
        self._lock = threading.Lock()
        self._failure: RuntimeFailure | None = None
        for e in self.engines:
            e._listeners.append(self._on_failure)

    def run(self, timeout: float, cancel: threading.Event | None = None) -> dict[int, RunResult]:
        """Run all engines to the end; raise the first RuntimeFailure (or a RuntimeTimeout) otherwise.
        Setting ``cancel`` aborts every engine (the failure's cause is RuntimeAborted("cancelled"))."""
        deadline = time.monotonic() + timeout
        try:
            for e in self.engines:
                e.start()
            for e in self.engines:
                if not self._wait(e, deadline, cancel):
                    report = "\n".join(
                        f"rank {x.rank}: {x.stall_report(timeout)}"
                        for x in self.engines
                        if not x._done.is_set()
                    )
                    self._on_failure(RuntimeTimeout(None, None, None, TimeoutError(report)))
                    break
        except BaseException as exc:  # a failed start, or KeyboardInterrupt in the caller
            self._on_failure(RuntimeFailure(None, None, None, exc))
            raise
        finally:
            for e in self.engines:
                e.join()
        if self._failure is not None:
            raise self._failure
        return {e.rank: e.result() for e in self.engines}

    def _wait(self, e: Engine, deadline: float, cancel: threading.Event | None) -> bool:
        """Wait for ``e`` until ``deadline``; False on timeout. A set ``cancel`` aborts the group."""
        while not e._done.wait(max(0.0, min(deadline - time.monotonic(), 0.05 if cancel else 1e9))):
            if time.monotonic() >= deadline:
                return False
            if cancel is not None and cancel.is_set():
                self.abort(CANCELLED)
                e._done.wait(max(0.0, deadline - time.monotonic()))
                return e._done.is_set()
        return True

    def abort(self, reason: str) -> None:
        """Stop every engine from outside (a cancelled job, a lost worker)."""
        self._on_failure(RuntimeFailure(None, None, None, RuntimeAborted(reason)))

    def _on_failure(self, failure: RuntimeFailure) -> None:
        with self._lock:
            if self._failure is not None:
                return  # an echo of the first failure on another rank
            self._failure = failure
        reason = str(failure)
        for e in self.engines:
            e.abort(reason)
        for hook in self._hooks:
            try:
                hook(reason)
            except Exception as exc:  # noqa: BLE001 - a hook must not hide the failure it reports
                failure.add_note(f"abort hook {hook!r} raised {type(exc).__name__}: {exc}")

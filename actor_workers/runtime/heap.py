"""What Python's cycle collector walks while a run's steps go (issue 15: measured steps that rank as modelled).

CPython's collector runs on allocation counts, in whichever thread allocates at that moment, and its
oldest generation walks every tracked object of the process. In a process that holds a compiled plan
(its graph, tables, protobufs) or a search's candidates, that is 100-400 ms of one thread's CPU, once
every several steps, under the GIL: a pause of every rank of an in-process run, and a straggler a
step among Ray workers (Megatron-LM's ``--manual-gc`` answers the same pauses).

:func:`frozen` holds the heap as it stands when a run starts in the collector's permanent generation
(``gc.freeze``) for as long as the run's steps go: the collector still runs, and still frees the
cycles the steps make, but walks only the objects made since. The freeze is process-wide, so runs
that overlap in one process (ranks, or jobs, as threads) share it: the first holder freezes, each new
holder freezes what the others made meanwhile, and the last one out collects what was made while it
held (young objects only) and unfreezes. A cycle that was alive at the freeze and dies during the
run waits for the first collection after the last holder leaves.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Within the block, the objects alive at its start (and at any overlapping holder's start) are
    left out of the cycle collector's walks (module docstring)."""
    global _holders
    with _lock:
        _holders += 1
        gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                gc.collect()  # the run's own cycles, while the rest is still left out
                gc.unfreeze()


def holders() -> int:
    """How many :func:`frozen` blocks are open in this process now."""
    return _holders

"""What Python's cycle collector walks while a run's steps go (issue 15: measured steps that rank as modelled).

CPython's collector runs on allocation counts, in whichever thread allocates at that moment, and its
oldest generation walks every tracked object of the process. In a process that holds a compiled plan
(its graph, tables, protobufs) or a search's candidates, that is 100-400 ms of one thread's CPU, once
every several steps, under the GIL: a pause of every rank of an in-process run, and a straggler a
step among Ray workers (Megatron-LM's ``--manual-gc`` answers the same pauses).

:func:`frozen` holds the heap as it stands when a run starts in the collector's permanent generation
(``gc.freeze``) for as long as the run goes: the collector still runs, and still frees the cycles the
run makes, but walks only the objects made since. The freeze is process-wide, so holders that overlap
in one process (an in-process run's launcher around its engines, ranks or jobs as threads) share it:
the first holder freezes, a later one adds nothing (what was made under the hold stays young), and
the last one out collects what was made while it was held and unfreezes. That collection walks the
run's own objects, not the process's heap: the launcher's engines, transports and closures form
cycles that hold every register and the store, freed there at a run's cost (a full collection in a
process of 750,000 objects, a test session's, was ~220 ms a run). A cycle that was alive at the
freeze and dies during the run waits for the first collection after the last holder leaves.
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
        if _holders == 1:
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

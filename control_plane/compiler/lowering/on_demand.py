"""On-demand lowering: when a job is too big to hold its whole Plan, and how its communicator order is
proven without every rank's tasks.

``lower(state, ranks=[r])`` builds only rank ``r``'s DevicePlan, equal (ids, registers, communicator
positions) to the one in the full plan. Ids and ``comm_seq`` are positions in one global walk, and every
emission knows how many tasks and registers each rank of its placement adds, so the walk only counts the
other ranks' tasks instead of building them; every call on a communicator of ``r`` involves ``r``, so its
positions there are exact. A control plane ships each worker only its DevicePlan, and a 1024-device job
never has to hold 26 million tasks in one process (``pipeline.compile`` chooses, with
:func:`estimate_tasks` against :data:`LAZY_ABOVE`). Without every rank's tasks, :func:`check_order`
proves the communicator order from the walk's one sequence of boxing steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sbpflow.boxing import BoxingPlan, Collective
from sbpflow.control_plane.compiler import comm_order
from sbpflow.control_plane.compiler.comm_order import CommOrder, GroupCall
from sbpflow.control_plane.compiler.lowering.boxing import Lowerer
from sbpflow.control_plane.compiler.lowering.tasks import placement_of
from sbpflow.control_plane.compiler.passes import micro_batching
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, Graph, OpNode

if TYPE_CHECKING:
    from sbpflow.control_plane.compiler.lowering.lower import Lowered

# Above this many tasks (every rank's together) ``pipeline.compile(lower="auto")`` stops materialising the
# whole Plan and lowers ranks on demand: at ~20 us a task, 500 000 tasks are ~10 s and ~1 GB of protobuf.
LAZY_ABOVE = 500_000


def check_order(low: Lowered) -> int:
    """The graph-level communicator check (``comm_order`` docstring) of a walk made with ``log=True``:
    every communicator's order is the projection of the walk's one sequence of boxing steps, so it is
    enough that each distinct step's calls, as lowering emits them for every rank, involve every member
    of their communicator once with matching primitives. Returns the number of distinct steps checked."""
    assert low.trail is not None, "lower(..., log=True) records the walk's boxing steps"
    seen: set[tuple[int, int]] = set()
    for op_name, plan, i in low.trail:
        if (id(plan), i) not in seen:
            seen.add((id(plan), i))
            comm_order.check_calls(step_calls(op_name, plan, i))
    return len(seen)


def step_calls(op_name: str, plan: BoxingPlan, i: int) -> list[GroupCall]:
    """Every rank's communicator calls of step ``i`` of ``plan``, emitted by lowering's own code (no
    rank built: only the calls are recorded)."""
    low = Lowerer(Graph(), {}, frozenset(), comm=CommOrder(log=[]))
    low.keep = None  # every group and destination, though no task is built
    op = OpNode(op_name, BOXING, (), ())
    step = plan.steps[i]
    if step.collective is Collective.p2p:
        low.p2p(op, plan, step, {}, "", i)
    else:
        low.collective(op, plan, step, {}, "", i)
    assert low.comm.log is not None
    return low.comm.log


def estimate_tasks(state: CompileState) -> int:
    """About how many tasks the full plan has (one per op, rank and micro-batch; a boxing op counted as
    one step): what decides whether ``pipeline.compile`` materialises the Plan, without lowering."""
    lay = micro_batching.layout(state)
    g, m = state.graph, lay.micro_batches
    return sum(placement_of(g, o).size * (m if o.name in lay.slot_of else 1) for o in g.ops)

"""The step as the runtime runs it, for the cost model (``cost_model.py``): priced ops in, seconds out.

**The critical path** (:func:`simulate`). Per pipeline stage a compute stream and a communication stream,
each in the plan's order (the runtime's communication stream is ordered); every (op, micro-batch) starts
once its stream is free and its inputs are made. The order is lowering's (:func:`order`): the ops that
read only parameters (``pre``), those that depend on the data once per micro-batch in the schedule's
timeline, then the update (``step``). So a gradient's all-reduce runs beside the backward still to come,
a tensor-parallel all-reduce in the forward holds its readers up, and pipeline stages overlap as the
schedule lets them. One rank stands for its stage: coordinate 0, whose shard is the largest.

**What a host shares** (:func:`host_bounds`). A CPU profile's rates are one rank's (its BLAS threads) on
a host of ``host_cores`` cores, so the ranks placed on one host cannot together run more than the host
does: the step is at least their busy seconds times their threads over the cores. Ranks that are threads
of one process (the ``inprocess`` link) also share one interpreter, and they take it in turns for
what holds it: each op's ``python_s``, that is a kernel's act and the part of its time its roofline does
not explain (its Python and numpy's per-call dispatch; the roofline's part, a BLAS call or a long numpy
loop, runs with the GIL released), their collectives' CPU (the rendezvous and its numpy work,
``LinkProfile.interpreter``), their data loading (Python loops) and the acts outside the graph; the step is at
least the sum of those (``Load.interpreter_s``). A kernel's GIL-free part does overlap another rank's Python
where it is long: Wide & Deep's layouts with replicated tables, whose AdamW runs ~0.8 ms a rank at memory
bandwidth, spend up to 1.6x their wall time in CPU (``bench/compiler/auto_plan.py``); counting that part held
priced its tensor-parallel layouts 1.2-1.3x its data-parallel one with split tables, which they ran 1-9 %
faster than.
A rank's hand-offs between its streams (a thread woken) are its own latency, not the shared
interpreter's: while one rank waits for a woken thread the others run (a fit of the MLP's and Wide &
Deep's measured CPU a step against their plans' acts, hand-offs, kernels and collectives gave a hand-off
0-16 us, against the 59 us of the profile's probe, whose chain waits at every link). Data loading runs
ahead of compute (the loader prefetches a step), so it bounds the step rather than adding to it.
The step is the largest of these bounds; :attr:`Bounds.name` says which one it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sbpflow.control_plane.compiler.passes.micro_batching import Layout
from sbpflow.graph import OpNode

Order = list[tuple[str, int | None]]  # (op, micro-batch); None: once per step


@dataclass(frozen=True)
class OpCost:
    """One op's modelled seconds per call on its stage's busiest rank (``StepEstimate.by_op``: per step,
    all its micro-batches)."""

    name: str
    op_type: str
    stage: int
    comm: bool  # on the communication stream (a boxing node's messages)
    seconds: float
    flops: int = 0  # one rank: a call's, or (by_op) a step's
    bytes: int = 0  # one rank: moved in memory (compute) or sent (communication)
    python_s: float = 0.0  # of ``seconds``, the interpreter's bookkeeping (the per-act overhead)


def order(lay: Layout) -> Order:
    """Every (op, micro-batch) of a step in lowering's order."""
    out: Order = [(n, None) for n in lay.pre]
    for stage, action in lay.schedule.timeline():
        out += [(n, action.micro_batch) for n in lay.slots.get((stage, action.phase), ())]
    return out + [(n, None) for n in lay.step]


def simulate(steps: Order, ops: Mapping[str, OpNode], costs: Mapping[str, OpCost], with_comm: bool) -> float:
    """The critical path of one step (module docstring); ``with_comm=False`` makes every message free."""
    free: dict[tuple[int, bool], float] = {}
    ready: dict[tuple[str, int | None], float] = {}  # (tensor, micro-batch); None: once, or the last one
    end = 0.0
    for name, k in steps:
        o, c = ops[name], costs[name]
        t_in = max((ready.get((i, k), ready.get((i, None), 0.0)) for i in o.inputs), default=0.0)
        stream = (c.stage, c.comm)
        done = max(free.get(stream, 0.0), t_in) + (c.seconds if with_comm or not c.comm else 0.0)
        free[stream] = done
        for out in o.outputs:
            ready[(out, k)] = done
            if k is not None:
                ready[(out, None)] = max(ready.get((out, None), 0.0), done)
        end = max(end, done)
    return end


@dataclass(frozen=True)
class Load:
    """What one rank of a stage does in a step: its seconds busy computing (its kernels, the acts of its
    plan that are no op of the graph, and its hand-offs between streams), what it holds of the
    interpreter its in-process peers share (``interpreter_s``: :func:`host_bounds`), its data loading
    alone, and those acts outside the graph (in ``compute_s`` and ``interpreter_s`` too)."""

    compute_s: float
    interpreter_s: float
    data_s: float
    tail_s: float = 0.0  # acts outside the graph's ops (variable writes, loads, fetches), run serially


@dataclass(frozen=True)
class Bounds:
    critical_s: float  # the simulated critical path
    data_s: float  # the slowest rank's data loading (prefetched: a bound, not a term)
    host_s: float  # the busiest host's work over its cores
    interpreter_s: float  # the ranks sharing one interpreter, one at a time

    @property
    def step_s(self) -> float:
        return max(self.critical_s, self.data_s, self.host_s, self.interpreter_s)

    @property
    def name(self) -> str:
        named = {
            "the critical path": self.critical_s,
            "data loading": self.data_s,
            "the host's cores": self.host_s,
            "one interpreter (the GIL)": self.interpreter_s,
        }
        return max(named, key=lambda k: named[k])


def host_bounds(
    critical_s: float,
    loads: Mapping[int, Load],
    ranks_of: Mapping[int, Sequence[int]],
    host_cores: int,
    threads: int,
    ranks_per_host: int,
    one_interpreter: bool,
) -> Bounds:
    """The step's bounds (module docstring) from the simulated critical path (to which each stage's acts
    outside the graph add), each stage's :class:`Load` and its ranks; ranks sit on hosts
    in order, ``ranks_per_host`` a host (0: every rank on one host), and ``host_cores == 0`` means each
    device is its own (a GPU): no host bound."""
    stage_of = {r: s for s, ranks in ranks_of.items() for r in ranks}
    hosts: dict[int, float] = {}
    for r, s in stage_of.items():
        h = r // ranks_per_host if ranks_per_host > 0 else 0
        hosts[h] = hosts.get(h, 0.0) + loads[s].compute_s + loads[s].data_s
    host_s = max(hosts.values(), default=0.0) * (threads or host_cores) / host_cores if host_cores else 0.0
    shared = sum(loads[s].interpreter_s for s in stage_of.values()) if one_interpreter else 0.0
    critical_s += max((x.tail_s for x in loads.values()), default=0.0)
    return Bounds(critical_s, max((x.data_s for x in loads.values()), default=0.0), host_s, shared)

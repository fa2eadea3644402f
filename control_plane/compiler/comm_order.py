"""Communicators, the one order of their steps, and the static proof that every rank agrees on it.

A rendezvous collective (NCCL, gloo, our in-process transport) hangs when two ranks of a group issue
their calls in different orders, and a send waits forever for a receive that its peer posts later. So
the plan gives every group of ranks that communicates one :class:`~sbpflow.v1.plan_pb2.Communicator`
whose ``order`` lists every step of every rank in ONE global sequence — the topological order in which
lowering walks the boxing nodes — and each task records its position there (``Task.comm_seq``). The
runtime runs a rank's steps in that order even when a later step's inputs are ready first.

Communicators are identified by their device type and member ranks (``"cpu:0,1,2,3"``): a collective
runs on the ranks along one mesh axis of a placement (one group per setting of the other axes), and a
point-to-point transfer between placements runs on the pair of its two ranks (sorted, so that both
directions share one channel and one order).

:func:`check` proves, from the protobuf alone, that
  * every step names a task of that rank which points back at the step (communicator and position);
  * on each communicator every member rank sees the same sequence of calls — the same boxing (op and
    SBPs), the same primitive and the same byte count — with SENDs facing RECVs of equal size;
  * no cycle runs through several communicators (a rank finishing call a on one communicator before
    call b on another, while a peer does the opposite), proved by a topological sort of all calls.

:func:`check_calls` proves the same at the graph level, for a plan too big to materialise (a
1024-device job is lowered one rank at a time): lowering's walk logs its calls in its one global order,
each call at once for all its participants. If every call involves each member of its communicator
exactly once with the same primitive (a send facing a receive of the same size), then every member's
sequence on a communicator is the projection of that one order — the same sequence on all members — and
since every rank's tasks are emitted in the same walk, the global order is a topological order of all
calls on all communicators: no cycle either.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from sbpflow.errors import SbpflowError
from sbpflow.v1 import plan_pb2 as pp


class CommOrderError(SbpflowError, ValueError):
    """Ranks of a communicator disagree on the order of their steps: the plan could deadlock."""


def communicator_id(device_type: str, ranks: Sequence[int]) -> str:
    return f"{device_type}:{','.join(map(str, ranks))}"


def pair_ranks(a: int, b: int) -> tuple[int, int]:
    """The member ranks of a point-to-point channel; both directions share it."""
    return (a, b) if a < b else (b, a)


@dataclass(frozen=True)
class GroupCall:
    """One call of the global order, as the graph-level check sees it: no tasks, only who takes part."""

    communicator: str
    ranks: tuple[int, ...]  # the communicator's members
    call: Call
    members: tuple[tuple[int, int], ...]  # (rank, primitive) of each participant, in step order


@dataclass
class CommOrder:
    """Collects communicator steps while lowering walks the graph in its one global order.

    A walk that builds only some ranks (``lowering.lower(ranks=...)``) passes ``None`` for the tasks it
    does not build: their positions are counted, so a built task's ``comm_seq`` is its position in the
    full order, and ``steps`` holds the built ranks' steps only. ``log``, when a list, receives every call.
    """

    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    steps: dict[str, list[pp.CommStep]] = field(default_factory=dict)
    length: dict[str, int] = field(default_factory=dict)  # steps so far, built or not
    log: list[GroupCall] | None = None

    def add(
        self,
        device_type: str,
        ranks: Sequence[int],
        call: Call,
        members: Sequence[tuple[pp.Task | None, int, int, int]],
    ) -> None:
        """Append one call: a (task or None, rank, kind, bytes this rank sends) per participating rank."""
        cid = communicator_id(device_type, ranks)
        if self.log is not None:
            self.log.append(GroupCall(cid, tuple(ranks), call, tuple((r, k) for _, r, k, _ in members)))
        start = self.length.get(cid, 0)
        self.length[cid] = start + len(members)
        order = None
        for i, (task, rank, kind, nbytes) in enumerate(members):
            if task is None:
                continue
            if order is None:
                self.ranks.setdefault(cid, tuple(ranks))
                order = self.steps.setdefault(cid, [])
            task.communicator = cid
            task.comm_seq = start + i
            order.append(pp.CommStep(task_id=task.id, rank=rank, kind=kind, bytes=nbytes))  # type: ignore[arg-type]

    def to_proto(self) -> list[pp.Communicator]:
        return [
            pp.Communicator(id=cid, ranks=self.ranks[cid], order=self.steps[cid])
            for cid in sorted(self.steps)
        ]


# ---- the static check -----------------------------------------------------------------------------

_KIND = pp.CollectiveKind
_P2P = {_KIND.COLLECTIVE_KIND_SEND, _KIND.COLLECTIVE_KIND_RECV}


@dataclass(frozen=True)
class Call:
    """What a rank does at one position of a communicator: comparable across ranks."""

    op: str
    boxing: str
    kind: str  # the primitive; "send/recv" for either side of a point-to-point transfer
    bytes: int

    def __repr__(self) -> str:
        return f"{self.kind} of {self.op or '?'} ({self.boxing}, {self.bytes} B)"


def call_kind(kind: int) -> str:
    """The primitive as calls compare it: either side of a point-to-point transfer is "send/recv"."""
    return "send/recv" if kind in _P2P else _name(kind).removeprefix("COLLECTIVE_KIND_").lower()


def _call(task: pp.Task, step: pp.CommStep) -> Call:
    b = task.boxing
    return Call(task.op_name, f"{b.from_sbp} -> {b.to_sbp}", call_kind(step.kind), b.bytes_moved)


def _name(kind: int) -> str:
    return _KIND.Name(kind)  # type: ignore[arg-type]


def check(plan: pp.Plan) -> None:
    """Raise :class:`CommOrderError` naming the communicator and the first disagreement."""
    tasks = {t.id: (d.rank, t) for d in plan.devices for t in d.tasks}
    per_rank: dict[str, dict[int, list[tuple[Call, int, int]]]] = {}
    for comm in plan.communicators:
        per_rank[comm.id] = _project(comm, tasks)
        _compare(comm, per_rank[comm.id])
    _acyclic(plan, tasks, per_rank)


def _project(
    comm: pp.Communicator, tasks: dict[int, tuple[int, pp.Task]]
) -> dict[int, list[tuple[Call, int, int]]]:
    """Each member rank's steps in order, as (call, primitive, task id)."""
    seqs: dict[int, list[tuple[Call, int, int]]] = {r: [] for r in comm.ranks}
    for i, step in enumerate(comm.order):
        where = f"communicator {comm.id} step {i} (task {step.task_id}, rank {step.rank})"
        if step.rank not in seqs:
            raise CommOrderError(f"{where}: rank {step.rank} is not a member {list(comm.ranks)}")
        if step.task_id not in tasks:
            raise CommOrderError(f"{where}: no such task in the plan")
        rank, task = tasks[step.task_id]
        if rank != step.rank or task.communicator != comm.id or task.comm_seq != i:
            raise CommOrderError(
                f"{where}: the task runs on rank {rank} and points at {task.communicator or 'no communicator'} "
                f"position {task.comm_seq}; a step and its task must name each other"
            )
        seqs[rank].append((_call(task, step), step.kind, step.task_id))
    return seqs


def _compare(comm: pp.Communicator, seqs: dict[int, list[tuple[Call, int, int]]]) -> None:
    first = comm.ranks[0]
    ref = seqs[first]
    for rank, seq in seqs.items():
        for i in range(max(len(ref), len(seq))):
            if i >= len(ref) or i >= len(seq):
                short, long_ = (first, rank) if i >= len(ref) else (rank, first)
                extra = (seq if i >= len(ref) else ref)[i][0]
                raise CommOrderError(
                    f"communicator {comm.id}: rank {long_} runs {extra!r} as its call {i}, but rank {short} has "
                    f"only {i} calls; every member must run every call"
                )
            (a, ka, _), (b, kb, _) = ref[i], seq[i]
            if a != b:
                raise CommOrderError(
                    f"communicator {comm.id}: call {i} is {a!r} on rank {first} but {b!r} on rank {rank}; "
                    "the ranks would wait on each other (deadlock): emit both in the same global order"
                )
            if a.kind == "send/recv" and rank != first and {ka, kb} != _P2P:
                raise CommOrderError(
                    f"communicator {comm.id}: call {i} ({a!r}) is {_name(ka)} on rank {first} and "
                    f"{_name(kb)} on rank {rank}; a send must face a receive"
                )


def _acyclic(
    plan: pp.Plan,
    tasks: dict[int, tuple[int, pp.Task]],
    per_rank: dict[str, dict[int, list[tuple[Call, int, int]]]],
) -> None:
    """Calls ordered by each communicator and by each rank's task order must form no cycle."""
    position = {
        tid: (cid, i)
        for cid, seqs in per_rank.items()
        for seq in seqs.values()
        for i, (_, _, tid) in enumerate(seq)
    }
    edges: dict[tuple[str, int], set[tuple[str, int]]] = defaultdict(set)
    nodes = set(position.values())
    for cid, seqs in per_rank.items():
        calls = max((len(s) for s in seqs.values()), default=0)
        for i in range(calls - 1):
            edges[(cid, i)].add((cid, i + 1))
    for device in plan.devices:
        mine = [position[t.id] for t in device.tasks if t.id in position]
        for a, b in zip(mine, mine[1:], strict=False):
            if a != b:
                edges[a].add(b)
    indegree = {n: 0 for n in nodes}
    for a in edges:
        for b in edges[a]:
            indegree[b] += 1
    ready = deque(n for n, d in indegree.items() if d == 0)
    done = 0
    while ready:
        n = ready.popleft()
        done += 1
        for b in edges.get(n, ()):
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    if done != len(nodes):
        stuck = sorted(n for n, d in indegree.items() if d > 0)[:4]
        raise CommOrderError(
            f"the calls {stuck} (communicator, position) wait on each other across communicators: some rank "
            "runs them in an order that contradicts another communicator's; emit tasks in one global order"
        )


def check_calls(calls: Sequence[GroupCall]) -> None:
    """The graph-level proof (module docstring): raise :class:`CommOrderError` at the first call that
    some member of its communicator would not run, or would run as another primitive."""
    for i, gc in enumerate(calls):
        who = [r for r, _ in gc.members]
        if sorted(who) != sorted(gc.ranks):
            raise CommOrderError(
                f"communicator {gc.communicator}: call {i} of the global order ({gc.call!r}) runs on ranks "
                f"{who}, but its members are {list(gc.ranks)}; every member must run every call exactly once"
            )
        kinds = sorted(k for _, k in gc.members)
        p2p = gc.call.kind == "send/recv"
        if (p2p and kinds != sorted(_P2P)) or (not p2p and len(set(kinds)) != 1):
            raise CommOrderError(
                f"communicator {gc.communicator}: call {i} of the global order ({gc.call!r}) is "
                f"{[_name(k) for k in kinds]} on ranks {who}; "
                + ("a send must face a receive" if p2p else "every member must run the same collective")
            )

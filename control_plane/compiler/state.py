"""What the passes share: the job being compiled and the facts each pass adds for the next.

Every pass is a module with one entry point ``run(state) -> None`` that rewrites ``state.graph`` (the
logical IR of sbpflow/graph.py) and fills its own fields here; ``Graph.verify`` holds after each one.

After ``autodiff``: ``grads`` maps each trainable parameter to its gradient tensor.
After ``optimizer``: ``updates`` maps each variable (parameter or optimizer state) to the tensor that
holds its value for the next step; ``state_vars`` lists the optimizer state tensors.
After ``sbp``: every tensor has a placement and an nd-SBP, and ``choices`` records, per op, the chosen
signature and why. After ``boxing``: every op's inputs have exactly the SBP its signature asks for;
``boxings`` maps each inserted boxing op to its plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sbpflow.boxing import BoxingPlan
from sbpflow.graph import Graph
from sbpflow.job import Job
from sbpflow.ops.base import NdSignature


@dataclass(frozen=True)
class Choice:
    """The signature SBP inference chose for one op, its boxing cost in bytes, and a one-line reason."""

    signature: NdSignature
    cost: int
    reason: str


@dataclass
class CompileState:
    job: Job
    graph: Graph
    grads: dict[str, str] = field(default_factory=dict)
    updates: dict[str, str] = field(default_factory=dict)
    state_vars: list[str] = field(default_factory=list)
    choices: dict[str, Choice] = field(default_factory=dict)
    boxings: dict[str, BoxingPlan] = field(default_factory=dict)

    @classmethod
    def start(cls, job: Job) -> CompileState:
        job.verify()
        return cls(job, job.graph.copy())

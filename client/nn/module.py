"""``Module``: parameters and submodules registered on attribute set, as in PyTorch.

Calling a module records its ``forward`` into the running trace under the module's scope (its path in
the graph, ``blocks.0.attn``), pipeline stage and activation-checkpointing flag. Inside a trace, a
parameter attribute reads as the traced ``Tensor``; outside one it is the ``Parameter`` declaration.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from sbpflow.checkpoint.format import CheckpointError
from sbpflow.checkpoint.imports import Mismatch, check
from sbpflow.client import context
from sbpflow.client.nn import layouts, state
from sbpflow.client.nn.parameter import Parameter
from sbpflow.errors import SbpflowError
from sbpflow.placement import Placement


class Module:
    # layout -> how this class's parameters are named and stored there (see layouts): names as they are
    LAYOUTS: ClassVar[Mapping[str, layouts.LayoutRules]] = {layouts.EVERY: layouts.Rules()}
    training: bool
    activation_checkpointing: bool
    stage: tuple[int, Placement] | None

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "activation_checkpointing", False)
        object.__setattr__(self, "stage", None)

    # ---- registration -------------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise SbpflowError(
                f"cannot set {type(self).__name__}.{name} before Module.__init__ ran; call "
                "super().__init__() first in __init__"
            )
        params, mods = self.__dict__["_parameters"], self.__dict__["_modules"]
        params.pop(name, None)
        mods.pop(name, None)
        self.__dict__.pop(name, None)
        if isinstance(value, Parameter):
            params[name] = value
        elif isinstance(value, Module):
            mods[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:  # only called when normal lookup fails
        d = self.__dict__
        if name in d.get("_parameters", {}):
            param = d["_parameters"][name]
            tracer = context.active()
            bound = tracer.tensor_of(param) if tracer is not None else None
            return param if bound is None else bound
        if name in d.get("_modules", {}):
            return d["_modules"][name]
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for table in (self.__dict__["_parameters"], self.__dict__["_modules"]):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter) -> None:
        setattr(self, name, param)

    def add_module(self, name: str, module: Module) -> None:
        setattr(self, name, module)

    # ---- traversal ----------------------------------------------------------------------------------

    def named_children(self) -> Iterator[tuple[str, Module]]:
        yield from self.__dict__["_modules"].items()

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """Every module once (shared ones at their first path), this one first."""
        seen: set[int] = set()
        stack = [(prefix, self)]
        while stack:
            path, mod = stack.pop(0)
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            yield path, mod
            stack[0:0] = [(f"{path}.{n}" if path else n, m) for n, m in mod.named_children()]

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """Every parameter once: a parameter shared by two modules (tied weights) at its first path."""
        seen: set[int] = set()
        for path, mod in self.named_modules(prefix):
            for n, p in mod.__dict__["_parameters"].items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{path}.{n}" if path else n), p

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def num_parameters(self) -> int:
        return sum(p.meta.numel for p in self.parameters())

    # ---- values ------------------------------------------------------------------------------------

    def state_dict(self, layout: str | None = None) -> dict[str, Any]:
        """Every parameter's logical value (numpy) by its path here; see :mod:`~sbpflow.client.nn.state`.
        ``layout``: under that framework's names and orientation (``"torch"``, ``"gpt2"``, ``"hf-bert"``,
        ``"torchvision"``: :mod:`~sbpflow.client.nn.layouts`), tied copies and buffers included."""
        values = state.state_dict(self.named_parameters())
        return values if layout is None else layouts.to_layout(values, layouts.plan(self, layout))

    def load_state_dict(
        self,
        values: Mapping[str, Any] | str | os.PathLike[str],
        strict: bool = True,
        layout: str | None = None,
    ) -> Mismatch:
        """Set the parameters from ``values``: arrays or PyTorch tensors by name, or a file (safetensors,
        ``.npz``, a ``torch.save`` ``.pt``/``.bin``). Strict: names, shapes and dtypes must all match,
        every problem named. ``layout``: the names and orientation of that framework (``state_dict``'s).
        Returns the missing and unexpected names (empty under ``strict``)."""
        given = state.arrays_of(values)
        if layout is None:
            return state.load_state_dict(self.named_parameters(), given, strict, self._own_names_fix())
        plan = layouts.plan(self, layout)
        given = layouts.rooted(plan, given)  # a hub file's base-model names take the head model's root
        here = {n: (p.shape, p.dtype.to_numpy()) for n, p in self.named_parameters()}
        want = layouts.wanted(plan, here)
        if strict:
            layouts.refuse_untied(plan, given)
        skip = plan.optional() - set(want)
        hint = layouts.orientation_hint(plan, want, given, self._other_plans(layout))
        fix = hint or f"give names as model.state_dict(layout={layout!r}) gives them"
        found = check(
            want,
            {n: (a.shape, a.dtype) for n, a in given.items() if n not in skip},
            strict,
            "the state dict",
            fix,
        )
        state.load_state_dict(self.named_parameters(), layouts.from_layout(given, plan), strict=False)
        return found

    def _other_plans(self, layout: str) -> dict[str, layouts.Plan]:
        """This model's plans under the layouts other than ``layout`` that apply to it."""
        out = {}
        for name in layouts.NAMES:
            if name != layout:
                try:
                    out[name] = layouts.plan(self, name)
                except CheckpointError:
                    continue
        return out

    def _own_names_fix(self) -> str:
        fits = list(self._other_plans(""))
        return "pass one of this model's own (model.state_dict() names)" + (
            f", or a PyTorch state dict with its layout: layout= {', '.join(map(repr, fits))}" if fits else ""
        )

    def to(self, dtype: Any) -> Module:
        """Every floating parameter as ``dtype`` (``model.to(sf.float64)``); returns self."""
        state.to_dtype(self.named_parameters(), dtype)
        return self

    # ---- modes and placement ------------------------------------------------------------------------

    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def set_stage(self, stage: int, placement: Placement) -> Module:
        """Run this module as pipeline stage ``stage`` on ``placement`` (its parameters live there too)."""
        if not isinstance(stage, int) or stage < 0:
            raise SbpflowError(f"set_stage({stage!r}): the stage is a non-negative int")
        if not isinstance(placement, Placement):
            raise SbpflowError(f"set_stage needs a placement from sf.placement(...), got {placement!r}")
        object.__setattr__(self, "stage", (stage, placement))
        return self

    # ---- calling ------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer = context.require(f"calling module {type(self).__name__}")
        with tracer.module_scope(self):
            return self.forward(*args, **kwargs)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"  ({n}): " + repr(m).replace("\n", "\n  ") for n, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ("\n" + "\n".join(lines) + "\n)" if lines else ")")

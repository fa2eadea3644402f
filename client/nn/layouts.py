"""Other frameworks' layouts of a model's parameters, as rules per module class.

A layout (``"torch"``, ``"gpt2"``, ``"hf-bert"``, ``"torchvision"``) names each parameter as PyTorch's
module of that family does and stores it in that module's orientation. Each module class says how in
its ``LAYOUTS`` table: layout -> :class:`Rules` (or a function of the module giving them, where they
depend on its sizes); ``"*"`` is every layout. ``Module`` itself holds ``{"*": Rules()}`` (names as they
are), so a user's container of layers needs no rule; a model family holds rules for its own layouts only,
and another layout on it is refused, naming the module (:func:`plan`).

:func:`plan` walks a module and gives one :class:`ParamRule` per parameter (its name there, whether it
is transposed, how its fused q/k/v columns lie there, the names that repeat it: a tied head);
:func:`to_layout` and :func:`from_layout` apply them, each the other's exact inverse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from sbpflow.checkpoint.format import CheckpointError

EVERY = "*"  # a LAYOUTS key: the rules of every layout
NAMES = ("torch", "gpt2", "hf-bert", "torchvision")  # the layouts some module family has rules for


@dataclass(frozen=True)
class Rules:
    """How one module's parameters and children are named and stored in a layout."""

    # a child or parameter here -> its name there ('' : its children sit in this module's place there);
    # a dotted key renames a descendant (``"layers.3": "layer2.1"``)
    names: Mapping[str, str] = field(default_factory=dict)
    transpose: tuple[str, ...] = ()  # own 2-d parameters stored [out, in] there (nn.Linear's weight)
    conv1d: tuple[str, ...] = ()  # children whose weights are [in, out] there too (GPT-2's Conv1D)
    # child -> its fused q/k/v columns there ([H, 3, Dh] here, ``heads`` from the module's n_head): () one
    # tensor with columns [3, H, Dh] (nanoGPT's c_attn); three names: three tensors (BERT's query, key, value)
    qkv: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tied: Mapping[str, str] = field(default_factory=dict)  # a name there -> the parameter here it repeats
    untied_fix: str = ""  # what to do when a file's names imply the tie but this module is untied
    buffers: Mapping[str, Any] = field(default_factory=dict)  # names there with no parameter here
    ignored: tuple[str, ...] = ()  # names there dropped on import (non-trainable buffers)


LayoutRules = Rules | Callable[[Any], Rules]


class Node(Protocol):
    """What :func:`plan` reads of a module (``sf.nn.Module``; a protocol: this module imports none)."""

    LAYOUTS: Mapping[str, LayoutRules]

    def named_children(self) -> Iterable[tuple[str, Any]]: ...


@dataclass(frozen=True)
class ParamRule:
    """One parameter: its name here (``tensor``) and there (``torch``; for q/k/v ``parts``, one per
    part), whether it is transposed there, its heads when its columns are fused q/k/v, and the names
    there that repeat it."""

    tensor: str
    torch: str
    transpose: bool = False
    heads: int = 0
    parts: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return self.parts or (self.torch,)


@dataclass(frozen=True)
class Plan:
    """Every parameter's rule in one layout, and what the layout holds besides them."""

    layout: str
    rules: tuple[ParamRule, ...]
    buffers: Mapping[str, Any] = field(default_factory=dict)  # exported; optional on import
    ignored: frozenset[str] = frozenset()  # dropped on import
    untied: tuple[tuple[str, str, str], ...] = ()  # (name there, the name it would repeat, the fix)

    def optional(self) -> set[str]:
        """Names a file may hold or lack: tied copies, buffers, ignored names."""
        return {t for r in self.rules for t in r.tied} | set(self.buffers) | set(self.ignored)


def rules_of(module: Node, layout: str, path: str) -> Rules:
    table = type(module).LAYOUTS
    found = table.get(layout, table.get(EVERY))
    if found is None:
        at = f" (at {path!r})" if path else ""
        raise CheckpointError(
            f"layout {layout!r} has no rule for {type(module).__name__}{at}: it knows "
            f"{', '.join(repr(k) for k in table) or 'none'}; use one of those, or add a Rules entry to "
            f"{type(module).__name__}.LAYOUTS"
        )
    return found if isinstance(found, Rules) else found(module)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


@dataclass(frozen=True)
class _How:
    """What a parent's rules say of a child: Conv1D, fused q/k/v (heads, part names), renames below it."""

    conv1d: bool = False
    qkv: tuple[int, tuple[str, ...]] | None = None
    names: Mapping[str, str] = field(default_factory=dict)


@dataclass
class _Walk:
    layout: str
    seen: set[int] = field(default_factory=set)
    rules: list[ParamRule] = field(default_factory=list)
    buffers: dict[str, Any] = field(default_factory=dict)
    ignored: set[str] = field(default_factory=set)
    ties: list[tuple[str, str, str, str]] = field(default_factory=list)  # (there, here, fix, module)

    def visit(self, mod: Any, here: str, there: str, how: _How) -> None:
        r = rules_of(mod, self.layout, here)
        names = {**r.names, **how.names}
        conv1d, qkv = how.conv1d, how.qkv
        for name, p in mod.__dict__["_parameters"].items():
            if p is None or id(p) in self.seen:
                continue
            self.seen.add(id(p))
            torch = _join(there, names.get(name, name))
            heads, parts = qkv if qkv else (0, ())
            parts = tuple(_join(q, name) for q in parts)
            transpose = name in r.transpose and not conv1d
            self.rules.append(ParamRule(_join(here, name), torch, transpose, heads, parts))
        for name, value in r.buffers.items():
            self.buffers[_join(there, name)] = value
        self.ignored.update(_join(there, n) for n in r.ignored)
        for name, target in r.tied.items():
            self.ties.append((_join(there, name), _join(here, target), r.untied_fix, type(mod).__name__))
        for name, child in mod.named_children():
            fused = (int(mod.n_head), tuple(_join(there, q) for q in r.qkv[name])) if name in r.qkv else None
            below = {k[len(name) + 1 :]: v for k, v in names.items() if k.startswith(name + ".")}
            how = _How(name in r.conv1d, fused, below)
            self.visit(child, _join(here, name), _join(there, names.get(name, name)), how)

    def plan(self) -> Plan:
        by_tensor = {r.tensor: i for i, r in enumerate(self.rules)}
        produced = {n for r in self.rules for n in r.names}
        untied = []
        for there, here, fix, module in self.ties:
            i = by_tensor.get(here)
            if i is None:
                raise CheckpointError(f"{module}.LAYOUTS ties {there!r} to {here!r}, which is no parameter")
            if there in produced:  # the module holds its own parameter under that name: untied here
                untied.append((there, self.rules[i].torch, fix))
            else:
                self.rules[i] = replace(self.rules[i], tied=(*self.rules[i].tied, there))
        return Plan(
            self.layout, tuple(self.rules), dict(self.buffers), frozenset(self.ignored), tuple(untied)
        )


def plan(root: Node, layout: str, here: str = "", there: str = "") -> Plan:
    """The rules of every parameter of ``root`` (at ``here`` in its graph, ``there`` in the layout) in
    the order ``named_parameters`` gives them (a shared parameter once, at its first path)."""
    walk = _Walk(layout)
    walk.visit(root, here, there, _How())
    return walk.plan()


# ---- conversion ------------------------------------------------------------------------------------------


def there_shape(r: ParamRule, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of each of ``r``'s tensors there, for ``shape`` here."""
    if r.parts:
        shape = (*shape[:-1], shape[-1] // 3)
    return tuple(reversed(shape)) if r.transpose else shape


def _qkv(a: np.ndarray, heads: int, to_there: bool) -> np.ndarray:
    """The last axis (3D columns) from [H, 3, Dh] to [3, H, Dh] (or back)."""
    *lead, n = a.shape
    here, there = (heads, 3, n // (3 * heads)), (3, heads, n // (3 * heads))
    src = here if to_there else there
    return np.ascontiguousarray(np.swapaxes(a.reshape(*lead, *src), -3, -2).reshape(*lead, n))


def _t(a: np.ndarray, transpose: bool) -> np.ndarray:
    return np.ascontiguousarray(a.T) if transpose else a


def to_layout(values: Mapping[str, np.ndarray], p: Plan) -> dict[str, np.ndarray]:
    """``values`` (by name here) under the layout's names and orientation, tied copies and buffers
    included; a value no rule names (optimizer state) is left out."""
    out: dict[str, np.ndarray] = {}
    for r in p.rules:
        if r.tensor not in values:
            continue
        a = np.asarray(values[r.tensor])
        a = _qkv(a, r.heads, to_there=True) if r.heads else a
        if r.parts:
            for name, part in zip(r.parts, np.split(a, 3, axis=-1), strict=True):
                out[name] = _t(np.ascontiguousarray(part), r.transpose)
        else:
            out[r.torch] = _t(a, r.transpose)
        for t in r.tied:
            out[t] = out[r.torch].copy()
    out.update({n: np.array(v) for n, v in p.buffers.items()})
    return out


def from_layout(values: Mapping[str, np.ndarray], p: Plan) -> dict[str, np.ndarray]:
    """A state dict in the layout (by name there) under the names and orientation here. A name no rule
    knows passes through, so a strict load names it as unexpected; a part missing leaves its parameter
    out (missing); buffers and ignored names are dropped, and a tied copy must equal its tensor."""
    given = {n: np.asarray(v) for n, v in values.items()}
    out: dict[str, np.ndarray] = {}
    known: set[str] = set(p.buffers) | set(p.ignored)
    for r in p.rules:
        known.update(r.names)
        known.update(r.tied)
        if not all(n in given for n in r.names):
            continue
        parts = [_t(given[n], r.transpose) for n in r.names]
        a = np.concatenate(parts, axis=-1) if r.parts else parts[0]
        fused = r.heads and a.ndim and a.shape[-1] % (3 * r.heads) == 0
        out[r.tensor] = _qkv(a, r.heads, to_there=False) if fused else a
        for t in r.tied:
            if t in given and not np.array_equal(given[t], given[r.torch]):
                raise CheckpointError(
                    f"{t!r} is tied to {r.tensor!r} here (one tensor), but the state dict holds other values "
                    f"for it than for {r.torch!r}; load it into a model whose config unties them"
                )
    out.update({n: a for n, a in given.items() if n not in known})
    return out


# ---- loading: checked under the layout's names ------------------------------------------------------------

Metas = Mapping[str, tuple[tuple[int, ...], np.dtype]]


def rooted(p: Plan, given: Mapping[str, Any]) -> dict[str, Any]:
    """A base model's state dict under the names of the model with a head: Hugging Face's hub files hold
    ``GPT2Model``'s names (``h.0.attn.c_attn.weight``), ``GPT2LMHeadModel`` and this layout
    ``transformer.h.0...``. Where no name of ``given`` is the layout's but, under the root the layout's
    names share, most are, they take that root; otherwise ``given`` is returned as it is."""
    names = {n for r in p.rules for n in r.names} | p.optional()
    if not given or set(given) & names:
        return dict(given)
    for root in sorted({n.split(".", 1)[0] for n in names if "." in n}):
        moved = {f"{root}.{n}": a for n, a in given.items()}
        if 2 * len(set(moved) & names) > len(moved):
            return moved
    return dict(given)


def wanted(p: Plan, here: Metas) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The tensors a state dict in the layout holds for parameters of ``here``'s shapes and dtypes."""
    return {n: (there_shape(r, here[r.tensor][0]), here[r.tensor][1]) for r in p.rules for n in r.names}


def refuse_untied(p: Plan, given: Mapping[str, np.ndarray]) -> None:
    """A state dict whose names tie two tensors (one absent, or both equal) is refused for a model that
    holds them apart: training would then move them apart, unlike the model the file came from."""
    for there, other, fix in p.untied:
        if other not in given or (there in given and not np.array_equal(given[there], given[other])):
            continue
        why = f"it has no {there!r}" if there not in given else f"its {there!r} equals {other!r}"
        raise CheckpointError(
            f"the state dict ties {there!r} to {other!r} ({why}), but this model holds them apart; make it "
            f"tied: {fix} (or pass strict=False to load it untied)"
        )


def orientation_hint(
    p: Plan, want: Metas, given: Mapping[str, np.ndarray], others: Mapping[str, Plan]
) -> str:
    """Which other layout fits a 2-d tensor that came transposed (GPT-2's Conv1D in a nanoGPT load, or
    the reverse), else what the file's orientation is; '' when no tensor came transposed."""
    turned = [
        n
        for n, (shape, _) in want.items()
        if n in given and given[n].ndim == 2 and given[n].shape != shape and given[n].shape == shape[::-1]
    ]
    if not turned:
        return ""
    rule_of = {n: r for r in p.rules for n in r.names}

    def flips(q: Plan) -> bool:  # every turned tensor's orientation differs under q
        theirs = {r.tensor: r.transpose for r in q.rules}
        return all(
            theirs.get(rule_of[n].tensor, rule_of[n].transpose) != rule_of[n].transpose for n in turned
        )

    fits = [name for name, q in others.items() if flips(q)]
    shown = ", ".join(turned[:3])
    if fits:
        return f"{shown} came transposed: the file's 2-d weights are stored as layout={fits[0]!r} stores them; pass it"
    return f"{shown} came transposed from layout {p.layout!r}'s orientation ([out, in] for nn.Linear)"

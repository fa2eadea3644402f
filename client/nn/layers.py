"""Basic layers: Linear, Embedding, LayerNorm, activations, Dropout and the containers.

``Linear`` stores its weight as [in, out] so that the forward is one ``matmul(x, W)`` with no transpose,
and the Megatron layouts read directly off the weight: column-parallel = ``S(1)`` (each rank computes
some output features), row-parallel = ``S(0)`` (each rank holds some input features and produces a
partial sum ``P``). ``tp`` records which of the two a layer is meant for; ``sf.nn.parallel.megatron``
reads it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from sbpflow.client import functional as F
from sbpflow.client.nn.layouts import EVERY, Rules
from sbpflow.client.nn.module import Module
from sbpflow.client.nn.parameter import Parameter
from sbpflow.client.tensor import Tensor
from sbpflow.errors import SbpflowError
from sbpflow.random import Initializer, Normal, Ones, Zeros, xavier_uniform


def check_sizes(layer: str, **sizes: Any) -> None:
    """Each of a layer's sizes an integer >= 1 (numpy's too): a zero-width layer (``Linear(d, 0)``) holds
    no weights and computes nothing, so it is refused here, where the call that made it is still on the
    stack (the job's verification would refuse its empty tensors later, far from it)."""
    for name, value in sizes.items():
        try:
            ok = not isinstance(value, bool) and operator.index(value) >= 1
        except TypeError:
            ok = False
        if not ok:
            given = ", ".join(f"{k}={v!r}" for k, v in sizes.items())
            raise SbpflowError(
                f"{layer}({given}): {name} must be an integer >= 1; a layer of width 0 computes nothing"
            )


class Linear(Module):
    """y = x @ weight + bias, weight [in_features, out_features]; default init xavier-uniform, bias 0."""

    LAYOUTS = {EVERY: Rules(transpose=("weight",))}  # nn.Linear's weight is [out, in]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init: Initializer | None = None,
        tp: str | None = None,
    ) -> None:
        super().__init__()
        if tp not in (None, "column", "row"):
            raise SbpflowError(f"Linear tp={tp!r}: use 'column', 'row' or None")
        check_sizes("Linear", in_features=in_features, out_features=out_features)
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.weight = Parameter(
            (in_features, out_features), init or xavier_uniform(in_features, out_features)
        )
        if bias:
            self.bias = Parameter((out_features,), Zeros())
        else:
            self.bias = None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)  # [..., in] -> [..., out]

    def extra_repr(self) -> str:
        tp = f", tp={self.tp!r}" if self.tp else ""
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}{tp}"


class Embedding(Module):
    """Rows of weight [num_embeddings, dim] looked up by integer ids; default init N(0, 1) as PyTorch.

    ``padding_idx``: that id's row takes no gradient and reads as it holds (PyTorch's padding row:
    ``where(ids == padding_idx, detach(rows), rows)``); load zeros there, as PyTorch starts it.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init: Initializer | None = None,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        check_sizes("Embedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise SbpflowError(
                f"Embedding({num_embeddings}, {embedding_dim}, padding_idx={padding_idx}): the padding id "
                f"must be a row, in [-{num_embeddings}, {num_embeddings})"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.weight = Parameter((num_embeddings, embedding_dim), init or Normal(0.0, 1.0))

    def forward(self, ids: Tensor) -> Tensor:
        rows = F.embedding(ids, self.weight)  # [...] -> [..., dim]
        if self.padding_idx is None:
            return rows
        pad = (ids == self.padding_idx).reshape(*ids.shape, 1)  # [..., 1]
        return F.where(pad, F.detach(rows), rows)  # the padding row's value, without its gradient

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        check_sizes("LayerNorm", dim=dim)
        self.dim, self.eps = dim, eps
        self.weight = Parameter((dim,), Ones())
        self.bias = Parameter((dim,), Zeros())

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class GELU(Module):
    """``approximate="tanh"`` (the default: GPT-2's form) or ``"none"`` (exact, through erf)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.sigmoid(x)


class Flatten(Module):
    """Axes ``start_axis..end_axis`` merged into one, as torch.nn.Flatten (default: all but the batch)."""

    def __init__(self, start_axis: int = 1, end_axis: int = -1) -> None:
        super().__init__()
        self.start_axis, self.end_axis = start_axis, end_axis

    def forward(self, x: Tensor) -> Tensor:
        return F.flatten(x, self.start_axis, self.end_axis)


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


class Dropout(Module):
    def __init__(self, rate: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= rate < 1.0:
            raise SbpflowError(f"Dropout(rate={rate}): the rate must be in [0, 1)")
        self.rate = rate

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.rate, self.training)

    def extra_repr(self) -> str:
        return f"rate={self.rate}"


class ModuleList(Module):
    def __init__(self, modules: Iterable[Module] = ()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> ModuleList:
        setattr(self, str(len(self)), module)
        return self

    def __getitem__(self, i: int) -> Module:
        return list(self.children())[i]

    def __len__(self) -> int:
        return len(self.__dict__["_modules"])

    def __iter__(self) -> Iterator[Module]:
        return self.children()


class Sequential(ModuleList):
    """A ModuleList that is also a module: calls its children in order."""

    def __init__(self, *modules: Module) -> None:
        super().__init__(modules)

    def forward(self, x: Any) -> Any:
        for m in self.children():
            x = m(x)
        return x


_ACTIVATIONS: dict[str, type[Module]] = {"relu": ReLU, "gelu": GELU, "tanh": Tanh, "sigmoid": Sigmoid}


class MLP(Sequential):
    """Linear layers of ``sizes`` [in, hidden..., out] with ``activation`` between (none after the last)."""

    def __init__(self, sizes: Sequence[int], activation: str = "relu", bias: bool = True) -> None:
        if len(sizes) < 2:
            raise SbpflowError(f"MLP sizes {list(sizes)}: give at least [in, out]")
        if activation not in _ACTIVATIONS:
            raise SbpflowError(f"MLP activation {activation!r}: use one of {sorted(_ACTIVATIONS)}")
        layers: list[Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(Linear(n_in, n_out, bias=bias))
            if i < len(sizes) - 2:
                layers.append(_ACTIVATIONS[activation]())
        super().__init__(*layers)

"""Loads and stores that tell LLVM which arrays do not overlap, for numba loops over short rows.

numba passes each array as a bare data pointer, so LLVM must assume that a loop's stores to one array may
change what it loads from another. It still vectorises such a loop, behind a run-time test that the
arrays' ranges are disjoint, but it takes the vector path only where the loop runs long enough to repay
that test and its set-up: 56 iterations for max pooling's gradient, whose rows of 16 windows (a ResNet
block's [8, 16, 32, 32] pooled 2x2) therefore ran scalar, 150 us where PyTorch takes 50.

``load(a, i, stream)`` and ``store(a, i, value, stream)`` read and write ``a[i]`` of a 1-d C-contiguous
array, and tag the access with its ``stream``, a literal integer below ``STREAMS``: LLVM's scoped
no-alias metadata (``!alias.scope``, ``!noalias``) then says that no access of one stream touches memory
that an access of another stream does, so the loop needs no run-time test and runs vectorised from 8
iterations (pool_jit's 2x2 gradient: 150 -> 33 us).

That is a promise the caller makes, and LLVM believes it: tagging two views of one buffer with different
streams, where they overlap, gives wrong results, not an error. Use one stream for everything a loop
reads and one for each array (or each disjoint part of an array) it writes, and only where the writes go
to an array the kernel allocated. Indices are not checked and not wrapped (a negative index reads before
the array): the loop's own bounds must keep them in ``[0, a.size)``.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

STREAMS = 4


def _tag(builder: Any, access: Any, stream: int) -> None:
    """Mark ``access`` as in ``stream``'s scope and disjoint from every other stream's."""
    module = builder.module
    domain = module.add_metadata([ir.MetaDataString(module, "sbpflow.jit_streams")])
    scopes = [
        module.add_metadata([ir.MetaDataString(module, f"sbpflow.stream{s}"), domain]) for s in range(STREAMS)
    ]
    access.set_metadata("alias.scope", module.add_metadata([scopes[stream]]))
    access.set_metadata("noalias", module.add_metadata([scopes[s] for s in range(STREAMS) if s != stream]))


def _checked(a: Any, i: Any, stream: Any) -> int | None:
    """The stream of a well-typed call (a 1-d C-contiguous array, an integer index, a literal stream in
    range); None otherwise, so numba reports the call as untyped."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and isinstance(i, types.Integer)):
        return None
    if not isinstance(stream, types.IntegerLiteral) or not 0 <= stream.literal_value < STREAMS:
        return None
    return int(stream.literal_value)


def _address(context: Any, builder: Any, array_type: Any, array: Any, index_type: Any, index: Any) -> Any:
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(data, [context.cast(builder, index, index_type, types.intp)])


@intrinsic
def load(typingctx: Any, a: Any, i: Any, stream: Any) -> Any:
    """a[i], read in ``stream`` (see the module's docstring)."""
    tag = _checked(a, i, stream)
    if tag is None:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        value = builder.load(_address(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
        _tag(builder, value, tag)
        return value

    return a.dtype(a, i, stream), codegen


@intrinsic
def store(typingctx: Any, a: Any, i: Any, value: Any, stream: Any) -> Any:
    """a[i] = value (cast to a's dtype), written in ``stream`` (see the module's docstring)."""
    tag = _checked(a, i, stream)
    if tag is None or not a.mutable:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        cast = context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)
        access = builder.store(cast, _address(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
        _tag(builder, access, tag)
        return context.get_dummy_value()

    return types.none(a, i, value, stream), codegen

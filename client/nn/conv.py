"""Image layers on NCHW tensors: Conv2d, BatchNorm2d and the pools.

``Conv2d`` keeps torch's weight layout [out, in/groups, KH, KW], so its output-channel split is the
weight's ``S(0)`` (the output comes out ``S(1)``) and its input-channel split ``S(1)`` gives partial
sums. ``BatchNorm2d`` under data parallelism is synchronised by SBP alone (see ``F.batch_norm``), its
running statistics included.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sbpflow.client import functional as F
from sbpflow.client.nn.layouts import EVERY, Rules
from sbpflow.client.nn.module import Module
from sbpflow.client.nn.parameter import Parameter
from sbpflow.client.tensor import Tensor
from sbpflow.errors import SbpflowError
from sbpflow.random import Initializer, Ones, Uniform, Zeros, kaiming_uniform

Size = int | Sequence[int]


def _pair(v: Size) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


class Conv2d(Module):
    """y = conv2d(x, weight) + bias; default init as torch's (kaiming-uniform with a = sqrt(5))."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Size,
        stride: Size = 1,
        padding: Size = 0,
        dilation: Size = 1,
        groups: int = 1,
        bias: bool = True,
        init: Initializer | None = None,
    ) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise SbpflowError(
                f"Conv2d({in_channels}, {out_channels}, groups={groups}): both channel counts must divide by groups"
            )
        kh, kw = _pair(kernel_size)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride = (kh, kw), _pair(stride)
        self.padding, self.dilation = _pair(padding), _pair(dilation)
        fan_in = in_channels // groups * kh * kw
        self.weight = Parameter(
            (out_channels, in_channels // groups, kh, kw), init or kaiming_uniform(fan_in, gain=1 / 3**0.5)
        )
        bound = 1.0 / fan_in**0.5
        self.bias = Parameter((out_channels,), Uniform(-bound, bound)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        # x: [N, C, H, W] S(0) under DP -> [N, O, OH, OW] S(0)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, groups={self.groups}, bias={self.bias is not None}"
        )


class BatchNorm2d(Module):
    """Per-channel batch norm: batch statistics in training, ``running_mean``/``running_var`` in eval.

    Training moves the running statistics towards each batch's as PyTorch does: ``(1 - momentum) *
    running + momentum * batch``, the variance unbiased. They are parameters without a gradient, so a
    checkpoint keeps them and ``return_parameters`` returns them; under data parallelism they are updated
    from the batch statistics summed over the ranks (the compiler may keep them split over the channels,
    reduce-scattering the statistics instead of all-reducing them). ``track_running_stats=False`` keeps
    none (and normalises by the batch's statistics in eval mode too).
    """

    # PyTorch counts the batches seen (for momentum=None, which this module does not offer): exported as 0
    LAYOUTS = {EVERY: Rules(buffers={"num_batches_tracked": np.array(0, np.int64)})}

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise SbpflowError(f"BatchNorm2d({num_features}, momentum={momentum}): use a momentum in [0, 1]")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter((num_features,), Ones()) if affine else None
        self.bias = Parameter((num_features,), Zeros()) if affine else None
        self.track_running_stats = track_running_stats
        if track_running_stats:
            self.running_mean = Parameter((num_features,), Zeros(), requires_grad=False)
            self.running_var = Parameter((num_features,), Ones(), requires_grad=False)
        else:
            self.running_mean = self.running_var = None

    def forward(self, x: Tensor) -> Tensor:
        batch_stats = self.training or not self.track_running_stats
        return F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            batch_stats,
            self.momentum if self.training else 0.0,
            self.eps,
        )

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


class _Pool(Module):
    def __init__(self, kernel_size: Size, stride: Size | None = None, padding: Size = 0) -> None:
        super().__init__()
        self.kernel_size, self.padding = _pair(kernel_size), _pair(padding)
        self.stride = None if stride is None else _pair(stride)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxPool2d(_Pool):
    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)


class AvgPool2d(_Pool):
    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding)


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size: Size) -> None:
        super().__init__()
        self.output_size = _pair(output_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.adaptive_avg_pool2d(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"

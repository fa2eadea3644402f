"""ResNet (He et al. 2016) on NCHW images: the basic and bottleneck residual blocks and the network.

Under data parallelism every activation is ``S(0)`` (the batch) and every parameter ``B``; batch norm
is synchronised by SBP alone (``F.batch_norm``). ``ResNet(..., classes=D)`` ends in a D-wide linear layer,
which makes it a classifier or, for metric learning (InsightFace), an embedding network.
"""

from __future__ import annotations

from sbpflow.client import functional as F
from sbpflow.client.nn.conv import AdaptiveAvgPool2d, BatchNorm2d, Conv2d, MaxPool2d
from sbpflow.client.nn.layers import Linear, Sequential
from sbpflow.client.nn.layouts import EVERY, Rules
from sbpflow.client.nn.module import Module
from sbpflow.client.tensor import Tensor
from sbpflow.errors import SbpflowError

# blocks per stage, and whether a stage's block is the bottleneck (1x1, 3x3, 1x1 with 4x expansion)
DEPTHS = {18: ((2, 2, 2, 2), False), 34: ((3, 4, 6, 3), False), 50: ((3, 4, 6, 3), True)}


# torchvision names a block's projection shortcut `downsample`; every other name is the same
_BLOCK = {EVERY: Rules(names={"down": "downsample"})}


class BasicBlock(Module):
    expansion = 1
    LAYOUTS = _BLOCK

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = Conv2d(c_in, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = BatchNorm2d(width)
        self.conv2 = Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = BatchNorm2d(width)
        self.down = _shortcut(c_in, width, stride)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))  # y: [N, width, H/s, W/s]  S(0)
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class Bottleneck(Module):
    expansion = 4
    LAYOUTS = _BLOCK

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = Conv2d(c_in, width, 1, bias=False)
        self.bn1 = BatchNorm2d(width)
        self.conv2 = Conv2d(width, width, 3, stride=stride, padding=1, bias=False)  # stride here (v1.5)
        self.bn2 = BatchNorm2d(width)
        self.conv3 = Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = BatchNorm2d(width * 4)
        self.down = _shortcut(c_in, width * 4, stride)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


def _shortcut(c_in: int, c_out: int, stride: int) -> Module | None:
    """A 1x1 projection where the block changes the shape, else the identity (None)."""
    if stride == 1 and c_in == c_out:
        return None
    return Sequential(Conv2d(c_in, c_out, 1, stride=stride, bias=False), BatchNorm2d(c_out))


def _torchvision(model: ResNet) -> Rules:
    """torchvision's names: the stem conv1/bn1, and the blocks by stage (``layers.3`` is ``layer2.1``)."""
    blocks = [f"layer{s + 1}.{i}" for s, n in enumerate(DEPTHS[model.depth][0]) for i in range(n)]
    names = {"stem": "conv1", "stem_bn": "bn1", "layers": ""}
    return Rules(names={**names, **{f"layers.{k}": v for k, v in enumerate(blocks)}})


class ResNet(Module):
    """ResNet-``depth`` over ``channels``-channel images: torchvision's (a 7x7 stride-2 stem, then a 3x3
    stride-2 max pool), or with ``small_stem`` a 3x3 stride-1 stem for images of 32 pixels or fewer."""

    LAYOUTS = {"torchvision": _torchvision, "torch": _torchvision}

    def __init__(
        self, depth: int, classes: int = 1000, width: int = 64, channels: int = 3, small_stem: bool = False
    ) -> None:
        super().__init__()
        if depth not in DEPTHS:
            raise SbpflowError(f"ResNet depth {depth}: use one of {sorted(DEPTHS)}")
        self.depth = depth
        blocks, bottleneck = DEPTHS[depth]
        kernel, stride = (3, 1) if small_stem else (7, 2)
        self.stem = Conv2d(channels, width, kernel, stride=stride, padding=kernel // 2, bias=False)
        self.stem_bn = BatchNorm2d(width)
        self.pool = MaxPool2d(3, stride=2, padding=1)
        block = Bottleneck if bottleneck else BasicBlock
        layers: list[Module] = []
        c = width
        for stage, n in enumerate(blocks):
            w = width * 2**stage
            for i in range(n):
                layers.append(block(c, w, 2 if stage > 0 and i == 0 else 1))
                c = w * block.expansion
        self.layers = Sequential(*layers)
        self.head_pool = AdaptiveAvgPool2d(1)
        self.fc = Linear(c, classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.pool(F.relu(self.stem_bn(self.stem(images))))  # x: [N, width, H/2, W/2]  S(0)
        x = self.head_pool(self.layers(x))  # x: [N, C, 1, 1]  S(0)
        return self.fc(x.reshape(x.shape[0], x.shape[1]))  # logits: [N, classes]  S(0)


def resnet18(classes: int = 1000, width: int = 64, channels: int = 3, small_stem: bool = False) -> ResNet:
    """torchvision's ``resnet18`` (``width`` 64: its channels); ``small_stem`` for small images."""
    return ResNet(18, classes, width, channels, small_stem)


def resnet50(classes: int = 1000, width: int = 64, channels: int = 3, small_stem: bool = False) -> ResNet:
    """torchvision's ``resnet50`` (v1.5: the stride in each bottleneck's 3x3 convolution)."""
    return ResNet(50, classes, width, channels, small_stem)

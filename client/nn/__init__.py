"""``sf.nn``: modules, parameters, layers, the GPT, BERT and ResNet models, ``functional`` and the
``parallel`` layout helpers."""

from sbpflow.client import functional
from sbpflow.client.nn import parallel
from sbpflow.client.nn.bert import BERT, BertConfig, BertForMaskedLM
from sbpflow.client.nn.conv import AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Conv2d, MaxPool2d
from sbpflow.client.nn.layers import (
    GELU,
    MLP,
    Dropout,
    Embedding,
    Flatten,
    LayerNorm,
    Linear,
    ModuleList,
    ReLU,
    Sequential,
    Sigmoid,
    Tanh,
)
from sbpflow.client.nn.module import Module
from sbpflow.client.nn.parameter import Parameter
from sbpflow.client.nn.resnet import ResNet, resnet18, resnet50
from sbpflow.client.nn.transformer import GPT, Block, CausalSelfAttention, FeedForward, GPTConfig

__all__ = [
    "BERT",
    "BertConfig",
    "BertForMaskedLM",
    "ResNet",
    "resnet18",
    "resnet50",
    "AdaptiveAvgPool2d",
    "AvgPool2d",
    "BatchNorm2d",
    "Conv2d",
    "MaxPool2d",
    "GELU",
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Dropout",
    "Embedding",
    "FeedForward",
    "Flatten",
    "GPTConfig",
    "LayerNorm",
    "Linear",
    "Module",
    "ModuleList",
    "Parameter",
    "ReLU",
    "Sequential",
    "Sigmoid",
    "Tanh",
    "functional",
    "parallel",
]

"""sf.nn's BERT and ResNet against PyTorch's (random init, float64): transformers' BertForMaskedLM with a
padding mask, and a plain-torch ResNet-18 with torchvision's module names and structure (torchvision
itself cannot be imported beside this torch). Each loads the other's state dict through its layout and
gives the same logits, and the same loss and gradients after one step. Skipped without torch /
transformers (the bench extra)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.data.sources import ArraySource

torch = pytest.importorskip("torch", reason="torch comes with the bench extra: pip install -e '.[bench]'")


class Outputs(sf.Graph):
    def __init__(self, model: sf.nn.Module, call: str) -> None:
        super().__init__()
        self.model, self.call = model, call

    def build(self, *inputs: sf.Tensor) -> sf.Tensor:
        return getattr(self.model, self.call)(*inputs)


class Step(sf.Graph):
    def __init__(self, model: sf.nn.Module, loss: Any) -> None:
        super().__init__()
        self.model, self.loss = model, loss
        self.add_optimizer(sf.optim.SGD(model.parameters(), lr=0.1))

    def build(self, *inputs: sf.Tensor) -> sf.Tensor:
        loss = self.loss(self.model, *inputs)
        loss.backward()
        return loss


def run_outputs(model: sf.nn.Module, call: str, **arrays: np.ndarray) -> np.ndarray:
    job = Outputs(model, call).trace(ArraySource(batch_size=len(next(iter(arrays.values()))), arrays=arrays))
    return np.asarray(next(iter(sf.run(job, backend="inprocess").outputs.values()))[0])


def one_step(model: sf.nn.Module, loss: Any, **arrays: np.ndarray) -> float:
    """The first loss of one SGD step; the trained values are written back into ``model``."""
    source = ArraySource(batch_size=len(next(iter(arrays.values()))), arrays=arrays)
    return sf.run(Step(model, loss).trace(source, steps=1), backend="inprocess").losses[0]


def torch_step(model: Any, loss: Any) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    value = loss()
    value.backward()
    opt.step()
    return float(value.detach())


def assert_same_state(ours: sf.nn.Module, theirs: Any, layout: str) -> None:
    want = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    got = ours.state_dict(layout=layout)
    for k, v in want.items():
        if v.dtype != np.int64:  # num_batches_tracked: not counted here
            np.testing.assert_allclose(got[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


# ---- BERT ------------------------------------------------------------------------------------------------


def test_bert_gives_transformers_logits_loss_and_step_with_a_padding_mask() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers comes with the bench extra")
    cfg = dict(
        vocab_size=48, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24
    )
    hf_cfg = transformers.BertConfig(
        **cfg,
        max_position_embeddings=12,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    theirs = transformers.BertForMaskedLM(hf_cfg).double()
    ours = sf.nn.BertForMaskedLM(
        sf.nn.BertConfig(
            vocab_size=48,
            seq_len=12,
            n_layer=2,
            n_head=2,
            n_embd=16,
            intermediate_size=24,
            dropout=0.0,
            pad_token_id=0,
        )
    ).to(sf.float64)
    ours.load_state_dict(theirs.state_dict(), layout="hf-bert")
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 48, size=(3, 10))
    mask = np.ones_like(tokens)
    tokens[1, 7:], mask[1, 7:] = 0, 0  # the second sequence padded after 7 tokens
    types = np.zeros_like(tokens)
    with torch.no_grad():
        want = theirs(
            torch.from_numpy(tokens),
            attention_mask=torch.from_numpy(mask),
            token_type_ids=torch.from_numpy(types),
        ).logits.numpy()
    got = run_outputs(ours, "logits", tokens=tokens, token_types=types, attention_mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)
    # one step of the masked-LM loss at 2 positions a sequence (Hugging Face: -100 elsewhere)
    positions = np.array([[1, 4], [2, 6], [0, 9]])
    labels = rng.integers(1, 48, size=(3, 2))
    hf_labels = np.full_like(tokens, -100)
    np.put_along_axis(hf_labels, positions, labels, axis=1)
    args = {
        k: torch.from_numpy(v)
        for k, v in dict(
            input_ids=tokens, attention_mask=mask, token_type_ids=types, labels=hf_labels
        ).items()
    }
    want_loss = torch_step(theirs, lambda: theirs(**args).loss)
    got_loss = one_step(
        ours,
        lambda m, t, ty, p, lab, am: m(t, ty, p, lab, am),
        tokens=tokens,
        token_types=types,
        positions=positions,
        labels=labels,
        attention_mask=mask,
    )
    assert abs(got_loss - want_loss) <= 1e-10 * abs(want_loss)
    assert_same_state(ours, theirs, "hf-bert")


# ---- ResNet ----------------------------------------------------------------------------------------------


def torchvision_resnet18(classes: int, width: int) -> Any:
    """torchvision.models.resnet18's structure and names (BasicBlock, layer1..4, downsample), in torch."""
    nn: Any = torch.nn

    class BasicBlock(nn.Module):
        def __init__(self, c_in: int, c: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c, 3, stride, 1, bias=False)
            self.bn1, self.relu = nn.BatchNorm2d(c), nn.ReLU(inplace=True)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
            self.downsample = None
            if stride != 1 or c_in != c:
                self.downsample = nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), nn.BatchNorm2d(c))

        def forward(self, x: Any) -> Any:
            y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            return self.relu(y + (x if self.downsample is None else self.downsample(x)))

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
            self.bn1, self.relu, self.maxpool = (
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1),
            )
            c = width
            for s in range(4):
                w = width * 2**s
                setattr(
                    self,
                    f"layer{s + 1}",
                    nn.Sequential(BasicBlock(c, w, 1 if s == 0 else 2), BasicBlock(w, w, 1)),
                )
                c = w
            self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(c, classes)

        def forward(self, x: Any) -> Any:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            for s in range(4):
                x = getattr(self, f"layer{s + 1}")(x)
            return self.fc(torch.flatten(self.avgpool(x), 1))

    torch.manual_seed(0)
    model = ResNet().double()
    with torch.no_grad():  # BN's affine and running values away from 1 and 0, to be seen
        for name, b in model.named_buffers():
            if "running" in name:
                b.uniform_(0.5, 1.5)
    return model


def test_resnet18_gives_torchvisions_logits_and_step() -> None:
    theirs = torchvision_resnet18(classes=5, width=4)
    ours = sf.nn.resnet18(classes=5, width=4).to(sf.float64)
    ours.load_state_dict(theirs.state_dict(), layout="torchvision")
    # batch 3: at 16x16 layer3 and layer4 are 1x1, and a batch norm of 2 values a channel gives +-1 whatever
    # they are, so its gradient is rounding residue (~1e-10 relative, in torch as in sbpflow)
    images = np.random.default_rng(1).normal(size=(3, 3, 16, 16))
    labels = np.array([1, 3, 0])
    theirs.eval()
    with torch.no_grad():
        want = theirs(torch.from_numpy(images)).numpy()
    ours.eval()
    np.testing.assert_allclose(run_outputs(ours, "forward", images=images), want, rtol=1e-9, atol=1e-11)
    theirs.train()
    ours.train()
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    want_loss = torch_step(theirs, lambda: torch.nn.functional.cross_entropy(theirs(x), y))
    got_loss = one_step(
        ours, lambda m, im, lab: sf.nn.functional.cross_entropy(m(im), lab), images=images, labels=labels
    )
    assert abs(got_loss - want_loss) <= 1e-10 * abs(want_loss)
    assert_same_state(ours, theirs, "torchvision")  # the step's weights and running statistics

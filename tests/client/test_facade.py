"""The public facade: ``import sbpflow as sf`` and the OneFlow/PyTorch-style import paths."""

from __future__ import annotations

import subprocess
import sys


def test_facade_prints_and_stays_light() -> None:
    code = (
        "import sys, sbpflow as sf; print(sf.sbp.split(0), sf.placement('cpu', ranks=[0, 1])); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'grpc', 'google')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["S(0) placement(type='cpu', ranks=[0, 1])", "[]"]


def test_public_names() -> None:
    import sbpflow as sf
    import sbpflow.nn.functional as F
    from sbpflow.optim import AdamW

    assert F is sf.nn.functional and AdamW is sf.optim.AdamW
    assert sf.sbp.S(1) == sf.sbp.split(1) and repr(sf.sbp.B) == "B" and repr(sf.sbp.partial_sum) == "P"
    assert sf.float32.itemsize == 4 and sf.int64.value == "int64"
    assert sf.data.SyntheticSource and sf.Job and sf.Graph and sf.nn.GPT and sf.nn.parallel.megatron
    assert sf.optim.lr_scheduler.WarmupCosine(1, 10).factor(0) == 1.0

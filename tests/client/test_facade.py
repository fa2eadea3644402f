"""The public facade: ``import sbpflow as sf`` and the OneFlow/PyTorch-style import paths."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_layers import module_name


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


ROOT = Path(__file__).resolve().parents[2]
ABOVE = ("sbpflow.client", "sbpflow.control_plane", "sbpflow.actor_workers")


def core_modules() -> list[str]:
    """Every module of the core (``sbpflow/``), by its dotted name, the generated protobuf code included."""
    return [module_name(path) for path in sorted((ROOT / "sbpflow").rglob("*.py"))]


def loaded_above(code: str) -> list[str]:
    probe = code + f"\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith({ABOVE!r})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_importing_any_core_module_loads_no_module_of_the_layers_above() -> None:
    """A worker importing ``sbpflow.sharding`` runs the facade first; the facade loads its names on first
    use, so no core import reaches the client, the control plane or the actor workers."""
    modules = core_modules()
    assert "sbpflow.sharding" in modules and "sbpflow.data.sources" in modules and len(modules) > 40
    assert loaded_above("import sbpflow.sharding") == []
    assert loaded_above(f"import importlib\nfor m in {modules!r}: importlib.import_module(m)") == []
    assert (
        loaded_above("import sbpflow as sf\nsf.placement('cpu', ranks=[0]); sf.sbp.split(0); sf.data") == []
    )


def test_a_facade_name_loads_its_layer_on_first_use() -> None:
    assert "sbpflow.client.nn" in loaded_above("import sbpflow as sf\nsf.nn.Linear")
    assert "sbpflow.control_plane.launch.launcher" in loaded_above("import sbpflow as sf\nsf.run")


def test_placement_stays_the_function_when_its_module_is_imported() -> None:
    code = (
        "import sbpflow.sharding, sbpflow.placement, sbpflow as sf\nprint(sf.placement('cpu', ranks=[0, 1]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "placement(type='cpu', ranks=[0, 1])"


def test_every_name_of_the_facade_resolves_and_star_imports_the_light_ones() -> None:
    import sbpflow as sf

    lazy = set(sf._NAMES)
    assert set(sf.__all__) == (lazy - {"Client", "run", "RunRequest", "RunCancelled"}) | {
        "Placement",
        "placement",
    }
    assert all(getattr(sf, name) is not None for name in lazy)
    assert sf.bool_ is sf.DType.bool and sf.corpus.VOCAB == 128 and sf.RunCancelled.__name__ == "RunCancelled"
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        sf.nope  # noqa: B018


def test_the_import_aliases_are_the_client_modules_with_their_own_specs() -> None:
    import sbpflow.client.functional
    import sbpflow.client.optim
    import sbpflow.nn.functional as F
    import sbpflow.nn.parallel as parallel
    import sbpflow.optim as optim

    assert F is sbpflow.client.functional and optim is sbpflow.client.optim
    assert parallel.__spec__ is not None and parallel.__spec__.name == "sbpflow.client.nn.parallel"
    assert F.__spec__ is not None and F.__spec__.name == "sbpflow.client.functional"

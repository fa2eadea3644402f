"""The committed code in sbpflow/v1/ is exactly what protos/generate.py makes from the .proto files."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    importlib.util.find_spec("grpc_tools") is None,
    reason="grpc_tools is not importable; install the dev extra (pip install -e '.[dev]') to check the protos",
)
def test_generated_code_matches_protos() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (
        "generated protobuf code is out of date with protos/sbpflow/v1/*.proto; "
        "run `python protos/generate.py` and commit the result\n" + result.stdout + result.stderr
    )

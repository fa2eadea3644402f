"""Regenerate the committed protobuf and gRPC code in sbpflow/v1/ from protos/sbpflow/v1/*.proto.

    python protos/generate.py           # rewrite sbpflow/v1/*_pb2*.py[i] (and drop stale ones)
    python protos/generate.py --check   # exit 1, listing what differs, if regeneration would change anything

Runs, from the repository root, the equivalent of

    python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --mypy_out=. \\
        --mypy_grpc_out=. protos/sbpflow/v1/*.proto

but always into a temporary directory first, so both modes share one code path and a failed protoc run
leaves the tree untouched. The output depends only on the .proto files and the pinned grpcio-tools and
mypy-protobuf versions (pyproject.toml, extra "dev"): inputs are sorted, and nothing host-specific
(paths, times) ends up in the generated files.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = Path("sbpflow") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
PLUGINS = ("protoc-gen-mypy", "protoc-gen-mypy_grpc")
DIFF_LINES = 40  # per file in --check output; enough to see what changed, short enough for CI logs


def proto_files() -> list[Path]:
    """The .proto inputs, relative to PROTO_ROOT, sorted so that protoc sees them in a fixed order."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))


def is_generated(name: str) -> bool:
    return name.endswith(GENERATED_SUFFIXES)


def find_plugin(name: str) -> str:
    """mypy-protobuf's plugins live next to this interpreter in a venv that is not on PATH."""
    found = shutil.which(
        name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if found is None:
        raise SystemExit(
            f"generate.py: protoc plugin {name!r} not found next to {sys.executable} or on PATH; "
            "install the pinned dev tools: pip install -e '.[dev]'"
        )
    return found


def run_protoc(out: Path) -> None:
    """Generate every output into ``out`` (which mirrors the repository root)."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        raise SystemExit(
            "generate.py: grpc_tools is not importable; install the pinned dev tools: pip install -e '.[dev]'"
        ) from None
    protos = proto_files()
    if not protos:
        raise SystemExit(f"generate.py: no .proto files under {PROTO_ROOT / PACKAGE}")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",  # adds the well-known types (google/protobuf/*.proto) to the include path
        f"-I{PROTO_ROOT.relative_to(ROOT)}",
        *(f"--plugin={name}={find_plugin(name)}" for name in PLUGINS),
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *(str(PROTO_ROOT.relative_to(ROOT) / p) for p in protos),
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"generate.py: protoc failed ({result.returncode}):\n{result.stderr}{result.stdout}")


def listing(directory: Path) -> dict[str, Path]:
    """Generated files in ``directory`` by name."""
    if not directory.is_dir():
        return {}
    return {p.name: p for p in sorted(directory.iterdir()) if p.is_file() and is_generated(p.name)}


def compare(fresh: dict[str, Path], committed: dict[str, Path]) -> list[str]:
    """One report block per file that is missing, extra or different; empty when all match."""
    problems: list[str] = []
    for name in sorted(fresh.keys() | committed.keys()):
        rel = PACKAGE / name
        if name not in committed:
            problems.append(f"missing: {rel} (regeneration creates it)")
        elif name not in fresh:
            problems.append(f"extra: {rel} (no .proto generates it any more)")
        else:
            old, new = committed[name].read_text(), fresh[name].read_text()
            if old != new:
                diff = list(
                    difflib.unified_diff(
                        old.splitlines(),
                        new.splitlines(),
                        f"committed/{rel}",
                        f"generated/{rel}",
                        lineterm="",
                    )
                )
                shown = "\n".join("    " + line for line in diff[:DIFF_LINES])
                more = f"\n    ... {len(diff) - DIFF_LINES} more diff lines" if len(diff) > DIFF_LINES else ""
                problems.append(f"differs: {rel}\n{shown}{more}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 listing every file that would change"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sbpflow-protos-") as tmp:
        run_protoc(Path(tmp))
        fresh = listing(Path(tmp) / PACKAGE)
        committed = listing(ROOT / PACKAGE)
        problems = compare(fresh, committed)
        if args.check:
            if problems:
                print(f"{len(problems)} generated file(s) out of date; run: python protos/generate.py")
                print("\n".join(problems))
                return 1
            print(f"{len(fresh)} generated files up to date")
            return 0
        for name, path in fresh.items():
            if name not in committed or committed[name].read_text() != path.read_text():
                shutil.copyfile(path, ROOT / PACKAGE / name)
                print(f"wrote {PACKAGE / name}")
        for name in sorted(committed.keys() - fresh.keys()):
            (ROOT / PACKAGE / name).unlink()
            print(f"removed {PACKAGE / name}")
        print(f"{len(fresh)} generated files, {len(problems)} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long `sbpflow run` takes from the command to its exit (issue 32 item 2): the MLP example for 3
steps (target <= 5 s) and the README's main job (charlm, 150 steps; target <= 15 s on a warm machine),
each on the local Ray an earlier run kept (the default), on a fresh local Ray of the run's own
(``--fresh-ray``) and on the in-process backend; beside them the floors every Python training command pays: ``import sbpflow``'s CLI,
and a plain PyTorch script training the same MLP shape for 3 steps (the peer a user would compare
against).

    python bench/control_plane/startup.py            # 3 repetitions, the main job included
    python bench/control_plane/startup.py --quick    # 1 repetition, the MLP only

Every case is a child process timed from spawn to exit, the cases alternated within a repetition (who
goes first rotates) so that load drifts hit each alike; medians are printed. The kept Ray is this script's
own (``SBPFLOW_RAY_DIR`` a temporary folder), started by an untimed first run and stopped at the end
(that Ray alone: ``KeptRay.stop``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sbpflow.control_plane.launch.ray_cluster import KeptRay

ROOT = Path(__file__).resolve().parents[2]
SBPFLOW = [str(Path(sys.executable).parent / "sbpflow")]  # the installed command, as a user runs it
KEPT = Path(tempfile.mkdtemp(prefix="sfbench-"))  # this script's kept Ray (short: Ray's socket paths)

TORCH_MLP = """
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(m.parameters(), lr=0.05)
x, y = torch.randn(32, 16), torch.randn(32, 4)
for _ in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()
print(float(loss))
"""


def cases(quick: bool) -> dict[str, list[str]]:
    mlp = [*SBPFLOW, "run", "examples/mlp.py", "--steps", "3"]
    main = [*SBPFLOW, "run", "examples/charlm.py"]
    out = {
        "import sbpflow's CLI": [sys.executable, "-c", "import sbpflow.client.cli.main"],
        "torch MLP, 3 steps (peer)": [sys.executable, "-c", TORCH_MLP],
        "mlp, kept Ray (default)": mlp,
        "mlp, fresh Ray (--fresh-ray)": [*mlp, "--fresh-ray"],
        "mlp, in-process": [*mlp, "--backend", "inprocess"],
    }
    if not quick:
        out |= {
            "main job, kept Ray (default)": main,
            "main job, fresh Ray (--fresh-ray)": [*main, "--fresh-ray"],
            "main job, in-process": [*main, "--backend", "inprocess"],
        }
    return out


def timed(argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env |= {"SBPFLOW_RAY_DIR": str(KEPT), "SBPFLOW_LOCAL_RAY": "kept"}
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"{' '.join(argv[1:])} exited {done.returncode}:\n" + "\n".join(tail))
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    repeat = 1 if args.quick else args.repeat
    todo = cases(args.quick)
    times: dict[str, list[float]] = {name: [] for name in todo}
    print(f"load {os.getloadavg()[0]:.1f}; {repeat} repetition(s)")
    try:
        timed(todo["mlp, kept Ray (default)"])  # the first run starts the kept Ray: not timed
        names = list(todo)
        for i in range(repeat):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                times[name].append(timed(todo[name]))
    finally:
        KeptRay(KEPT).stop()
        shutil.rmtree(KEPT, ignore_errors=True)
    peer = statistics.median(times["torch MLP, 3 steps (peer)"])
    targets = {"mlp": 5.0, "main job": 15.0}
    for name, ts in times.items():
        med = statistics.median(ts)
        target = next((t for k, t in targets.items() if name.startswith(k)), None)
        verdict = (
            "" if target is None else f"  target <= {target:.0f} s: {'met' if med <= target else 'not met'}"
        )
        print(
            f"{name:34s} {med:6.2f} s (x{med / peer:5.2f} the torch peer; runs {', '.join(f'{t:.2f}' for t in ts)}){verdict}"
        )
    print(f"load {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

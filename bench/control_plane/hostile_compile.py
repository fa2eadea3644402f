"""Hostile compiles against a control plane (issue 29): jobs small on the wire whose plans are huge.

    python bench/control_plane/hostile_compile.py          # both probes and the cancel case (~1 min)
    python bench/control_plane/hostile_compile.py --quick  # the MLP probe and the cancel case

A control plane (in-process backend, 2 slots) runs in a child process under a 4 GB address-space cap;
this process is its client. It submits issue 29's probes — GPT 8 layers on 2 pipeline stages x 4,096
micro-batches (a 69 KB job), and the MLP on 2 stages x 32,768 micro-batches x accumulation 2 (a 2.5 KB
job), which before the plan-size limits were accepted and grew the server to 6 GB and 3 GB while
COMPILING — and then a job under every limit whose lowering takes ~20 s (GPT 2 layers, 2 stages x 512
micro-batches), cancelled 1 s into COMPILING. It reports each Submit's latency and answer, the time from
Cancel to CANCELLED, and the server's resident memory (``/proc/PID/status``: VmRSS now, VmHWM its peak)
idle and after each case. The peer is the idle server itself.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench._shared import load_example  # noqa: E402

CAP = 4 << 30  # the server's address space: a runaway compile fails there, not on this machine
SERVER = f"""
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({CAP}, {CAP}))
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.runs.options import MANAGER_DEFAULTS
plane = ControlPlane(ServerConfig(store=sys.argv[1], run=MANAGER_DEFAULTS.replace(backend="inprocess"),
                                  slots=2, http_port=None)).start()
print(plane.address, flush=True)
while True:
    time.sleep(60)
"""
PROBES = {
    "gpt 8 layers, 2 stages x 4,096 micro-batches": (
        "gpt",
        {"layers": 8, "ranks": 2, "pp": 2, "micro_batches": 4096, "batch_size": 4096},
    ),
    "mlp, 2 stages x 32,768 micro-batches x 2": (
        "mlp",
        {"ranks": 2, "pp": 2, "layers": 2, "batch_size": 131_072, "micro_batches": 32_768, "grad_accum": 2},
    ),
}
SLOW = {"layers": 2, "ranks": 2, "pp": 2, "micro_batches": 512, "batch_size": 512, "steps": 1}


def memory(pid: int) -> str:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    mb = {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}
    return f"RSS {mb['VmRSS']:.0f} MB, peak {mb['VmHWM']:.0f} MB"


def probe(client: Any, pid: int, name: str, example: str, kwargs: dict[str, int]) -> None:
    job = load_example(example).make_job(**kwargs)
    t = time.perf_counter()
    try:
        h = client.submit(job)
        answer = f"ACCEPTED as {h.job_id}"
    except Exception as e:  # the refusal this measures: its status code and message
        answer = f"refused: {str(e).splitlines()[0][:220]}"
    print(f"{name}: Submit {time.perf_counter() - t:.2f} s, {answer}; server {memory(pid)}", flush=True)


def cancel_while_compiling(client: Any, pid: int) -> None:
    from sbpflow.v1 import service_pb2 as sp

    h = client.submit(load_example("gpt").make_job(**SLOW))
    while sp.JobState.Name(h.status().state) != "JOB_STATE_COMPILING":
        time.sleep(0.02)
    time.sleep(1.0)
    t = time.perf_counter()
    h.cancel("bench")
    st = h.wait(timeout=120)
    print(
        f"cancel 1 s into COMPILING (gpt 2 layers, 2 stages x 512 micro-batches): "
        f"{sp.JobState.Name(st.state)} {st.reason} after {time.perf_counter() - t:.2f} s; server {memory(pid)}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the MLP probe and the cancel case only")
    args = ap.parse_args()
    from sbpflow.client.client import Client

    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(Path(tmp) / "jobs.db")],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        try:
            assert server.stdout is not None
            address = server.stdout.readline().strip()
            time.sleep(1.0)
            print(f"idle server (pid {server.pid}, address-space cap {CAP >> 30} GB): {memory(server.pid)}")
            with Client(address) as client:
                for name, (example, kwargs) in PROBES.items():
                    if not args.quick or example == "mlp":
                        probe(client, server.pid, name, example, kwargs)
                cancel_while_compiling(client, server.pid)
        finally:
            server.terminate()
            server.wait(10)


if __name__ == "__main__":
    main()

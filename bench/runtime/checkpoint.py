"""Checkpoints (issue 8): write and read throughput per worker against numpy.save / numpy.load of the same
bytes on the same disk (target >= 0.8x), and the time from a worker's death to training again on Ray.

    python bench/runtime/checkpoint.py          # 256 MB a rank, 5 repetitions; the restart on a local Ray
    python bench/runtime/checkpoint.py --quick  # 32 MB, 3 repetitions, no Ray
    python bench/runtime/checkpoint.py --mb 512 --repeat 7 --no-ray

Write: one rank's shards (8 float32 tensors, a rank of an S(0) layout) through
``sbpflow.checkpoint.write.write_rank`` (safetensors bytes, temp name, fsync, rename, directory fsync); the peer
is ``numpy.save`` of the same 8 arrays into one file, followed by one fsync (the same durability; without
the fsync numpy.save would only measure the page cache). Read: a rank of a *different* layout (the 2-way
split of what 4 ranks wrote: it reads from two ranks' files) reads its slices through
``CheckpointReader.read``; the peer is ``numpy.load`` of the numpy.save file. Reads come from the page
cache (the files were just written; dropping it needs root): both sides alike. Measured alternately (who
goes first alternates too), medians compared.

Restart: a 20-step DP 4 job on 4 local Ray workers, checkpoints every 5; rank 2 is SIGKILLed at step 7;
the time from the kill to the first step the restarted attempt reports, split at the moment the
scheduler saw the failure (the restart itself: new placement group, workers, connections, reading the
checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sbpflow.checkpoint import write as ck  # noqa: E402
from sbpflow.checkpoint.read import CheckpointReader  # noqa: E402
from sbpflow.placement import placement  # noqa: E402
from sbpflow.runs.states import JobState  # noqa: E402
from sbpflow.sbp import S  # noqa: E402
from sbpflow.sharding import shard_index  # noqa: E402

TENSORS = 8


def rank_shards(mb: int, rank: int, world: int) -> list[ck.Shard]:
    """One rank's S(0) shards of TENSORS float32 tensors of ``world * mb / TENSORS`` MB each."""
    rows = mb * 1024 * 1024 // 4 // TENSORS // 1024
    where, sbp = placement("cpu", list(range(world))), (S(0),)
    rng = np.random.default_rng(rank)
    out = []
    for i in range(TENSORS):
        shape = (rows * world, 1024)
        local = rng.standard_normal((rows, 1024), dtype=np.float32)
        out.append(ck.shard_of(f"t{i}", "parameter", local, where, sbp, rank, shape))
    return out


def np_save(path: Path, shards: list[ck.Shard]) -> None:
    with open(path, "wb") as f:
        for s in shards:
            np.save(f, s.value)
        f.flush()
        os.fsync(f.fileno())


def np_load(path: Path) -> list[np.ndarray]:
    with open(path, "rb") as f:
        return [np.load(f) for _ in range(TENSORS)]


def throughput(mb: int, repeat: int, where: Path) -> None:
    world = 4
    shards = {r: rank_shards(mb, r, world) for r in range(world)}
    nbytes = sum(s.value.nbytes for s in shards[0])
    for r in range(1, world):  # the other ranks' files, written once: the reader needs them
        ck.write_rank(where, 1, r, "bench", shards[r])
    ours_w, peer_w, ours_r, peer_r = [], [], [], []
    new = placement("cpu", [0, 1])
    for i in range(repeat):
        timed = {
            "ours": lambda: ck.write_rank(where, 1, 0, "bench", shards[0]),
            "peer": lambda: np_save(where / "peer.npy", shards[0]),
        }
        took = {}
        for side in sorted(timed, reverse=bool(i % 2)):  # alternate who goes first
            t0 = time.perf_counter()
            timed[side]()
            took[side] = time.perf_counter() - t0
        ours_w.append(took["ours"])
        peer_w.append(took["peer"])
        ck.try_complete(where, 1, "bench", list(range(world)), "bench", 0)
        reader = CheckpointReader(where)
        t0 = time.perf_counter()
        got = 0
        for i in range(TENSORS):  # rank 0 of 2: the slices ranks 0 and 1 of 4 wrote
            shape = reader.manifest.tensor(f"t{i}").shape
            got += reader.read(f"t{i}", shard_index(shape, new.shape, (S(0),), (0,))).nbytes
        t1 = time.perf_counter()
        peer = np_load(where / "peer.npy")
        t2 = time.perf_counter()
        assert got == 2 * nbytes and sum(a.nbytes for a in peer) == nbytes
        ours_r.append((t1 - t0) / 2)  # per the same bytes as the peer's
        peer_r.append(t2 - t1)
    mbs = nbytes / 1e6
    for what, ours, peer in (("write", ours_w, peer_w), ("read", ours_r, peer_r)):
        o, p = statistics.median(ours), statistics.median(peer)
        print(
            f"{what:5s} {mbs:7.1f} MB/rank   sbpflow {mbs / o:8.1f} MB/s   numpy {mbs / p:8.1f} MB/s   "
            f"ratio {p / o:5.2f}x (target >= 0.8)   runs: "
            + " ".join(f"{b / a:.2f}" for a, b in zip(ours, peer, strict=True))
        )


def restart() -> None:
    import ray

    import sbpflow as sf
    from tests.actor_workers.test_snapshots import ray_job

    marks: dict[str, float] = {}

    def listen(r: Any) -> None:
        if r.WhichOneof("payload") != "step":
            return
        if r.attempt == 1 and r.step.step == 7 and "kill" not in marks:
            info = ray.get(ray.get_actor("sbpflow-bench-restart-a1-r2").info.remote())
            marks["kill"] = time.monotonic()
            os.kill(info["pid"], signal.SIGKILL)
        if r.attempt == 2 and "step" not in marks:
            marks["step"], marks["first"] = time.monotonic(), r.step.step

    def state(name: JobState) -> None:
        if "kill" in marks and name == JobState.STARTING and "restart" not in marks:
            marks["restart"] = time.monotonic()

    with tempfile.TemporaryDirectory() as d:
        job = ray_job(checkpoint_every=5)
        job = dataclasses.replace(job, config=dataclasses.replace(job.config, checkpoint_every=5))
        result = sf.run(
            job,
            backend="ray",
            job_id="bench-restart",
            on_report=listen,
            on_state=state,
            checkpoint_dir=d,
            max_restarts=1,
            timeout=300,
        )
    assert result.attempts == 2
    print(
        f"restart: worker killed at step 7 -> attempt 2's first step (step {marks['first']:.0f}) in "
        f"{marks['step'] - marks['kill']:.2f} s (failure seen and new attempt starting after "
        f"{marks['restart'] - marks['kill']:.2f} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mb", type=int, default=256, help="bytes a rank writes, in MB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    ap.add_argument("--no-ray", action="store_true")
    a = ap.parse_args()
    mb, repeat = (32, 3) if a.quick else (a.mb, a.repeat)
    where = Path(tempfile.mkdtemp(prefix="sbpflow-ckbench-", dir=a.dir))
    try:
        throughput(mb, repeat, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if not (a.quick or a.no_ray):
        restart()


if __name__ == "__main__":
    main()

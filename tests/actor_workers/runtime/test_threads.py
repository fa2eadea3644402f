"""Thread discipline: a Ray worker's BLAS on its slots, the in-process switch scoped to the run."""

from __future__ import annotations

import pytest

from sbpflow.actor_workers.runtime import threads
from sbpflow.runs.options import RunOptions, RunOptionsError


def test_a_worker_runs_one_thread_per_cpu_it_holds_and_at_least_one() -> None:
    assert [threads.slot_threads(c) for c in (None, 0.0, 0.5, 1.0, 2.0)] == [1, 1, 1, 1, 2]


def test_the_in_process_switch_holds_within_the_run_only() -> None:
    before = threads.blas_threads()
    with threads.limited(1):
        assert threads.blas_threads() == 1
    assert threads.blas_threads() == before
    with threads.limited(0):  # 0: as they are
        assert threads.blas_threads() == before


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_threads_is_a_whole_number_or_zero(bad: object) -> None:
    with pytest.raises(RunOptionsError, match="threads"):
        RunOptions(threads=bad)  # type: ignore[arg-type]


def _blas_threads(worker: object) -> int | None:
    return threads.blas_threads()


def test_a_ray_worker_pins_its_blas_to_its_one_cpu_over_an_inherited_setting(ray_local: str) -> None:
    import ray

    from sbpflow.actor_workers.worker import remote_class

    env = {"env_vars": {"OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}}  # would oversubscribe a host
    worker = remote_class().options(num_cpus=1, runtime_env=env).remote("job", 1, 0)
    try:
        assert ray.get(worker.__ray_call__.remote(_blas_threads), timeout=120) == 1
        # and, on its one core, its data loads act on the compute thread (executor.engine)
        assert ray.get(worker.__ray_call__.remote(lambda w: w.data_on_compute), timeout=120) is True
    finally:
        ray.kill(worker)

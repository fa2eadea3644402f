"""The plan search priced on this machine: a device profile by name (``cpu`` measured here), the price of
a plan on it with the plan's own kernels and data source timed here, and the search and ``choose`` that
callers use (``sbpflow plan --auto``, ``GraphConfig.auto_parallel``, ``bench/compiler/auto_plan.py``).

    found = search(job, memory_per_device=80 * 10**9, ranks=4)   # on the cpu profile, measured here
    print(found.table()); print(found.why())

The search itself (``compiler/search/auto_plan.py``) is pure: it is given a price function. A saved
profile's price is the cost model's alone (``auto_plan.on_profile``); a CPU profile (one with
``host_cores``: this machine) adds what only running code tells: each plan's kernels timed here
(``kernel_probe.measure_kernels``, cached a process, so candidates share their layers' timings; on the
``inprocess`` link with the plan's ranks in threads at once, as its runs make them), since a small
shard's kernel is mostly numpy's per-call cost, which holds the interpreter and which no roofline sees;
and the job's own data source timed (``cpu_profile.read_cost``, once a process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.cost import cost_model
from sbpflow.control_plane.compiler.cost.cost_model import DeviceProfile, StepEstimate
from sbpflow.control_plane.compiler.cost.stage_load import DataCost, source_key
from sbpflow.control_plane.compiler.search import auto_plan
from sbpflow.control_plane.compiler.search.auto_layouts import Layout, relayout
from sbpflow.control_plane.compiler.search.auto_plan import Price, Search
from sbpflow.control_plane.profiling.cpu_profile import measure_cpu_profile, read_cost
from sbpflow.control_plane.profiling.kernel_probe import measure_kernels
from sbpflow.job import Job

_MEASURED: dict[str, DeviceProfile] = {}  # "cpu": this machine, measured once a process
_READS: dict[str, DataCost] = {}  # a source's repr -> its cost a read and a row here, once a process


def device_profile(profile: DeviceProfile | str) -> DeviceProfile:
    """``profile`` itself; ``cpu``: this machine, measured at first use (about a second); else the saved
    profile or file ``cost_model.load_profile`` reads."""
    if isinstance(profile, DeviceProfile):
        return profile
    if profile == "cpu":
        if "cpu" not in _MEASURED:
            _MEASURED["cpu"] = measure_cpu_profile()
        return _MEASURED["cpu"]
    return cost_model.load_profile(profile)


def pricer(profile: DeviceProfile, link: str | None = None) -> Price:
    """A compiled plan's modelled step on ``profile`` over ``link`` (default: the profile's); on a CPU
    profile with the plan's kernels and its data source timed here (module docstring)."""
    if not profile.host_cores:
        return auto_plan.on_profile(profile, link)

    def price(compiled: pipeline.Compiled) -> StepEstimate:
        kernels = measure_kernels(
            compiled.state, profile.threads, (link or profile.default_link) == "inprocess"
        )
        here = with_source(profile, compiled.state.job.data)
        return cost_model.estimate(compiled, here, link, kernels=kernels)

    return price


def with_source(profile: DeviceProfile, source: object) -> DeviceProfile:
    """``profile`` with ``source`` itself timed here (``cpu_profile.read_cost``, once a process): what a
    read costs depends on the source's parameters (a click source's fields and dense features, a token
    source's sequence), which the profile's figures for the examples' defaults do not know."""
    if source is None:
        return profile
    if repr(source) not in _READS:
        _READS[repr(source)] = read_cost(source, 0.1)
    cost, key = _READS[repr(source)], source_key(source)
    return dataclasses.replace(
        profile,
        data_read_s={**profile.data_read_s, key: cost.read_s},
        data_row_s={**profile.data_row_s, key: cost.row_s},
    )


def search(
    job: Job,
    memory_per_device: int | None = None,
    ranks: int | None = None,
    profile: DeviceProfile | str = "cpu",
    price: Price | None = None,
    powers_of_two: bool = False,
    only: Sequence[Layout] = (),
    link: str | None = None,
) -> Search:
    """``auto_plan.search`` on ``profile`` (a profile, or the name or file :func:`device_profile` takes):
    within ``memory_per_device`` bytes (default: the profile's device memory), each candidate priced by
    ``price`` (default: :func:`pricer` on the profile, over ``link``: the profile's default link unless
    given, ``inprocess`` for ``sf.run(backend="inprocess")``)."""
    needs_profile = price is None or memory_per_device is None
    prof = device_profile(profile) if needs_profile else None
    if prof is not None:
        price = price or pricer(prof, link)
        memory_per_device = auto_plan.budget(prof, memory_per_device)
    assert price is not None and memory_per_device is not None
    return auto_plan.search(job, memory_per_device, price, ranks, powers_of_two, only)


def choose(job: Job, memory_per_device: int | None = None, profile: DeviceProfile | str = "cpu") -> Job:
    """``job`` laid out as the search's winner on the ranks it is placed on (``GraphConfig.auto_parallel``,
    ``sbpflow run --auto``)."""
    return relayout(job, search(job, memory_per_device, profile=profile).winner.layout)

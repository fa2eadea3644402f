"""``Job.verify`` (sbpflow/job.py): each parameter listed once in ``job.parameters``, in the
optimizer's list and in at most one parameter group; a zero-width parameter refused through the graph's
check. Submit runs the same verification (tests/client/test_client.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbpflow.errors import SbpflowError
from sbpflow.job import Job, ParamGroup
from sbpflow.tensor_meta import TensorMeta
from tests.examples.test_examples import load


def _job() -> Job:
    return load("mlp").make_job(ranks=1, hidden=4, layers=2)


JOB = _job()
N = len(JOB.parameters)


def test_the_traced_job_verifies() -> None:
    JOB.verify()
    assert N >= 4 and JOB.optimizer is not None


@given(first=st.integers(0, N - 1), offset=st.integers(0, N))
def test_a_parameter_listed_twice_is_refused_naming_both_entries(first: int, offset: int) -> None:
    specs = list(JOB.parameters)
    at = min(first + 1 + offset, len(specs))  # the repeat lands after its first mention
    specs.insert(at, specs[first])
    job = dataclasses.replace(JOB, parameters=specs)
    name = specs[first].tensor
    with pytest.raises(SbpflowError) as e:
        job.verify()
    assert str(e.value) == (
        f"job.parameters[{at}] names {name!r} again (as job.parameters[{first}] does): "
        "give each parameter one ParameterSpec"
    )


def test_the_optimizer_listing_a_parameter_twice_is_refused() -> None:
    assert JOB.optimizer is not None
    names = JOB.optimizer.parameters
    opt = dataclasses.replace(JOB.optimizer, parameters=(*names, names[1]))
    with pytest.raises(
        SbpflowError, match=f"job.optimizer.parameters\\[{len(names)}\\] names '{names[1]}' again"
    ):
        dataclasses.replace(JOB, optimizer=opt).verify()


def test_a_parameter_in_two_groups_is_refused() -> None:
    assert JOB.optimizer is not None
    a, b = JOB.optimizer.parameters[:2]
    groups = (ParamGroup((a,), lr=0.1), ParamGroup((b,), weight_decay=0.0), ParamGroup((a,), lr=0.5))
    opt = dataclasses.replace(JOB.optimizer, groups=groups)
    with pytest.raises(
        SbpflowError, match=f"'{a}' is in job.optimizer.groups\\[0\\] and again in .*groups\\[2\\]"
    ):
        dataclasses.replace(JOB, optimizer=opt).verify()
    dataclasses.replace(JOB, optimizer=dataclasses.replace(opt, groups=groups[:2])).verify()  # disjoint: fine


def test_a_zero_width_parameter_is_refused_naming_it() -> None:
    job = _job()
    name = job.parameters[0].tensor
    t = job.graph.tensors[name]
    job.graph.tensors[name] = dataclasses.replace(t, meta=TensorMeta((t.meta.shape[0], 0), t.meta.dtype))
    with pytest.raises(
        SbpflowError, match=f"parameter tensor '{name}' .* has size 0 on axis 1: a zero-width layer"
    ):
        job.verify()

"""Wire formats: every oneof variant survives a serialise/parse round trip; enums start at _UNSPECIFIED."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import TypeVar

import pytest
from google.protobuf import timestamp_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FileDescriptor
from google.protobuf.message import Message

from sbpflow.v1 import data_image_pb2, data_table_pb2, data_text_pb2, job_pb2, plan_pb2, service_pb2

M = TypeVar("M", bound=Message)


def roundtrip(msg: M) -> M:
    """Serialise and parse back; the copy equals the original and re-serialises to the same bytes."""
    data = msg.SerializeToString(deterministic=True)
    back = type(msg).FromString(data)
    assert back == msg
    assert back.SerializeToString(deterministic=True) == data
    return back


def placement(ranks: list[int], mesh: list[int]) -> job_pb2.Placement:
    return job_pb2.Placement(device_type=job_pb2.DEVICE_TYPE_CUDA, mesh_shape=mesh, ranks=ranks)


def nd(*sbps: job_pb2.Sbp) -> job_pb2.NdSbp:
    return job_pb2.NdSbp(sbp=list(sbps))


S0 = job_pb2.Sbp(split=job_pb2.Split(axis=0))
S1 = job_pb2.Sbp(split=job_pb2.Split(axis=1))
B = job_pb2.Sbp(broadcast=job_pb2.Broadcast())
P = job_pb2.Sbp(partial_sum=job_pb2.PartialSum())

# One AttrValue per oneof variant, keyed by the variant's name.
ATTRS = {
    "i": job_pb2.AttrValue(i=-3),
    "f": job_pb2.AttrValue(f=0.125),
    "s": job_pb2.AttrValue(s="tanh"),
    "b": job_pb2.AttrValue(b=False),  # False is still "set": the oneof keeps presence
    "ints": job_pb2.AttrValue(ints=job_pb2.Int64List(values=[0, 2, 1, 3])),
    "floats": job_pb2.AttrValue(floats=job_pb2.DoubleList(values=[0.6, 0.4])),
    "dtype": job_pb2.AttrValue(dtype=job_pb2.DTYPE_BFLOAT16),
    "none": job_pb2.AttrValue(none=True),
}

ARRAY = job_pb2.ArrayData(dtype=job_pb2.DTYPE_FLOAT32, shape=[2], data=struct.pack("<2f", 1.0, -2.0))

DATA_KINDS = {
    "in_memory": job_pb2.DataSource(in_memory=job_pb2.InMemory(arrays={"x": ARRAY})),
    "array_files": job_pb2.DataSource(array_files=job_pb2.ArrayFiles(paths={"x": "/data/x.npy"})),
    "token_file": job_pb2.DataSource(
        token_file=job_pb2.TokenFile(path="/data/train.bin", dtype=job_pb2.DTYPE_INT32, seq_len=256)
    ),
    "synthetic": job_pb2.DataSource(
        synthetic=job_pb2.Synthetic(kind="teacher_regression", params={"noise": 0.01})
    ),
    "text_files": job_pb2.DataSource(
        text_files=data_text_pb2.TextFiles(paths=["/data/*.txt"], tokenizer="bytes", seq_len=128)
    ),
    "image_files": job_pb2.DataSource(image_files=data_image_pb2.ImageFiles(paths=["/data/train"], size=224)),
    "table_files": job_pb2.DataSource(table_files=data_table_pb2.TableFiles(paths=["/data/clicks.parquet"])),
}


def make_job() -> job_pb2.Job:
    mesh = placement([0, 1, 2, 3], [2, 2])
    tensors = [
        job_pb2.Tensor(
            name="x",
            shape=[8, 16],
            dtype=job_pb2.DTYPE_FLOAT32,
            kind=job_pb2.TENSOR_KIND_INPUT,
            placement=mesh,
            sbp=nd(S0, B),
        ),
        job_pb2.Tensor(
            name="w",
            shape=[16, 4],
            dtype=job_pb2.DTYPE_FLOAT32,
            kind=job_pb2.TENSOR_KIND_PARAMETER,
            placement=mesh,
            sbp=nd(B, S1),
            requires_grad=True,
        ),
        job_pb2.Tensor(
            name="y", shape=[8, 4], dtype=job_pb2.DTYPE_FLOAT32, kind=job_pb2.TENSOR_KIND_ACTIVATION
        ),
        job_pb2.Tensor(name="p", shape=[8, 4], dtype=job_pb2.DTYPE_FLOAT32, sbp=nd(P, B)),
        job_pb2.Tensor(name="loss", shape=[], dtype=job_pb2.DTYPE_FLOAT32),
    ]
    ops = [
        job_pb2.Op(name="mm", op_type="matmul", inputs=["x", "w"], outputs=["y"], placement=mesh, scope="fc"),
        job_pb2.Op(
            name="act", op_type="custom", inputs=["y"], outputs=["p"], attrs=ATTRS, stage=1, checkpoint=True
        ),
        job_pb2.Op(name="sum", op_type="reduce_sum", inputs=["p"], outputs=["loss"]),
    ]
    return job_pb2.Job(
        format_version=1,
        name="all-variants",
        graph=job_pb2.Graph(tensors=tensors, ops=ops),
        parameters=[
            job_pb2.Parameter(
                tensor="w",
                init=job_pb2.Initializer(kind="truncated_normal", params={"std": 0.02, "a": -2, "b": 2}),
                trainable=True,
            )
        ],
        data=job_pb2.DataSource(
            fields=[job_pb2.DataField(name="x", sample_shape=[16], dtype=job_pb2.DTYPE_FLOAT32)],
            global_batch_size=8,
            shuffle=True,
            seed=2**64 - 1,
            drop_last=True,
            placement=mesh,
            sbp=nd(S0, B),
            synthetic=job_pb2.Synthetic(kind="normal"),
        ),
        optimizer=job_pb2.Optimizer(
            adamw=job_pb2.AdamW(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
            clip_grad_norm=1.0,
            schedule=job_pb2.LrSchedule(
                warmup_cosine=job_pb2.WarmupCosine(warmup_steps=10, total_steps=100, min_lr_ratio=0.1)
            ),
            parameters=["w"],
        ),
        config=job_pb2.JobConfig(
            steps=100,
            gradient_accumulation_steps=2,
            micro_batches=4,
            pipeline_schedule=job_pb2.PIPELINE_SCHEDULE_ONE_F_ONE_B,
            zero_stage=2,
            activation_checkpointing=True,
            precision=job_pb2.PRECISION_BF16,
            loss_scale=0.0,
            seed=42,
            checkpoint_every=50,
        ),
        loss="loss",
        fetches=["y"],
    )


def test_job_roundtrip() -> None:
    job = make_job()
    back = roundtrip(job)
    assert isinstance(back, job_pb2.Job)
    assert back.data.seed == 2**64 - 1
    assert [s.WhichOneof("kind") for s in back.graph.tensors[0].sbp.sbp] == ["split", "broadcast"]
    assert back.graph.tensors[3].sbp.sbp[0].WhichOneof("kind") == "partial_sum"
    assert back.graph.tensors[1].sbp.sbp[1].split.axis == 1


def test_tensor_sbp_presence_distinguishes_unannotated() -> None:
    back = roundtrip(make_job())
    by_name = {t.name: t for t in back.graph.tensors}
    assert by_name["x"].HasField("sbp")
    assert not by_name["y"].HasField("sbp")  # not annotated: the compiler chooses
    assert not by_name["y"].HasField("placement")


@pytest.mark.parametrize("variant", sorted(ATTRS))
def test_attr_value_variants(variant: str) -> None:
    back = roundtrip(ATTRS[variant])
    assert back.WhichOneof("value") == variant
    # Every variant is reachable in an Op's attrs map after a round trip of the whole job.
    op = roundtrip(make_job()).graph.ops[1]
    assert op.attrs[variant].WhichOneof("value") == variant


def test_attr_value_covers_every_oneof_field() -> None:
    fields = {f.name for f in job_pb2.AttrValue.DESCRIPTOR.oneofs_by_name["value"].fields}
    assert fields == set(ATTRS)


@pytest.mark.parametrize("variant", sorted(DATA_KINDS))
def test_data_source_variants(variant: str) -> None:
    back = roundtrip(DATA_KINDS[variant])
    assert back.WhichOneof("kind") == variant


def test_data_source_covers_every_oneof_field() -> None:
    fields = {f.name for f in job_pb2.DataSource.DESCRIPTOR.oneofs_by_name["kind"].fields}
    assert fields == set(DATA_KINDS)


def test_optimizer_and_schedule_variants() -> None:
    sgd = job_pb2.Optimizer(
        sgd=job_pb2.Sgd(lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True),
        schedule=job_pb2.LrSchedule(constant=job_pb2.Constant()),
    )
    back = roundtrip(sgd)
    assert back.WhichOneof("kind") == "sgd"
    assert back.schedule.WhichOneof("kind") == "constant"  # an empty message still marks the variant
    adamw = roundtrip(make_job()).optimizer
    assert adamw.WhichOneof("kind") == "adamw"
    assert adamw.schedule.WhichOneof("kind") == "warmup_cosine"
    assert not job_pb2.Optimizer().HasField("schedule")


def test_array_data_bytes_are_kept_verbatim() -> None:
    back = roundtrip(ARRAY)
    assert struct.unpack("<2f", back.data) == (1.0, -2.0)


def make_plan() -> plan_pb2.Plan:
    tasks = [
        plan_pb2.Task(
            id=1,
            kind=plan_pb2.TASK_KIND_KERNEL,
            stream=plan_pb2.STREAM_KIND_COMPUTE,
            op_name="mm",
            op_type="matmul",
            attrs={"transpose_b": job_pb2.AttrValue(b=True)},
            in_registers=[10, 11],
            out_registers=[12],
            stage=0,
            micro_batch=-1,
        ),
        plan_pb2.Task(
            id=2,
            kind=plan_pb2.TASK_KIND_BOXING,
            stream=plan_pb2.STREAM_KIND_COMMUNICATION,
            in_registers=[12],
            out_registers=[13],
            micro_batch=3,
            communicator="cuda:0,1",
            comm_seq=0,
            boxing=plan_pb2.Boxing(
                from_sbp="P",
                to_sbp="S(0)",
                collective=plan_pb2.COLLECTIVE_KIND_REDUCE_SCATTER,
                bytes_moved=64,
            ),
        ),
    ]
    registers = [
        plan_pb2.RegisterDesc(
            id=12,
            producer_task=1,
            consumer_tasks=[2],
            count=2,
            bytes=128,
            shape=[8, 4],
            dtype=job_pb2.DTYPE_FLOAT32,
            tensor="y",
        )
    ]
    memory = plan_pb2.MemoryEstimate(
        parameters=256, gradients=256, optimizer_state=512, peak_activations=1024, total=2048
    )
    comm = plan_pb2.Communicator(
        id="cuda:0,1",
        ranks=[0, 1],
        order=[
            plan_pb2.CommStep(task_id=2, rank=0, kind=plan_pb2.COLLECTIVE_KIND_REDUCE_SCATTER, bytes=32),
            plan_pb2.CommStep(task_id=102, rank=1, kind=plan_pb2.COLLECTIVE_KIND_REDUCE_SCATTER, bytes=32),
        ],
    )
    devices = [
        plan_pb2.DevicePlan(
            rank=r, device_type=job_pb2.DEVICE_TYPE_CUDA, tasks=tasks, registers=registers, memory=memory
        )
        for r in (0, 1)
    ]
    return plan_pb2.Plan(
        format_version=1, job_id="job-1", devices=devices, communicators=[comm], job=make_job()
    )


def test_plan_roundtrip() -> None:
    back = roundtrip(make_plan())
    assert isinstance(back, plan_pb2.Plan)
    assert back.devices[0].tasks[0].micro_batch == -1
    assert back.devices[1].tasks[1].boxing.collective == plan_pb2.COLLECTIVE_KIND_REDUCE_SCATTER
    assert back.job == make_job()


def ts(seconds: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=500)


WORKER_PAYLOADS = {
    "heartbeat": service_pb2.WorkerReport(heartbeat=service_pb2.Heartbeat()),
    "step": service_pb2.WorkerReport(
        step=service_pb2.StepReport(
            step=7, losses=[2.5, 2.25], loss=2.375, timings_seconds={"step": 0.3, "comm": 0.05}, samples=16
        )
    ),
    "memory": service_pb2.WorkerReport(
        memory=service_pb2.MemoryReport(bytes_in_use=1 << 30, peak_bytes=1 << 31)
    ),
    "error": service_pb2.WorkerReport(
        error=service_pb2.ErrorReport(
            op_name="act", op_type="gelu", cause="ValueError: P input", traceback="Traceback ..."
        )
    ),
    "done": service_pb2.WorkerReport(done=service_pb2.Done()),
    "log": service_pb2.WorkerReport(log=service_pb2.LogLine(job_id="job-1", rank=1, level="INFO", text="hi")),
    "eval": service_pb2.WorkerReport(eval=service_pb2.EvalReport(step=4, losses=[1.5, 1.25])),
}


@pytest.mark.parametrize("variant", sorted(WORKER_PAYLOADS))
def test_worker_report_roundtrip(variant: str) -> None:
    report = service_pb2.WorkerReport(
        job_id="job-1", attempt=2, rank=1, worker_id="actor-abc", time=ts(1700000000)
    )
    report.MergeFrom(WORKER_PAYLOADS[variant])
    back = roundtrip(report)
    assert back.WhichOneof("payload") == variant
    assert back.time.nanos == 500


def test_worker_report_covers_every_payload() -> None:
    fields = {f.name for f in service_pb2.WorkerReport.DESCRIPTOR.oneofs_by_name["payload"].fields}
    assert fields == set(WORKER_PAYLOADS)


def test_job_status_and_events_roundtrip() -> None:
    status = service_pb2.JobStatus(
        job_id="job-1",
        name="all-variants",
        state=service_pb2.JOB_STATE_RUNNING,
        attempt=1,
        step=7,
        total_steps=100,
        samples_per_second=123.5,
        workers=[
            service_pb2.WorkerStatus(
                rank=0,
                worker_id="a",
                state=service_pb2.WORKER_STATE_RUNNING,
                host="10.0.0.1",
                step=7,
                last_heartbeat=ts(5),
            )
        ],
        created=ts(1),
        started=ts(2),
        last_checkpoint="/ckpt/step-50",
    )
    assert not roundtrip(status).HasField("loss")  # no step yet: the loss is absent, not 0
    status.loss = 0.0
    assert roundtrip(status).HasField("loss")
    details = {
        "state_change": service_pb2.JobEvent(
            state_change=service_pb2.StateChange(
                previous=service_pb2.JOB_STATE_STARTING, current=service_pb2.JOB_STATE_RUNNING
            )
        ),
        "step": service_pb2.JobEvent(step=service_pb2.StepMetrics(step=7, loss=2.3, samples_per_second=10.0)),
        "log": service_pb2.JobEvent(log=service_pb2.LogLine(rank=-1, text="compiled")),
    }
    assert {f.name for f in service_pb2.JobEvent.DESCRIPTOR.oneofs_by_name["detail"].fields} == set(details)
    for variant, event in details.items():
        event.job_id, event.seq = "job-1", 3
        event.time.CopyFrom(ts(9))
        event.status.CopyFrom(status)
        assert roundtrip(event).WhichOneof("detail") == variant


def test_requests_and_result_roundtrip() -> None:
    roundtrip(service_pb2.SubmitJobRequest(job=make_job(), client_id="cli", idempotency_key="k1"))
    roundtrip(
        service_pb2.ListJobsRequest(page_size=10, page_token="t", states=[service_pb2.JOB_STATE_FAILED])
    )
    roundtrip(service_pb2.WatchJobRequest(job_id="job-1", after_seq=3))
    roundtrip(service_pb2.LogsRequest(job_id="job-1", rank=-1, follow=True))
    result = roundtrip(
        service_pb2.JobResult(
            job_id="job-1", state=service_pb2.JOB_STATE_SUCCEEDED, losses=[3.0, 2.0], parameters={"w": ARRAY}
        )
    )
    assert result.parameters["w"] == ARRAY
    assert roundtrip(service_pb2.ReportAck(cancel=True)).cancel


def test_services_declare_their_methods() -> None:
    services = service_pb2.DESCRIPTOR.services_by_name
    job = {m.name: m for m in services["JobService"].methods}
    assert set(job) == {
        *("Submit", "Get", "List", "Watch", "Cancel", "Logs", "GetResult", "Resume"),
        *("ListCheckpoints", "ReadCheckpoint"),
    }
    assert job["Watch"].server_streaming and job["Logs"].server_streaming
    assert job["ReadCheckpoint"].server_streaming and not job["ListCheckpoints"].server_streaming
    assert not job["Submit"].server_streaming
    worker = {m.name: m for m in services["WorkerService"].methods}
    assert set(worker) == {"Report", "ReportStream", "ReportBatch"}
    assert worker["ReportStream"].client_streaming and not worker["Report"].client_streaming
    assert (
        not worker["ReportBatch"].client_streaming
        and worker["ReportBatch"].input_type.name == "WorkerReports"
    )
    from sbpflow.v1 import service_pb2_grpc

    assert hasattr(service_pb2_grpc, "JobServiceStub") and hasattr(service_pb2_grpc, "WorkerServiceServicer")


FILES: list[FileDescriptor] = [job_pb2.DESCRIPTOR, plan_pb2.DESCRIPTOR, service_pb2.DESCRIPTOR]


def all_enums() -> list[EnumDescriptor]:
    """Top-level and nested enums of every sbpflow.v1 file."""
    enums: list[EnumDescriptor] = []

    def walk(messages: Iterable[Descriptor]) -> None:
        for m in messages:
            enums.extend(m.enum_types)
            walk(m.nested_types)

    for f in FILES:
        enums.extend(f.enum_types_by_name.values())
        walk(f.message_types_by_name.values())
    return enums


def test_every_enum_starts_at_unspecified() -> None:
    enums = all_enums()
    assert {e.name for e in enums} >= {
        "DType", "DeviceType", "TensorKind", "Precision", "PipelineSchedule",
        "TaskKind", "StreamKind", "CollectiveKind", "JobState", "WorkerState",
    }  # fmt: skip
    for enum in enums:
        zero = enum.values_by_number[0]
        assert zero.name.endswith("_UNSPECIFIED"), f"{enum.full_name}: zero value is {zero.name}"
        # Values share the package scope, so each carries its enum's prefix (TASK_KIND_SEND, not SEND).
        prefix = zero.name.removesuffix("UNSPECIFIED")
        assert all(v.name.startswith(prefix) for v in enum.values), (
            f"{enum.full_name}: values lack {prefix!r}"
        )


def test_unset_enum_fields_read_as_unspecified() -> None:
    assert job_pb2.Tensor().dtype == job_pb2.DTYPE_UNSPECIFIED
    assert plan_pb2.Task().kind == plan_pb2.TASK_KIND_UNSPECIFIED
    assert service_pb2.JobStatus().state == service_pb2.JOB_STATE_UNSPECIFIED


def test_format_version_field_present() -> None:
    assert job_pb2.Job.DESCRIPTOR.fields_by_name["format_version"].number == 1
    assert plan_pb2.Plan.DESCRIPTOR.fields_by_name["format_version"].number == 1

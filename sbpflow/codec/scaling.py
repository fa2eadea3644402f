"""``JobConfig.loss_scaling`` to and from its protobuf (``sbpflow.v1.LossScaling``), for sbpflow.codec.wire.

The message is absent where the value is the default (GradScaler's), so every job that does not set it
keeps the message it had before the field existed, and an absent message reads as the default.
"""

from __future__ import annotations

import dataclasses

from sbpflow.job import LossScaling
from sbpflow.v1 import job_pb2 as pb


def loss_scaling_to_proto(value: LossScaling) -> pb.LossScaling | None:
    return None if value == LossScaling() else pb.LossScaling(**dataclasses.asdict(value))


def loss_scaling_from_proto(m: pb.JobConfig) -> LossScaling:
    if not m.HasField("loss_scaling"):
        return LossScaling()
    s = m.loss_scaling
    return LossScaling(s.init, s.growth_factor, s.backoff_factor, s.growth_interval)

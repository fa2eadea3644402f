"""The one-device reference's dynamic loss scaling: torch.cuda.amp.GradScaler's rule, on the host.

Written apart from the compiler's (control_plane/compiler/loss_scaling.py) and its ops, from GradScaler's
documented behaviour: seed the backward with the scale; unscale each gradient by ``float32(1 / scale)``
(the reciprocal in float64, as ``scale.double().reciprocal().float()``); a step where any unscaled
gradient holds an inf or a NaN is skipped (no parameter or optimizer state moves, AdamW's step count
included) and the scale multiplied by ``backoff_factor``; otherwise the clean steps in a row are counted,
and at ``growth_interval`` the scale is multiplied by ``growth_factor`` (unless that overflows float32)
and the count restarts. The scale is float32 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sbpflow.job import Job, LossScaling


@dataclass
class Scaler:
    config: LossScaling
    scale: np.float32 = np.float32(0)
    good_steps: int = 0
    skipped_steps: int = 0
    history: list[float] = field(default_factory=list)  # the scale each step ran with
    skipped: list[bool] = field(default_factory=list)  # whether each step was skipped

    def __post_init__(self) -> None:
        self.scale = np.float32(self.config.init)

    @classmethod
    def of(cls, job: Job) -> Scaler | None:
        """The job's scaler; None where it does not scale dynamically (not fp16, or a static scale)."""
        return cls(job.config.loss_scaling) if job.config.dynamic_loss_scaling else None

    def unscale(self, grad: Any) -> Any:
        return grad * np.float32(1.0 / np.float64(self.scale)).astype(grad.dtype)

    def step(self, grads: dict[str, Any]) -> bool:
        """Record the step of these unscaled gradients and move the scale; True: skip the update."""
        self.history.append(float(self.scale))
        bad = any(not np.isfinite(np.asarray(g)).all() for g in grads.values())
        self.skipped.append(bad)
        c = self.config
        if bad:
            self.scale = np.float32(np.float64(self.scale) * c.backoff_factor)
            self.good_steps = 0
            self.skipped_steps += 1
        elif self.good_steps + 1 == c.growth_interval:
            grown = np.float32(np.float64(self.scale) * c.growth_factor)
            self.scale = grown if np.isfinite(grown) else self.scale
            self.good_steps = 0
        else:
            self.good_steps += 1
        return bad

    def state(self) -> dict[str, np.ndarray]:
        """Its variables as the compiled plan names them (``loss_scale/...``)."""
        return {
            "loss_scale/scale": np.full((1,), self.scale, dtype=np.float32),
            "loss_scale/good_steps": np.full((1,), self.good_steps, dtype=np.float32),
            "loss_scale/skipped_steps": np.full((1,), self.skipped_steps, dtype=np.float32),
        }

"""What a job traced in this process offers a run besides its data: the modules it was traced from.

A ``Job`` is data (it crosses the wire without them), but one traced by ``sf.Graph.trace`` keeps a
:class:`BoundValues` beside it (``Job.bound``, never on the wire): the values its parameters hold (a
trained or loaded module), where a run writes the trained values back, and the file layouts it can
translate from (``"torch"``: PyTorch's names and weight orientation). ``sf.run`` uses it so that a
second run continues from the first; a job that came over the wire has none and starts from its
initializers or ``init_from=``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np


class BoundValues(Protocol):
    def held(self) -> dict[str, np.ndarray]:
        """Tensor name -> logical value, for each parameter whose module holds a value."""
        ...

    def write_back(self, values: Mapping[str, Any]) -> None:
        """Store each parameter's trained logical value (by tensor name) in its module."""
        ...

    def from_layout(self, layout: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``tensors`` of a file in ``layout`` (its names, its weight orientation) under the job's
        tensor names and layouts; a clear error for a layout it does not know."""
        ...

    def to_layout(self, layout: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The job's ``tensors`` (by tensor name) under ``layout``'s names and orientation."""
        ...

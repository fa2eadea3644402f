"""The data plane: one interface (``base``: send, recv, the collectives), one implementation per backend
(``inprocess``, ``cpu``, ``nccl``)."""

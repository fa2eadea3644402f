"""The NCCL data plane for GPU workers: ``transport`` (the Transport), ``wire`` (dtypes, call headers),
``comms`` (communicators, bootstrap, streams), ``collectives`` (one function per collective)."""

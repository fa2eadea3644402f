"""The workers: the actor runtime (``runtime``), the data plane (``transport``) and the :class:`Worker`
that executes its rank's part of a Plan. Nothing here knows the compiler or the services above it."""

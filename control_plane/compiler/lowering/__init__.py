"""Lowering, the compiler's physical pass: ``lower`` (the pass and the walk), ``tasks`` (sources, kernels,
accumulations, sinks), ``boxing`` (collectives, send/recv, the communicator order), ``on_demand`` (one
rank's DevicePlan without the others')."""

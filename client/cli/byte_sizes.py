"""Sizes in bytes as a person writes them on a command line: ``8GiB``, ``16G``, ``512MB``, ``1048576``.

parse_bytes("8GiB")   # 8589934592
parse_bytes("1.5G")   # 1610612736: K, M, G, T are binary (as free(1) and Kubernetes' Gi), kB.. decimal
parse_bytes("8 GB")   # 8000000000
"""

from __future__ import annotations

import argparse
import math
import re

UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "ti": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
MAX_BYTES = 1 << 62  # larger than any device; beyond it a number is a typo
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """``text`` in bytes (module docstring); an argparse ``type``: a bad size is an error saying what to
    write."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in UNITS:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a size; write bytes or a number with a unit, e.g. 8GiB, 16G, 512MB or 0"
        )
    value = float(m.group(1)) * UNITS[unit]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is larger than any device ({MAX_BYTES} bytes at most)"
        )
    return int(value)

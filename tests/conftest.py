"""Test-session settings. Under CI (``CI`` set), Hypothesis is derandomized and keeps no example
database, so a clean clone draws the same examples every run: a red CI is a real failure, reproducible
with ``CI=true python -m pytest``; locally Hypothesis keeps exploring new examples."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

"""The status pages' line charts: round ticks that cover the data, titled axes, values on hover."""

from __future__ import annotations

import math
import re
import xml.dom.minidom

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbpflow.control_plane.status.charts import Series, fmt, line_chart, nice_ticks


@given(
    st.floats(-1e6, 1e6, allow_nan=False),
    st.floats(0, 1e6, allow_nan=False),
)
def test_ticks_are_round_and_cover_the_range(lo: float, span: float) -> None:
    hi = lo + span
    ticks = nice_ticks(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 13
    steps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    step = steps[0]
    assert all(math.isclose(s, step, rel_tol=1e-3) for s in steps)
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 5, 10))


def test_ticks_refuse_non_finite_bounds() -> None:
    with pytest.raises(ValueError, match="finite"):
        nice_ticks(0.0, math.inf)


def test_a_chart_has_axes_titles_values_and_skips_nan() -> None:
    points = ((1.0, 2.5), (2.0, 2.0), (3.0, math.nan), (4.0, 1.25))
    svg = line_chart([Series("loss", points)], x_label="step", y_label="loss")
    xml.dom.minidom.parseString(svg)
    assert ">step</text>" in svg and ">loss</text>" in svg
    assert "1 non-finite value(s) left out" in svg
    assert len(re.search(r"points='([^']*)'", svg).group(1).split()) == 3
    assert "<title>loss 1.25 at step 4</title>" in svg  # a point's value on hover
    assert "class='last'" in svg and ">1.25</text>" in svg  # the last value beside the line


def test_an_empty_chart_says_so() -> None:
    assert "no data yet" in line_chart([Series("loss", ())], x_label="step", y_label="loss")
    assert "no finite values" in line_chart([Series("loss", ((1.0, math.inf),))], x_label="s", y_label="l")


def test_numbers_stay_short() -> None:
    assert [fmt(x) for x in (0, 0.00123, 2.3145, 12345.0, 1.5e7)] == [
        "0",
        "0.00123",
        "2.31",
        "1.23e+04",
        "1.5e+07",
    ]


def test_a_long_run_is_thinned_but_keeps_its_ends() -> None:
    points = tuple((float(i), 1.0 / (i + 1)) for i in range(100_000))
    svg = line_chart([Series("loss", points)], x_label="step", y_label="loss")
    xy = re.search(r"points='([^']*)'", svg).group(1).split()
    assert 900 <= len(xy) <= 1001 and len(svg) < 200_000
    assert ">1e-05</text>" in svg  # the last value is the last point's

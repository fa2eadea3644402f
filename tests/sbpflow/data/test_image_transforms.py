"""The image transforms alone: torchvision's RandomResizedCrop box (inside the image, its area and ratio in
range, the centre fallback), the centre box, the draws a function of (seed, epoch, sample) only."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sbpflow.data.image_transforms import DRAWS, TRIES, center_box, draws, random_resized_box

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


def test_draws_depend_on_seed_epoch_and_sample_only() -> None:
    ids = np.array([5, 0, 9, 5])
    u = draws(1, 2, ids)
    assert u.shape == (4, DRAWS) and (0 <= u).all() and (u < 1).all()
    np.testing.assert_array_equal(u[0], u[3])  # the same sample, wherever it sits
    np.testing.assert_array_equal(u[2], draws(1, 2, np.array([9]))[0])
    assert not np.array_equal(u[0], draws(1, 3, np.array([5]))[0])  # another epoch
    assert not np.array_equal(u[0], draws(2, 2, np.array([5]))[0])  # another seed


@pytest.mark.parametrize(("width", "height"), [(500, 375), (32, 32), (7, 300), (1000, 3), (1, 1)])
def test_random_resized_boxes_lie_inside_with_area_and_ratio_in_range(width: int, height: int) -> None:
    u = draws(0, 0, np.arange(400))
    for row in u:
        left, top, right, bottom = random_resized_box(width, height, row, SCALE, RATIO)
        w, h = right - left, bottom - top
        assert 0 <= left and 0 <= top and right <= width and bottom <= height and w > 0 and h > 0
        tried = []  # each try's sides: area scale[0]..scale[1] of the image's, ratio log-uniform in RATIO
        for t in range(TRIES):
            area = width * height * (SCALE[0] + (SCALE[1] - SCALE[0]) * row[4 * t])
            ratio = math.exp(math.log(RATIO[0]) + math.log(RATIO[1] / RATIO[0]) * row[4 * t + 1])
            tried.append((round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))))
        fits = [(tw, th) for tw, th in tried if 0 < tw <= width and 0 < th <= height]
        if fits:  # the first box that fits, as torchvision takes it
            assert (w, h) == fits[0]
        else:  # the centre box, whole along the side the image's ratio leaves no room on
            assert (left, top) == ((width - w) // 2, (height - h) // 2)
            assert w == width or h == height


def test_the_fallback_is_the_centre_box_of_the_nearest_ratio() -> None:
    never = np.zeros(DRAWS)
    never[0 : 4 * TRIES : 4] = 1.0  # every try the whole area ...
    never[1 : 4 * TRIES : 4] = 1.0  # ... at ratio 4/3: too wide for a tall image
    assert random_resized_box(10, 100, never, SCALE, RATIO) == (0, 43, 10, 56)  # h = round(10 / (3/4)) = 13
    assert random_resized_box(100, 10, never, (1.0, 1.0), (0.75, 0.75)) == (46, 0, 54, 10)  # w = 8
    assert random_resized_box(40, 40, never, (1.0, 1.0), (0.75, 1.0)) == (0, 0, 40, 40)


def test_the_top_left_is_uniform_over_the_places_a_box_fits() -> None:
    u = np.zeros(DRAWS)
    u[0], u[1] = 0.0, 0.5  # area scale[0] of 100 x 100 at ratio 1: 800 px, a 28 x 28 box
    u[2], u[3] = 0.9999, 0.0  # bottom-most, left-most
    assert random_resized_box(100, 100, u, SCALE, RATIO) == (0, 72, 28, 100)


@pytest.mark.parametrize(
    ("width", "height", "box"),
    [
        (500, 375, (58 * 500 / 341, 16 * 375 / 256, 282 * 500 / 341, 240 * 375 / 256)),  # new 341x256
        (256, 256, (16, 16, 240, 240)),
        (20, 30, (2, 7, 18, 23)),
    ],
)
def test_center_box_is_resize_then_center_crop(width: int, height: int, box: tuple[float, ...]) -> None:
    size, resize = (16, 20) if width == 20 else (224, 256)
    np.testing.assert_allclose(center_box(width, height, size, resize), box)

"""ImageFiles on the wire: every option survives source -> proto -> source; each bad value is refused at
decode, naming its field."""

from __future__ import annotations

import pytest

from sbpflow.codec.data_wire import data_from_proto, data_to_proto
from sbpflow.codec.values import WireError
from sbpflow.data.images import ImageFileSource
from sbpflow.errors import SbpflowError
from sbpflow.v1 import data_image_pb2 as ipb
from sbpflow.v1 import job_pb2 as pb

FULL = ImageFileSource(
    paths=("/data/a-*.tar", "/data/b.tar"),
    layout="tar",
    batch_size=32,
    shuffle=True,
    seed=2**63 + 5,
    drop_last=False,
    size=112,
    classes=1000,
    crop="center",
    scale=(0.25, 0.75),
    ratio=(0.5, 2.0),
    resize=128,
    flip=False,
    mean=(0.5, 0.25, 0.125),
    std=(0.2, 0.3, 0.4),
    full_decode=True,
    threads=3,
)


@pytest.mark.parametrize(
    "source",
    [
        ImageFileSource(paths=("/data/train",), batch_size=8),
        ImageFileSource(paths=("/data/train",), batch_size=8, crop="resize", mean=(), std=()),
        FULL,
    ],
)
def test_round_trip(source: ImageFileSource) -> None:
    m = data_to_proto(source)
    assert m.WhichOneof("kind") == "image_files"
    back = data_from_proto(pb.DataSource.FromString(m.SerializeToString()))
    assert back == source and type(back) is ImageFileSource


def _wire(**fields: object) -> pb.DataSource:
    m = data_to_proto(ImageFileSource(paths=("/data/train",), batch_size=8))
    for k, v in fields.items():
        if isinstance(v, list):
            getattr(m.image_files, k)[:] = v
        else:
            setattr(m.image_files, k, v)
    return m


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"size": 0}, "image_files.size=0"),
        ({"size": 1 << 20}, "image_files.size"),
        ({"scale_min": 0.9, "scale_max": 0.1}, "image_files.scale_max=0.1"),
        ({"scale_min": 0.0}, "image_files.scale_min=0"),
        ({"scale_max": 1.5}, "image_files.scale_max=1.5"),
        ({"ratio_min": 2.0, "ratio_max": 1.0}, "image_files.ratio_max=1"),
        ({"ratio_min": float("nan")}, "image_files.ratio_min=nan"),
        ({"mean": [0.5, 0.5]}, "image_files.mean"),
        ({"std": []}, "image_files.mean"),
        ({"std": [0.2, 0.0, 0.2]}, "image_files.std[1]=0"),
        ({"resize": 100}, "image_files.resize=100"),
        ({"classes": -1}, "image_files.classes=-1"),
        ({"threads": -2}, "image_files.threads=-2"),
        ({"layout": ipb.IMAGE_LAYOUT_UNSPECIFIED}, "ImageFiles.layout=IMAGE_LAYOUT_UNSPECIFIED"),
        ({"layout": 9}, "ImageFiles.layout=9"),
        ({"crop": ipb.IMAGE_CROP_UNSPECIFIED}, "ImageFiles.crop=IMAGE_CROP_UNSPECIFIED"),
        ({"paths": []}, "image_files.paths=[]: is empty"),
        ({"paths": ["/a", "/b"]}, "is not one folder"),
        ({"paths": ["/a\x00"]}, "image_files.paths[0]"),
        ({"paths": ["/" + "a" * 5000]}, "image_files.paths[0]"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict[str, object], says: str) -> None:
    with pytest.raises(SbpflowError) as e:
        data_from_proto(_wire(**fields))
    assert says in str(e.value), str(e.value)
    assert isinstance(e.value, WireError) or "job.data.image_files" in str(e.value)


def test_tar_shards_may_be_many_paths() -> None:
    m = _wire(paths=["/a-*.tar", "/b.tar"], layout=ipb.IMAGE_TAR_SHARDS)
    assert data_from_proto(m).paths == ("/a-*.tar", "/b.tar")  # type: ignore[union-attr]

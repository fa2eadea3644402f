"""The wire form of the image sources (``protos/sbpflow/v1/data_image.proto``), registered in
:data:`sbpflow.codec.formats.FORMATS` at import (``data_wire`` imports this module).

The enums are tables both ways; an unset or unknown one is refused by name. The values' bounds are the
source's own ``check_limits``, run here too, so a message the codec accepts is one the workers can read.
"""

from __future__ import annotations

from typing import Any

from sbpflow.codec.formats import FileFormat, register
from sbpflow.codec.values import WireError
from sbpflow.data.images import ImageFileSource
from sbpflow.limits import LIMITS
from sbpflow.v1 import data_image_pb2 as pb

LAYOUTS = {"folder": pb.IMAGE_FOLDER, "tar": pb.IMAGE_TAR_SHARDS}
CROPS = {
    "random_resized": pb.IMAGE_CROP_RANDOM_RESIZED,
    "center": pb.IMAGE_CROP_CENTER,
    "resize": pb.IMAGE_CROP_RESIZE,
}


def _to_proto(s: ImageFileSource) -> pb.ImageFiles:
    return pb.ImageFiles(
        paths=s.paths,
        size=s.size,
        layout=LAYOUTS[s.layout],
        classes=s.classes,
        crop=CROPS[s.crop],
        scale_min=s.scale[0],
        scale_max=s.scale[1],
        ratio_min=s.ratio[0],
        ratio_max=s.ratio[1],
        resize=s.resize,
        flip=s.flip,
        mean=s.mean,
        std=s.std,
        full_decode=s.full_decode,
        threads=s.threads,
    )


def _enum(field: str, value: int, table: dict[str, Any], enum: Any) -> str:
    for name, v in table.items():
        if v == value:
            return name
    raise WireError(
        f"ImageFiles.{field}={enum.Name(value) if value in enum.values() else value} is not one sbpflow "
        f"reads; give one of {', '.join(enum.Name(v) for v in table.values())}"
    )


def _from_proto(m: pb.ImageFiles, common: dict[str, Any]) -> ImageFileSource:
    source = ImageFileSource(
        paths=tuple(m.paths),
        size=m.size,
        layout=_enum("layout", m.layout, LAYOUTS, pb.ImageLayout),
        classes=m.classes,
        crop=_enum("crop", m.crop, CROPS, pb.ImageCrop),
        scale=(m.scale_min, m.scale_max),
        ratio=(m.ratio_min, m.ratio_max),
        resize=m.resize,
        flip=m.flip,
        mean=tuple(m.mean),
        std=tuple(m.std),
        full_decode=m.full_decode,
        threads=m.threads,
        **common,
    )
    source.check_limits(LIMITS)
    return source


register(FileFormat("image_files", ImageFileSource, _to_proto, _from_proto))

"""Stand-in for torchvision.transforms (see the package doc)."""

import enum

from torchvision._stub import missing


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    return missing(__name__, name)

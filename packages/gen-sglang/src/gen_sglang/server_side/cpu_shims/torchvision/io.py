"""Stand-in for torchvision.io (see the package doc)."""

import enum

from torchvision._stub import missing


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    return missing(__name__, name)

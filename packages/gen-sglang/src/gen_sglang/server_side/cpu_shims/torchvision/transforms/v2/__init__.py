"""Stand-in (see the torchvision package doc)."""

from torchvision._stub import missing


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    return missing(__name__, name)

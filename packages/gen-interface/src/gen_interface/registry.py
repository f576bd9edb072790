"""Backend discovery through the ``gen_interface.backends`` entry-point group.

Backends are found lazily: nothing is scanned until a backend is asked for, and a backend's module
is imported only when that backend is built. Both the scan and the loaded classes are cached.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from gen_interface.errors import BackendUnavailableError, GenerationConfigError
from gen_interface.interface import GenerationInterface

__all__ = [
    "ENTRY_POINT_GROUP",
    "available_backends",
    "create_generation_backend",
    "load_backend",
]

ENTRY_POINT_GROUP = "gen_interface.backends"


@functools.cache
def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_backends() -> dict[str, str]:
    """Installed backends: ``{name: "module:attribute"}``. Nothing is imported."""
    return {name: ep.value for name, ep in sorted(_entry_points().items())}


@functools.cache
def load_backend(name: str) -> type[GenerationInterface]:
    """The backend class registered under ``name``.

    Raises:
        BackendUnavailableError: no backend has that name (the message lists the installed
            ones), its module fails to import, or it is not a ``GenerationInterface``.
    """
    entry = _entry_points().get(name)
    if entry is None:
        installed = ", ".join(available_backends()) or "none"
        raise BackendUnavailableError(
            f"no generation backend named {name!r}; installed: {installed}. Install the "
            f"package that provides it (e.g. gen-{name}) in this environment."
        )
    try:
        backend = entry.load()
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend {name!r} ({entry.value}) is installed but fails to import: {exc}"
        ) from exc
    if not (isinstance(backend, type) and issubclass(backend, GenerationInterface)):
        raise BackendUnavailableError(
            f"backend {name!r} points at {entry.value}, which is not a GenerationInterface"
        )
    return backend


def create_generation_backend(config: Mapping[str, Any], **kwargs: Any) -> GenerationInterface:
    """Build the backend named by ``config["backend"]`` without importing its package yourself.

    Args:
        config: a configured ``GenerationConfig`` (or a backend's extension of it).
        kwargs: passed to the backend's ``create`` (e.g. ``cluster=`` for vLLM).

    Raises:
        GenerationConfigError: the config names no backend.
        BackendUnavailableError: the named backend is not installed or fails to import.
    """
    name = config.get("backend")
    if not isinstance(name, str) or not name:
        raise GenerationConfigError(f"backend must name an installed backend, got {name!r}")
    return load_backend(name).create(dict(config), **kwargs)  # type: ignore[arg-type]

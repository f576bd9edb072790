"""Test helper: the repository's ``examples/*.py`` imported as modules, for the tests that run
them (each is loaded once per process; dataclasses need their module in ``sys.modules``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).parents[1] / "examples"


def load_example(stem: str) -> ModuleType:
    """``examples/<stem>.py`` as the module ``examples_<stem>``."""
    name = f"examples_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]

"""Fresh virtual environments for the release checks, built by uv from its cache.

Every environment gets the workspace's resolution settings (its ``exclude-newer`` date and its
overrides: the exact torch, no torchvision), so what is installed is what the workspace would
install, and nothing of the workspace's own environment leaks in. uv links packages from its
cache, so an environment with torch costs seconds, not a download.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from release_checks.workspace import ROOT

__all__ = ["Environment", "SetupFailed", "build_wheel", "uv"]


class SetupFailed(RuntimeError):
    """A command that builds an environment failed; the message holds its output."""


def _checked(command: list[str], cwd: Path | None = None) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SetupFailed(
            f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}{done.stderr}".rstrip()
        )


def uv() -> str:
    """The uv binary: the one running this check (``uv run`` says which), else on PATH."""
    found = os.environ.get("UV") or shutil.which("uv")
    if not found:
        raise RuntimeError("uv is needed for the release checks and none was found on PATH")
    return found


def _base_python() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _uv_settings(root: Path) -> tuple[list[str], str]:
    settings = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["uv"]
    return list(settings.get("override-dependencies", [])), str(settings["exclude-newer"])


class Environment:
    """A fresh virtual environment at ``path``, on this Python, with the workspace's settings."""

    def __init__(self, path: Path, root: Path = ROOT):
        self.path = path
        self.root = root
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._run([uv(), "venv", "--quiet", "--no-config", "--python", _base_python(), str(path)])
        overrides, self.exclude_newer = _uv_settings(root)
        self.overrides = path / "overrides.txt"
        self.overrides.write_text("\n".join(overrides) + "\n")

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def install(self, *requirements: str, resolution: str = "highest") -> None:
        """``uv pip install`` the requirements (paths, wheels or specifiers).

        Args:
            resolution: uv's ``--resolution``: ``"lowest-direct"`` takes the lowest version every
                direct requirement allows.

        Raises:
            SetupFailed: the requirements cannot be resolved or installed (the message holds
                uv's output, which says why).
        """
        self._run(
            [
                uv(),
                "pip",
                "install",
                "--quiet",
                "--no-config",
                "--no-sources",
                "--python",
                str(self.python),
                "--exclude-newer",
                self.exclude_newer,
                "--override",
                str(self.overrides),
                "--resolution",
                resolution,
                *requirements,
            ]
        )

    def run(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """Run this environment's Python with ``args``, outside the workspace (no source tree
        on its path); the result's output says what happened."""
        return subprocess.run(
            [str(self.python), *args],
            cwd=self.path,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
        )

    def _run(self, command: list[str]) -> None:
        _checked(command, cwd=self.path.parent)


def build_wheel(source: Path, out: Path) -> Path:
    """Build the wheel of the package at ``source`` into ``out`` (a directory of its own: a
    wheel already there is reused); returns its path."""
    built = sorted(out.glob("*.whl"))
    if built:
        return built[0]
    out.mkdir(parents=True, exist_ok=True)
    _checked(
        [
            uv(),
            "build",
            "--quiet",
            "--no-config",
            "--no-sources",
            "--wheel",
            "--out-dir",
            str(out),
            str(source),
        ]
    )
    (wheel,) = out.glob("*.whl")
    return wheel

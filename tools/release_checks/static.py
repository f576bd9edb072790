"""Every package builds on its own, lints clean and type-checks.

- ``uv build --package NAME --no-sources``: the sdist and wheel of each member, built as a user's
  installer would build them, without the workspace's sources;
- ``ruff check`` and ``ruff format --check`` over the whole tree;
- ``mypy`` over every package's sources.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from release_checks.environments import uv
from release_checks.workspace import ROOT, packages

__all__ = ["main"]


def _step(title: str, command: list[str], root: Path) -> bool:
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    print(f"{title}: {'ok' if done.returncode == 0 else 'FAILED'}")
    if done.returncode != 0:
        print("  " + (done.stdout + done.stderr).strip().replace("\n", "\n  "))
    return done.returncode == 0


def main(root: Path = ROOT, only: list[str] | None = None) -> int:
    """Build, lint and type-check every package (``only``: those named)."""
    members = {n: p for n, p in packages(root).items() if not only or n in only}
    ok = True
    with tempfile.TemporaryDirectory(prefix="build-") as out:
        for name in members:
            ok &= _step(
                f"build {name}",
                [uv(), "build", "--quiet", "--package", name, "--no-sources", "--out-dir", out],
                root,
            )
    python = sys.executable
    ok &= _step("ruff check", [python, "-m", "ruff", "check", "."], root)
    ok &= _step("ruff format --check", [python, "-m", "ruff", "format", "--check", "."], root)
    sources = [str(root / p.path / "src") for p in members.values()]
    ok &= _step(f"mypy ({len(sources)} packages)", [python, "-m", "mypy", *sources], root)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(only=sys.argv[1:] or None))

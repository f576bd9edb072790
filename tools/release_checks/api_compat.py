"""The public API of gen-interface and the kit against their last release: breaks are announced.

For each of ``INTERFACE_PACKAGES`` with a release, griffe compares the public API of the last
released version (built from its tag) with the working tree's. A break (a public name removed,
a parameter removed or made required, a type narrowed ...) must come with a version that
announces it: a new major version, or below 1.0 a new minor one (0.2 -> 0.3). A break under the
released version, or under a patch bump, fails the check, naming each break.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import griffe
from packaging.version import Version

from release_checks.workspace import (
    INTERFACE_PACKAGES,
    ROOT,
    packages,
    tag_name,
    tagged_versions,
    tree_at,
)

__all__ = ["ApiReport", "announces_break", "check_package", "main"]


@dataclass(frozen=True)
class ApiReport:
    """One package's comparison: the versions, the breaks found, and whether it passes."""

    package: str
    released: Version | None
    current: Version
    breaks: tuple[str, ...]

    @property
    def ok(self) -> bool:
        if self.released is None or not self.breaks:
            return True
        return announces_break(self.released, self.current)


def announces_break(released: Version, current: Version) -> bool:
    """``current`` may break ``released``'s API: a new major (>= 1.0) or minor (0.x) version."""
    if current.major != released.major:
        return current.major > released.major
    return current.major == 0 and current.minor > released.minor


def check_package(name: str, root: Path = ROOT) -> ApiReport:
    """Compare ``name``'s working tree with its latest release at or below its version."""
    package = packages(root)[name]
    releases = {v: c for v, c in tagged_versions(name, root).items() if v <= package.version}
    if not releases:
        return ApiReport(name, None, package.version, ())
    released = max(releases)
    with tempfile.TemporaryDirectory(prefix="api-") as scratch:
        old_tree = tree_at(releases[released], package.path, Path(scratch), root)
        old = _load(package.module, old_tree / "src")
        new = _load(package.module, root / package.path / "src")
        breaks = tuple(_describe(b) for b in griffe.find_breaking_changes(old, new))
    return ApiReport(name, released, package.version, breaks)


def _describe(breakage: griffe.Breakage) -> str:
    """``gen_interface.x.name: what broke: old -> new``, without colour or temporary paths."""
    line = f"{breakage.obj.path}: {breakage.kind.value}"
    old, new = breakage.old_value, breakage.new_value
    if old is not None and new is not None:
        return f"{line}: {_value(old)} -> {_value(new)}"
    return line


def _value(value: object) -> str:
    name = getattr(value, "name", None)
    return str(name if isinstance(name, str) else value)


def _load(module: str, source: Path) -> griffe.Object | griffe.Alias:
    return griffe.load(
        module,
        search_paths=[source],
        modules_collection=griffe.ModulesCollection(),
        allow_inspection=False,
        resolve_aliases=True,
        resolve_external=False,
    )


def main(root: Path = ROOT) -> int:
    failed = 0
    for name in INTERFACE_PACKAGES:
        report = check_package(name, root)
        if report.released is None:
            print(f"{name} {report.current}: no release yet, nothing to compare")
            continue
        against = tag_name(name, report.released)
        verdict = "ok" if report.ok else "FAILED"
        print(
            f"{name} {report.current} against {against}: {len(report.breaks)} break(s), {verdict}"
        )
        for line in report.breaks:
            print(f"  {line}")
        if not report.ok:
            failed += 1
            print(
                f"  {name}'s public API breaks {against} but its version {report.current} does "
                "not announce it: restore what broke, or bump the version (a new minor below "
                "1.0, a new major from 1.0) and say so in its CHANGELOG"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())

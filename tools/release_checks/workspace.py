"""The workspace as the release checks see it: packages, their versions, ranges and tags."""

from __future__ import annotations

import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

__all__ = [
    "INTERFACE_PACKAGES",
    "ROOT",
    "Package",
    "git",
    "packages",
    "read_package",
    "release_message",
    "tag_name",
    "tagged_versions",
    "tree_at",
]

ROOT = Path(__file__).resolve().parents[2]

#: The packages backends are built against, whose versions the others declare ranges of.
INTERFACE_PACKAGES = ("gen-interface", "gen-backend-kit")


@dataclass(frozen=True)
class Package:
    """One member of the workspace.

    Attributes:
        name: the distribution name (``gen-hf``).
        path: its directory, relative to the root (``packages/gen-hf``).
        version: the version its pyproject declares.
        requirements: its declared dependencies.
        entry_points: its ``gen_interface.backends`` entry points (name -> object).
    """

    name: str
    path: Path
    version: Version
    requirements: tuple[Requirement, ...]
    entry_points: dict[str, str]

    @property
    def module(self) -> str:
        return self.name.replace("-", "_")

    def requirement_on(self, other: str) -> Requirement | None:
        """Its requirement on the workspace package ``other``, or None."""
        return next((r for r in self.requirements if r.name == other), None)


def packages(root: Path = ROOT) -> dict[str, Package]:
    """Every workspace member under ``root/packages``, by name."""
    found = [
        read_package(p.parent, root) for p in sorted((root / "packages").glob("*/pyproject.toml"))
    ]
    return {package.name: package for package in found}


def read_package(directory: Path, root: Path = ROOT) -> Package:
    """The package whose ``pyproject.toml`` is in ``directory`` (inside ``root``)."""
    project = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
    return Package(
        name=project["name"],
        path=directory.relative_to(root),
        version=Version(project["version"]),
        requirements=tuple(Requirement(d) for d in project.get("dependencies", [])),
        entry_points=dict(project.get("entry-points", {}).get("gen_interface.backends", {})),
    )


def git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()


def tag_name(package: str, version: Version | str) -> str:
    """``gen-interface-v0.2.0``: the tag of a package's release."""
    return f"{package}-v{version}"


def release_message(package: str, version: Version | str) -> str:
    """The subject of a release commit (``tools/release.py`` writes it)."""
    return f"Release {package} {version}"


def tagged_versions(package: str, root: Path = ROOT) -> dict[Version, str]:
    """Every released version of ``package``: version -> the commit of its release.

    A release is its tag; a clone that came without tags (a shallow CI checkout, a mirror that
    carries branches only) still finds each release by its commit's subject, and the tag is
    made again locally so later tools see it.
    """
    found: dict[Version, str] = {}
    for line in git("tag", "--list", f"{package}-v*", root=root).splitlines():
        found[Version(line.removeprefix(f"{package}-v"))] = git(
            "rev-list", "-n", "1", line, root=root
        )
    pattern = re.compile(rf"^{re.escape(release_message(package, ''))}(\S+)$")
    log = git("log", "--format=%H %s", "--grep", f"^Release {package} ", root=root)
    for line in log.splitlines():
        commit, subject = line.split(" ", 1)
        match = pattern.match(subject)
        if match is None:
            continue
        version = Version(match.group(1))
        if version not in found:
            git("tag", tag_name(package, version), commit, root=root)
            found[version] = commit
    return found


def tree_at(commit: str, path: Path, dest: Path, root: Path = ROOT) -> Path:
    """Write ``path`` (a package directory) as it was at ``commit`` under ``dest``; returns it."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        f"git archive --format=tar {commit} {path} | tar -x -C {dest}",
        shell=True,
        cwd=root,
        check=True,
    )
    return dest / path

"""Release one package of the workspace: ``uv run python tools/release.py PACKAGE [VERSION]``.

A release is a version, a changelog entry and a git tag, per package; nothing is published.
The command:

1. takes VERSION (default: the version in the package's ``pyproject.toml``) and refuses one
   that is already tagged, or a package whose ``CHANGELOG.md`` has no ``## VERSION`` section;
2. writes VERSION into ``pyproject.toml`` and dates the changelog's section
   (``## 0.2.0 (unreleased)`` -> ``## 0.2.0 (2026-12-06)``);
3. for gen-interface and gen-backend-kit, runs the API check against their last release
   (``tools/release_checks/api_compat.py``): a break the new version does not announce stops
   the release;
4. commits those two files alone as ``Release PACKAGE VERSION`` and tags the commit
   ``PACKAGE-vVERSION``.

RELEASING.md says when to release which package and how dependents declare what they support.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from packaging.version import Version
from release_checks import api_compat
from release_checks.workspace import (
    INTERFACE_PACKAGES,
    ROOT,
    git,
    packages,
    release_message,
    tag_name,
    tagged_versions,
)


class ReleaseRefused(SystemExit):
    """The release cannot go ahead; the message says why and what to do."""


def release(name: str, version: Version | None = None, root: Path = ROOT) -> str:
    """Release ``name``; returns the tag made."""
    members = packages(root)
    if name not in members:
        raise ReleaseRefused(f"no package {name!r}; the workspace has {sorted(members)}")
    package = members[name]
    version = version or package.version
    if version in tagged_versions(name, root):
        raise ReleaseRefused(f"{tag_name(name, version)} exists: choose a newer version")
    changelog = root / package.path / "CHANGELOG.md"
    text = changelog.read_text()
    heading = re.compile(rf"^## {re.escape(str(version))}( \(unreleased\))?$", re.M)
    if not heading.search(text):
        raise ReleaseRefused(
            f"{changelog.relative_to(root)} has no '## {version}' section: say what the release "
            "changes first"
        )
    today = datetime.date.today().isoformat()
    changelog.write_text(heading.sub(f"## {version} ({today})", text, count=1))
    pyproject = root / package.path / "pyproject.toml"
    declared = re.compile(r'^version = ".*"$', re.M)
    pyproject.write_text(declared.sub(f'version = "{version}"', pyproject.read_text(), count=1))
    if name in INTERFACE_PACKAGES:
        report = api_compat.check_package(name, root)
        if not report.ok:
            git("checkout", "--", str(changelog), str(pyproject), root=root)
            breaks = "\n  ".join(report.breaks)
            raise ReleaseRefused(
                f"{name} {version} breaks {report.released} without announcing it:\n  {breaks}"
            )
    git("add", str(changelog), str(pyproject), root=root)
    git("commit", "--quiet", "-m", release_message(name, version), root=root)
    tag = tag_name(name, version)
    git("tag", tag, root=root)
    return tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("version", nargs="?", type=Version)
    args = parser.parse_args()
    print(f"tagged {release(args.package, args.version)}")


if __name__ == "__main__":
    main()

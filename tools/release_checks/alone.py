"""Each package installed alone in a fresh environment: it imports and passes its smoke test.

"Alone" means the package with only what it declares: the workspace packages it requires, built
from the working tree, and its registry dependencies (with the workspace's torch pin, from uv's
cache). A module that imports something undeclared fails here, as it would for a user who
installs the package by itself; the workspace's tests cannot see that, since the workspace
installs everything together. gen-interface's smoke test is a training loop's imports, checked
to load no kit, backend or engine module.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from release_checks.environments import Environment, SetupFailed
from release_checks.lowest import EXTRAS, SMOKE
from release_checks.workspace import ROOT, Package, packages

__all__ = ["check", "main", "workspace_requirements"]


def workspace_requirements(package: Package, members: dict[str, Package]) -> list[Package]:
    """The workspace packages ``package`` needs, directly or through another one."""
    needed: dict[str, Package] = {}
    pending = [package]
    while pending:
        current = pending.pop()
        for requirement in current.requirements:
            member = members.get(requirement.name)
            if member is not None and member.name not in needed:
                needed[member.name] = member
                pending.append(member)
    return list(needed.values())


def check(package: Package, scratch: Path, root: Path = ROOT) -> tuple[bool, str, float]:
    """``(passed, what it printed, seconds)`` for ``package`` installed alone."""
    started = time.perf_counter()
    members = packages(root)
    paths = [str(root / p.path) for p in workspace_requirements(package, members)]
    try:
        environment = Environment(scratch / f"alone-{package.name}", root)
        environment.install(*paths, f"{root / package.path}{EXTRAS.get(package.name, '')}")
    except SetupFailed as failed:
        return False, str(failed), time.perf_counter() - started
    done = environment.run(str(SMOKE), package.name)
    if done.returncode == 0:
        detail = (done.stdout.strip().splitlines() or [""])[-1]
    else:
        detail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
    return done.returncode == 0, detail, time.perf_counter() - started


def main(root: Path = ROOT, only: list[str] | None = None) -> int:
    failed = 0
    with tempfile.TemporaryDirectory(prefix="alone-") as scratch:
        for package in packages(root).values():
            if only and package.name not in only:
                continue
            ok, detail, seconds = check(package, Path(scratch), root)
            print(f"{package.name} alone: {'ok' if ok else 'FAILED'} ({seconds:.0f} s)")
            print("  " + detail.replace("\n", "\n  "))
            failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(only=sys.argv[1:] or None))

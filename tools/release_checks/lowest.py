"""Each dependent package against the lowest gen-interface and kit it declares.

For every package that requires gen-interface or gen-backend-kit (the workspace's and the
outside backend of ``tests/fixtures/gen-toy``), the lowest version its range admits among the
released ones (their tags) and the working tree's own is built from its tag, installed in a
fresh environment beside the package with uv's ``lowest-direct`` resolution, and the package's
smoke test runs there (``smoke.py``). A package that uses a name newer than the lowest version it
declares fails here: it does not import, or its smoke test breaks.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from release_checks.environments import Environment, SetupFailed, build_wheel
from release_checks.workspace import (
    INTERFACE_PACKAGES,
    ROOT,
    Package,
    packages,
    read_package,
    tagged_versions,
    tree_at,
)

__all__ = ["EXTRAS", "OUTSIDE_BACKENDS", "LowestResult", "check", "lowest_versions", "main"]

#: The extra each package needs to run on this machine (vLLM's CPU build).
EXTRAS = {"gen-vllm": "[cpu]"}
#: Backends outside the workspace that the checks treat as dependents too.
OUTSIDE_BACKENDS = (Path("tests/fixtures/gen-toy"),)
SMOKE = Path(__file__).with_name("smoke.py")


@dataclass(frozen=True)
class LowestResult:
    package: str
    versions: dict[str, Version]
    ok: bool
    detail: str
    seconds: float


def lowest_versions(package: Package, root: Path = ROOT) -> dict[str, tuple[Version, str | None]]:
    """For each interface package ``package`` requires: the lowest version its range admits,
    and the commit of that release (None: the working tree's version, not released yet).

    Raises:
        SetupFailed: no released or working-tree version lies in the declared range.
    """
    out: dict[str, tuple[Version, str | None]] = {}
    members = packages(root)
    for name in INTERFACE_PACKAGES:
        requirement = package.requirement_on(name)
        if requirement is None:
            continue
        candidates: dict[Version, str | None] = dict(tagged_versions(name, root))
        candidates.setdefault(members[name].version, None)
        admitted = sorted(v for v in candidates if requirement.specifier.contains(v, True))
        if not admitted:
            raise SetupFailed(
                f"{package.name} requires {requirement} but {name} has no such version: released "
                f"{sorted(map(str, candidates))}"
            )
        out[name] = (admitted[0], candidates[admitted[0]])
    return out


def check(package: Package, scratch: Path, root: Path = ROOT) -> LowestResult:
    """Install ``package`` beside its lowest declared interface packages and smoke-test it."""
    started = time.perf_counter()
    members = packages(root)
    try:
        lowest = lowest_versions(package, root)
        wheels = []
        for name, (version, commit) in lowest.items():
            member = members[name]
            source = root / member.path
            if commit is not None:
                source = tree_at(commit, member.path, scratch / f"{name}-{version}", root)
            origin = "tag" if commit is not None else "tree"
            wheels.append(str(build_wheel(source, scratch / f"wheels-{name}-{version}-{origin}")))
        environment = Environment(scratch / f"env-{package.name}", root)
        environment.install(
            *wheels,
            f"{root / package.path}{EXTRAS.get(package.name, '')}",
            resolution="lowest-direct",
        )
    except SetupFailed as failed:
        detail = "\n".join(_reasons(str(failed)))
        return LowestResult(package.name, {}, False, detail, time.perf_counter() - started)
    done = environment.run(str(SMOKE), package.name)
    versions = {name: version for name, (version, _) in lowest.items()}
    if done.returncode == 0:
        detail = (done.stdout.strip().splitlines() or [""])[-1]
    else:
        detail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
    return LowestResult(
        package.name, versions, done.returncode == 0, detail, time.perf_counter() - started
    )


def _reasons(output: str) -> list[str]:
    """uv's own account of a failed install: its ``error``, ``cause`` and ``hint`` lines."""
    lines = output.splitlines()
    kept = [line for line in lines if line.lstrip().startswith(("error", "cause", "hint"))]
    return [lines[0][:200], *kept[:10]] if kept else lines[-12:]


def dependents(root: Path = ROOT) -> list[Package]:
    """Every package that requires an interface package, the outside backends last."""
    found = [
        p
        for p in packages(root).values()
        if any(p.requirement_on(name) for name in INTERFACE_PACKAGES)
    ]
    return found + [read_package(root / path, root) for path in OUTSIDE_BACKENDS]


def main(root: Path = ROOT, only: list[str] | None = None) -> int:
    failed = 0
    with tempfile.TemporaryDirectory(prefix="lowest-") as scratch:
        for package in dependents(root):
            if only and package.name not in only:
                continue
            result = check(package, Path(scratch), root)
            against = ", ".join(f"{n} {v}" for n, v in result.versions.items())
            verdict = "ok" if result.ok else "FAILED"
            print(f"{package.name} on {against or '?'}: {verdict} ({result.seconds:.0f} s)")
            print("  " + result.detail.replace("\n", "\n  "))
            failed += not result.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(only=sys.argv[1:] or None))

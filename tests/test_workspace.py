"""Cross-package checks on the workspace's shape, over every package."""

import tomllib
from importlib.metadata import version

import pytest
from release_checks.workspace import INTERFACE_PACKAGES, ROOT, packages

PACKAGES = sorted(packages())
DEPENDENTS = [name for name in PACKAGES if name not in INTERFACE_PACKAGES]


def test_the_workspace_has_every_package():
    assert PACKAGES == [
        "gen-backend-kit",
        "gen-hf",
        "gen-interface",
        "gen-remote",
        "gen-serve",
        "gen-sglang",
        "gen-testkit",
        "gen-vllm",
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_is_versioned_on_its_own_and_typed(package):
    member = packages()[package]
    assert version(package) == str(member.version)
    assert (ROOT / member.path / "src" / member.module / "py.typed").is_file()
    for name in ("README.md", "CHANGELOG.md"):
        assert (ROOT / member.path / name).stat().st_size > 0
    changelog = (ROOT / member.path / "CHANGELOG.md").read_text()
    assert f"## {member.version}" in changelog, f"{package}'s CHANGELOG has no {member.version}"


@pytest.mark.parametrize("package", ["gen-backend-kit", *DEPENDENTS])
def test_dependents_take_the_interface_and_kit_by_a_compatible_range(package):
    member = packages()[package]
    required = [r for r in member.requirements if r.name in INTERFACE_PACKAGES]
    assert required, f"{package} requires neither gen-interface nor the kit"
    for requirement in required:
        operators = {s.operator for s in requirement.specifier}
        assert operators == {">=", "<"}, f"{package}: {requirement} is not a range"
        assert requirement.specifier.contains(packages()[requirement.name].version)


@pytest.mark.parametrize("package", ["gen-hf", "gen-vllm", "gen-sglang", "gen-remote"])
def test_backends_build_on_the_kit_and_the_interface_on_nothing_of_ours(package):
    assert packages()[package].requirement_on("gen-backend-kit") is not None
    interface = packages()["gen-interface"]
    assert not any(r.name.startswith("gen-") for r in interface.requirements)


def test_gen_serve_needs_no_kit_and_no_backend():
    assert {r.name for r in packages()["gen-serve"].requirements if r.name.startswith("gen-")} == {
        "gen-interface"
    }


def test_uv_lock_is_ignored_and_resolution_is_pinned():
    assert "uv.lock" in (ROOT / ".gitignore").read_text().split()
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert root["tool"]["uv"]["exclude-newer"]
    pins = " ".join(str(r) for p in packages().values() for r in p.requirements)
    for name in ("torch==", "ray==", "transformers=="):
        assert name in pins, name

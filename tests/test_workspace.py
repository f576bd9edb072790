"""Cross-package checks on the workspace's shape."""

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["gen-interface", "gen-hf", "gen-vllm", "gen-testkit"]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_is_versioned_on_its_own_and_typed(package):
    project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    assert version(package) == project["version"]
    module = package.replace("-", "_")
    assert (ROOT / "packages" / package / "src" / module / "py.typed").is_file()
    for name in ("README.md", "CHANGELOG.md"):
        assert (ROOT / "packages" / package / name).stat().st_size > 0


@pytest.mark.parametrize("package", ["gen-hf", "gen-vllm", "gen-testkit"])
def test_dependents_take_gen_interface_by_a_compatible_range(package):
    project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    (requirement,) = [d for d in project["dependencies"] if d.startswith("gen-interface")]
    assert "==" not in requirement and ">=" in requirement and "<" in requirement


def test_uv_lock_is_ignored_and_resolution_is_pinned():
    assert "uv.lock" in (ROOT / ".gitignore").read_text().split()
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert root["tool"]["uv"]["exclude-newer"]
    pins = " ".join(
        d
        for package in PACKAGES
        for d in tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())[
            "project"
        ].get("dependencies", [])
    )
    for name in ("torch==", "ray==", "transformers=="):
        assert name in pins, name

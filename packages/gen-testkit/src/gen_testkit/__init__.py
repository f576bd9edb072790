"""gen-testkit: conformance suite, strategies, tiny models and parity checks for generation
backends.

The submodules are imported on demand: ``gen_testkit.conformance`` (the suite),
``gen_testkit.strategies`` (hypothesis strategies), ``gen_testkit.models`` (tiny models),
``gen_testkit.ngram`` (a pure-torch backend), ``gen_testkit.compare`` and
``gen_testkit.tolerances``.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gen-testkit")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["__version__"]

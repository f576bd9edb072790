"""gen-serve: any gen-interface backend behind vLLM's own HTTP protocol.

``gen-serve --backend hf --model DIR`` serves ``/v1/completions``, ``/v1/chat/completions``,
``/inference/v1/generate``, the tokenizer routes and the RL control and weight routes, with
vLLM's request and response shapes. Backends are found by entry point; this package imports
none of them.
"""

from importlib.metadata import PackageNotFoundError, version

from gen_serve.app import build_app, sampling_defaults
from gen_serve.codec import TextCodec
from gen_serve.state import ServerSettings

try:
    __version__ = version("gen-serve")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["ServerSettings", "TextCodec", "__version__", "build_app", "sampling_defaults"]

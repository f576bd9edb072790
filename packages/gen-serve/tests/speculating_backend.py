"""A speculating n-gram backend (the testkit's reference speculative decoder: a drafter n-gram
model verified by the target) and a gen-serve server over it, on a thread of this process: what
the speculation tests of gen-serve and gen-remote need, with no engine to start."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fleet_backend import ngram_app, ngram_config
from gen_testkit.ngram import NgramGeneration
from servers import ServerThread

__all__ = ["SPECULATIVE", "speculating_config", "speculating_server"]

#: The speculative section the server runs (``model`` is a label, as the n-gram's name is).
SPECULATIVE = {"method": "draft_model", "model": "ngram-drafter", "num_speculative_tokens": 3}


def speculating_config(**extra: Any) -> dict[str, Any]:
    """The n-gram config with ``SPECULATIVE`` (``extra`` overrides any key)."""
    return {**ngram_config(), "speculative": dict(SPECULATIVE), **extra}


def speculating_server() -> Iterator[ServerThread]:
    """gen-serve over a speculating n-gram backend (no tokenizer: token-id prompts only), for
    a module-scoped fixture: yields the server, then stops it and shuts the backend down."""
    backend = NgramGeneration(speculating_config())  # type: ignore[arg-type]
    thread = ServerThread(ngram_app(backend))
    yield thread
    thread.stop()
    backend.shutdown()

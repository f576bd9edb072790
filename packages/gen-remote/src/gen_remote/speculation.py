"""Speculative decoding over the wire: the server's setting, checked, and its metrics, forwarded.

Speculation is the server backend's setting, as ``logprobs_mode`` is: a client's ``speculative``
must equal the server's or be left out (then the server's is taken), and a client of a server
that speculates reports the server's ``speculative_*`` metrics (gen-backend-kit's
``speculation``) in its own ``get_logger_metrics()``, read from the server's ``/metrics``.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from collections.abc import Mapping
from typing import Any

from gen_interface import GenerationConfigError, GenerationError

from gen_remote.server import ServerInfo
from gen_remote.wire import Wire

__all__ = ["ServerSpeculation", "check_speculation", "with_server_speculation"]

logger = logging.getLogger(__name__)

#: The counters a speculating backend reports; the two ratios are computed from them.
_TOTALS = (
    "speculative_drafts_total",
    "speculative_proposed_tokens_total",
    "speculative_accepted_tokens_total",
)
#: One sample of the server backend's speculative metrics in ``/metrics``' text.
_SAMPLE = re.compile(r"^gen:backend_(speculative_[A-Za-z0-9_]+?)(?:\{[^}]*\})?\s+(\S+)\s*$")


def with_server_speculation(
    out: dict[str, Any], given: Mapping[str, Any], server: ServerInfo
) -> None:
    """``out["speculative"]`` is the server's when ``given`` leaves ``speculative`` out."""
    if "speculative" not in given and server.config.get("speculative") is not None:
        out["speculative"] = copy.deepcopy(server.config["speculative"])


def check_speculation(config: Mapping[str, Any], server: ServerInfo) -> None:
    """Refuse a ``speculative`` the server does not run.

    Raises:
        GenerationConfigError: ``speculative`` differs from the server backend's (saying what
            the server runs), or is set for vLLM's own server, which does not say.
    """
    here = config.get("speculative")
    if server.dialect != "gen-serve":
        if here is not None:
            raise GenerationConfigError(
                f"speculative is {here!r}, but vLLM's own server does not say what it "
                "speculates with: leave speculative out (vllm serve's --speculative-config is "
                "the server's setting), or use a gen-serve server"
            )
        return
    there = server.config.get("speculative")
    if here != there:
        runs = f"runs speculative {there!r}" if there else "runs no speculative decoding"
        raise GenerationConfigError(
            f"speculative is {here!r} here but the server's backend ({server.backend}) {runs}; "
            "speculation is the server's setting: leave speculative out to take the server's, "
            f"or start the server with speculative {here!r} (gen-serve --speculative JSON)"
        )


class ServerSpeculation:
    """The server backend's ``speculative_*`` metrics since this client's last ``clear``.

    The totals are the server's, across every client it serves; ``clear`` cannot reset them
    there (other clients read them too), so this client reports them less what they were at its
    last ``clear``, and the acceptance rate and mean accepted length of that difference.
    """

    def __init__(self, wire: Wire):
        self._wire = wire
        self._lock = threading.Lock()
        self._baseline: dict[str, float] = dict.fromkeys(_TOTALS, 0.0)

    def read(self) -> dict[str, float]:
        """Every ``gen:backend_speculative_*`` value of the server's ``/metrics`` now, by the
        backend's name.

        Raises:
            GenerationError (or a subclass): the server did not answer.
        """
        text = self._wire.call("GET", "/metrics")
        values: dict[str, float] = {}
        for line in str(text).splitlines():
            found = _SAMPLE.match(line)
            if found:
                values[found.group(1)] = float(found.group(2))
        return values

    def metrics(self) -> dict[str, int | float]:
        """The server's speculative metrics since the last ``clear`` (``{}``, with a warning
        in the log, when the server does not answer: logging goes on)."""
        try:
            values = self.read()
        except GenerationError as exc:
            logger.warning("the server's speculative metrics are left out: %s", exc)
            return {}
        if not all(name in values for name in _TOTALS):
            return {}
        with self._lock:
            if any(values[name] < self._baseline[name] for name in _TOTALS):
                self._baseline = dict.fromkeys(_TOTALS, 0.0)  # the server's were cleared
            drafts, proposed, accepted = (int(values[n] - self._baseline[n]) for n in _TOTALS)
        out: dict[str, int | float] = {  # others as they are (the drafter's weight version)
            name: int(value) if value.is_integer() else value
            for name, value in values.items()
            if name not in _TOTALS
        }
        out.update(
            {
                "speculative_drafts_total": drafts,
                "speculative_proposed_tokens_total": proposed,
                "speculative_accepted_tokens_total": accepted,
                "speculative_acceptance_rate": accepted / proposed if proposed else 0.0,
                "speculative_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            }
        )
        return out

    def clear(self) -> None:
        """Count from the server's totals now (left as they were when it does not answer)."""
        try:
            values = self.read()
        except GenerationError as exc:
            logger.warning("the server's speculative metrics could not be read to clear: %s", exc)
            return
        if all(name in values for name in _TOTALS):
            with self._lock:
                self._baseline = {name: values[name] for name in _TOTALS}

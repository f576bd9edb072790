"""``ServerInfo``: what the client learns from the server when it connects."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from gen_interface import BackendCapabilities, GenerationConfigError, GenerationError

from gen_remote.wire import Wire

__all__ = ["ServerInfo"]

#: vLLM's default ``--max-logprobs``.
_VLLM_MAX_LOGPROBS = 20


@dataclass(frozen=True)
class ServerInfo:
    """One server, as it describes itself.

    Attributes:
        dialect: ``"gen-serve"`` (this project's server) or ``"vllm"`` (vLLM's own).
        model_name: the name the server answers to.
        backend: the backend behind a gen-serve server (``"vllm"`` for vLLM's own).
        host: the server's host name (shared memory reaches it only from the same host).
        config: the server backend's config (gen-serve only; empty for vLLM).
        capabilities: the server backend's ``BackendCapabilities`` fields (gen-serve only).
        vocab_size, context_limit: token ids must lie below one, rows fit in the other (None:
            unknown, the server checks).
        max_top_logprobs: the most top logprobs a row may ask of the server.
        eos_token_id: the model's end of sequence, when known.
        has_tokenizer: the server can tokenise (stop strings, ``generate_text``).
        weight_routes, control_routes: the server serves them.
        routed_experts: ``(MoE layers, top_k)`` when the server's rows carry their routed
            experts, else None.
    """

    dialect: str
    model_name: str
    backend: str
    host: str | None
    config: dict[str, Any] = field(default_factory=dict)
    capabilities: dict[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None
    context_limit: int | None = None
    max_top_logprobs: int = _VLLM_MAX_LOGPROBS
    eos_token_id: int | None = None
    has_tokenizer: bool = True
    weight_routes: bool = False
    weight_deltas: bool = False  # the server answers /weight_base (gen-serve 0.1.1 and later)
    control_routes: bool = False
    routed_experts: tuple[int, int] | None = None

    @classmethod
    def fetch(cls, wire: Wire, dialect: str) -> ServerInfo:
        """Ask the server. ``dialect`` ``"auto"``: gen-serve when ``/backend_info`` answers.

        Raises:
            BackendUnavailableError: the server cannot be reached.
            GenerationConfigError: the server is not of the dialect named.
        """
        if dialect in ("auto", "gen-serve"):
            try:
                info = wire.call("GET", "/backend_info")
            except GenerationConfigError as exc:  # 404: not a gen-serve server
                if dialect == "gen-serve":
                    raise GenerationConfigError(
                        f"remote_cfg.dialect is 'gen-serve', but {wire.base_url} has no "
                        f"/backend_info ({exc}); is it vLLM's own server? Use dialect 'vllm'"
                    ) from exc
            else:
                return cls(
                    dialect="gen-serve",
                    model_name=info["model_name"],
                    backend=info["backend"],
                    host=info["host"],
                    config=info["config"],
                    capabilities=info["capabilities"],
                    vocab_size=info["vocab_size"],
                    context_limit=info["context_limit"],
                    max_top_logprobs=int(info["max_top_logprobs"]),
                    eos_token_id=info["eos_token_id"],
                    has_tokenizer=bool(info["has_tokenizer"]),
                    weight_routes=bool(info["weight_routes"]),
                    weight_deltas=bool(info.get("weight_deltas", False)),
                    control_routes=bool(info["control_routes"]),
                    routed_experts=_pair(info.get("routed_experts")),
                )
        models = wire.call("GET", "/v1/models").get("data") or []
        if not models:
            raise GenerationError(f"the server at {wire.base_url} serves no model (/v1/models)")
        return cls(
            dialect="vllm",
            model_name=models[0]["id"],
            backend="vllm",
            host=None,
            context_limit=models[0].get("max_model_len"),
        )

    @property
    def same_host(self) -> bool:
        """The server runs on this machine (its shared memory is ours)."""
        return self.host is not None and self.host == socket.gethostname()

    def backend_capabilities(self) -> BackendCapabilities:
        """What a client of this server can do (see the README's table)."""
        if self.dialect == "vllm":
            return BackendCapabilities(
                async_generation=True,
                token_streaming=True,
                score=True,
                stop_strings=True,
                devices=(),
                notes=(
                    "vLLM's own server: no weight updates through this client (vLLM's weight "
                    "routes carry no checksums and no transaction), no per-token weight "
                    "versions, no staleness bound; finish and prepare change only this client",
                    "sampled rows draw from vLLM's seeds, not this project's: seeded rows "
                    "repeat, but differ from another backend's",
                ),
            )
        caps = self.capabilities
        transports: set[Any] = set()
        if self.weight_routes:
            if self.same_host:
                transports |= set(caps["weight_transports"]) & {"shm", "cuda_ipc"}
            transports |= set(caps["weight_transports"]) & {"collective"}
        notes = [f"the server's backend ({self.backend}): {note}" for note in caps["notes"]]
        if self.weight_routes and not self.same_host:
            notes.append(
                f"the server runs on {self.host!r}, not here: weights travel by the collective "
                "path (WeightBroadcaster), not shared memory"
            )
        return BackendCapabilities(
            sleep=bool(caps["sleep"]) and self.control_routes,
            async_generation=True,
            weight_transports=frozenset(transports),
            devices=tuple(caps["devices"]),
            score=bool(caps["score"]),
            stop_strings=bool(caps["stop_strings"]) and self.has_tokenizer,
            in_flight_updates=bool(caps["in_flight_updates"]) and self.weight_routes,
            token_streaming=bool(caps["token_streaming"]),
            refit_bucket_bytes=int(caps["refit_bucket_bytes"]),
            refit_buffers=int(caps["refit_buffers"]),
            batch_invariant=bool(self.config.get("batch_invariant")),
            routed_experts=self.routed_experts is not None,
            speculative=self.speculative_methods(),
            notes=tuple(notes),
        )

    def speculative_methods(self) -> frozenset[str]:
        """The ``speculative.method`` a client of this server honours: the one its backend runs
        (a client's ``speculative`` must equal the server's), none when it runs none."""
        section = self.config.get("speculative")
        if self.dialect != "gen-serve" or not isinstance(section, dict):
            return frozenset()
        offered = set(self.capabilities.get("speculative") or ())
        return frozenset({section["method"]}) & frozenset(offered)


def _pair(value: Any) -> tuple[int, int] | None:
    return None if value is None else (int(value[0]), int(value[1]))

"""NeMo RL's generation keys that ``GenerationConfig`` does not declare: the one place the core
knows NeMo RL's config.

A config written for NeMo RL carries them. Each is either accepted because it changes nothing
here (the training loop reads it, or its value is the "off" one), or refused with why and what
to use instead: never silently ignored. Keys that NeMo RL and this project share are declared in
``GenerationConfig`` itself; backends add their own levels (gen-vllm: ``vllm_cfg``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gen_interface.schema import ForeignKey, ForeignKeys

__all__ = [
    "NEMO_RL_GENERATION_KEYS",
    "NEMO_RL_KEYS",
    "TRAINING_LOOP_KEYS",
    "falsy",
    "with_nemo_rl_keys",
]

#: Keys a NeMo RL config carries for its training loop, not for the generator: accepted, unread.
TRAINING_LOOP_KEYS = ("val_temperature", "val_top_p", "val_top_k")


def falsy(reason: str) -> ForeignKey:
    """A feature switch or setting this project lacks: off (null, false, empty) is accepted."""
    return ForeignKey(reason, lambda value: not value)


_QUANTISED = "quantised rollouts (ModelOpt) are not supported: generate in the model's dtype"
_NO_SERVER = (
    "ports of NeMo RL's HTTP and ZMQ servers; this project opens none (weights arrive through "
    "update_weights_from_ipc_handles, gen_interface.weights.Refitter or WeightBroadcaster)"
)

#: Top-level NeMo RL keys -> what happens to them here.
NEMO_RL_GENERATION_KEYS: dict[str, ForeignKey] = {
    **{
        key: ForeignKey("read by the training loop (validation sampling), not by the generator")
        for key in TRAINING_LOOP_KEYS
    },
    "tokenizer": ForeignKey(
        "the tokenizer NeMo RL's training loop builds (its name, chat template); the loop passes "
        "it to configure_generation_config, and backends that need one load the model's own"
    ),
    "_pad_token_id": ForeignKey(
        "NeMo RL's configure_generation_config writes it; here the pad token is `pad_token_id`, "
        "filled from the tokenizer the same way"
    ),
    "bad_words": falsy(
        "banned words would change the sampling distribution, and only some backends can ban "
        "them; leave it out and penalise those words in the reward instead"
    ),
    "port_range_low": ForeignKey(_NO_SERVER),
    "port_range_high": ForeignKey(_NO_SERVER),
    "use_async_rollouts": falsy(
        "SGLang's switch; here every backend streams rows through generate_async without one"
    ),
    "refit_transport": falsy(
        "the transport is chosen by the call, not the config: update_weights_from_ipc_handles "
        "(or gen_interface.weights.Refitter) when colocated, WeightBroadcaster across machines"
    ),
    "refit_cfg": ForeignKey(
        "settings of the transports refit_transport chooses, which are refused; the calls here "
        "take their settings as arguments"
    ),
    "mcore_generation_config": ForeignKey(
        "settings of NeMo RL's Megatron generation backend, read only with backend: megatron"
    ),
    "quant_cfg": falsy(_QUANTISED),
    "real_quant": falsy(_QUANTISED),
    "real_quant_export_cpu_offload": ForeignKey(f"applies to real_quant only: {_QUANTISED}"),
    "real_quant_ignore": falsy(_QUANTISED),
    "_mtp_weights_from_refit": falsy("multi-token-prediction draft weights are not supported"),
    "_debug_payload_metrics": falsy("NeMo RL's internal refit metrics have no equivalent here"),
}


def _no_placement(value: object) -> bool:
    return isinstance(value, Mapping) and all(v is None for v in value.values())


#: Every level's NeMo RL keys that ``GenerationConfig`` does not declare (see ``check_config``).
NEMO_RL_KEYS: ForeignKeys = {
    "": NEMO_RL_GENERATION_KEYS,
    "colocated": {
        "resources": ForeignKey(
            "generation GPUs of its own are placed by the backend's create() (gen-vllm: "
            "cluster= or replicas=), not by the config; leave gpus_per_node and num_nodes null",
            _no_placement,
        )
    },
}


def with_nemo_rl_keys(foreign: ForeignKeys) -> dict[str, dict[str, ForeignKey]]:
    """A backend's own foreign keys plus NeMo RL's, level by level (the backend's win)."""
    levels = {level: dict(keys) for level, keys in foreign.items()}
    for level, keys in NEMO_RL_KEYS.items():
        levels[level] = {**keys, **levels.get(level, {})}
    return levels

"""The TypedDicts that cross the interface: the config, the input batch and the output batch.

Shapes use ``B`` for the batch size, ``S`` for the padded prompt length and ``L`` for the padded
output length. See ``CONTRACT.md`` for the full semantics; the comments here are the summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

if TYPE_CHECKING:
    import torch

__all__ = [
    "ColocatedConfig",
    "DType",
    "DraftSampleMethod",
    "GenerationConfig",
    "GenerationDatumSpec",
    "GenerationOutputSpec",
    "LogprobsMode",
    "ScoreOutputSpec",
    "ScoreSpec",
    "SpeculativeConfig",
    "SpeculativeMethod",
]

LogprobsMode = Literal["raw", "processed"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


class ColocatedConfig(TypedDict, total=False):
    """Whether generation shares its devices with training.

    When ``enabled``, ``finish_generation`` gives back as much device memory as the backend can
    (vLLM sleep, weights moved off the GPU) because a trainer is about to use it.
    """

    enabled: bool


class LoraConfig(TypedDict, total=False):
    """A LoRA adapter served on top of the base model and refitted on its own.

    Each target linear layer ``W`` computes ``W x + (alpha / rank) * B (A x)``. Either name a
    PEFT adapter directory (``adapter_path``: its ``adapter_config.json`` gives the other three
    and its weights the first adapter), or give ``rank``, ``alpha`` and ``target_modules`` (the
    adapter then starts at zero: the base model's outputs).
    """

    rank: int  # r >= 1
    alpha: float  # > 0; the adapter's output is scaled by alpha / rank
    target_modules: list[str]  # last names of the linear layers adapted, e.g. ["q_proj", "v_proj"]
    adapter_path: str | None  # a PEFT adapter directory


SpeculativeMethod = Literal["draft_model", "ngram", "mtp", "eagle", "eagle3"]
DraftSampleMethod = Literal["greedy", "probabilistic"]


class SpeculativeConfig(TypedDict, total=False):
    """Speculative decoding: a drafter proposes tokens that the policy (the target) verifies.

    Lossless by contract: greedy rows equal the same call without speculation, sampled rows
    follow the target's distribution at every position, and every reported logprob is the
    target's. A row's seed still makes it reproducible, but the tokens it draws differ from the
    same seed's without speculation (the acceptance test draws from the same stream).
    vLLM's names: NeMo RL passes the same keys as ``vllm_kwargs.speculative_config``.
    """

    # "draft_model": a smaller model with the target's vocabulary (``model``); "ngram": tokens
    # looked up in the row's own prompt and output (no weights); "mtp" / "eagle" / "eagle3": the
    # model's own prediction heads, or an EAGLE head at ``model``, where the backend offers them
    method: SpeculativeMethod
    model: str | None  # the drafter's model directory (draft_model, eagle, eagle3)
    num_speculative_tokens: int  # >= 1: tokens proposed per verifying step
    prompt_lookup_min: int  # ngram: shortest suffix matched (>= 1)
    prompt_lookup_max: int  # ngram: longest suffix matched (>= prompt_lookup_min)
    # how a drafter model proposes for sampled rows: "greedy" (vLLM's default) its argmax,
    # verified as certain (accepted with the target's probability of it: seldom at temperature
    # 1); "probabilistic" draws from its distribution and verifies with the ratio test (accepted
    # as often as drafter and target agree). Both are lossless and a seed reproduces a row
    # under either; unset: the backend's default (its README says which)
    draft_sample_method: DraftSampleMethod
    # vLLM's dynamic speculation: ``[[first, last, k], ...]``, inclusive ranges of batch size
    # (the rows an engine step holds) from 1 up, each with the draft tokens proposed at that size
    # (0 <= k <= num_speculative_tokens; 0: no drafts, though a drafter model may still run to
    # keep its cache); a size between two ranges or past the last takes the k of the range below
    # it. For batch sizes where a verifying step costs more than its accepted drafts save;
    # ``tools/bench/speculative.py`` measures which. None: always num_speculative_tokens
    num_speculative_tokens_per_batch_size: list[list[int]] | None
    # this project's, not vLLM's: below this acceptance rate (accepted / proposed, over a window
    # of proposed tokens) speculation costs more than it saves, and the backend warns once
    # (gen_backend_kit.speculation); 0 never warns; default: the measured break-even (0.3)
    min_acceptance_rate: float


class GenerationConfig(TypedDict, total=False):
    """Configuration shared by every backend. Backends extend it with their own keys.

    ``backend`` and ``model_name`` are required; ``configure_generation_config`` fills the rest
    with the defaults documented here and validates every field.
    """

    backend: str  # registry name of the backend: "vllm", "hf", ...
    model_name: str  # local Hugging Face model directory or hub name
    max_new_tokens: int  # >= 1; default 64
    temperature: float  # >= 0; 0 means greedy; default 1.0
    top_p: float  # in (0, 1]; default 1.0 (off)
    top_k: int | None  # None or -1 = off, else >= 1; default None
    min_p: float  # in [0, 1]: drop tokens below min_p * the likeliest's probability; 0 = off
    stop_token_ids: list[int] | None  # a row stops after emitting one (kept); default [eos]
    stop_strings: list[str] | None  # a row stops after completing one (kept); needs a tokenizer
    pad_token_id: int  # fills output_ids past each row's end; default tokenizer's pad (or eos)
    logprobs_mode: LogprobsMode  # "raw" (default) or "processed"
    top_logprobs: int  # >= 0: also return the k likeliest tokens and their logprobs; 0 = off
    seed: int | None  # base of the per-row sampling seeds; None = fresh randomness each call
    dtype: DType  # model dtype; default "auto" (the checkpoint's)
    colocated: ColocatedConfig  # default {"enabled": False}
    # None (default) or N >= 0: rows start only on weights at most N versions behind the newest
    # announced (GenerationInterface.announce_weight_version); see StaleWeightsError
    max_weight_staleness: int | None
    # True: every returned logprob equals, bit for bit, what gen_hf.exact.sequence_logprobs
    # gives for the same tokens (batch-invariant kernels); refused where capabilities say it is not
    # offered. Default False.
    batch_invariant: bool
    # True: the final projection (lm_head) and the log-softmax run in float32 while the model
    # runs in bfloat16 or float16, as prime-rl and PipelineRL do to bring rollout and trainer
    # logprobs together; float32 models run unchanged. Default False.
    lm_head_fp32: bool
    # True (an MoE model only): outputs carry routed_experts, the experts each position's
    # tokens were routed to in every MoE layer, for routing replay in the trainer. Default False.
    return_routed_experts: bool
    # A LoRA adapter over the base model (LoraConfig); a weight update then carries the base,
    # the adapter's tensors (PEFT's names), or both. None (default): no adapter.
    lora: LoraConfig | None
    # Speculative decoding (SpeculativeConfig); refused by name where a backend does not offer
    # the method (BackendCapabilities.speculative). None (default): off.
    speculative: SpeculativeConfig | None


class GenerationDatumSpec(TypedDict):
    """An input batch.

    Each row's real tokens form one contiguous run; left, right and mixed padding all give the
    same result. One of ``attention_mask`` and ``input_lengths`` is needed (both: they must agree).

    Per-row sampling settings replace the config's for their row: a row gets exactly what a
    batch of that row alone would get with those values in the config.
    """

    input_ids: torch.Tensor  # int64 [B, S]
    attention_mask: NotRequired[torch.Tensor]  # [B, S], 1 on real tokens
    input_lengths: NotRequired[torch.Tensor]  # int64 [B]; implies right padding
    stop_strings: NotRequired[list[list[str] | None]]  # per row, added to the config's
    sample_seeds: NotRequired[torch.Tensor]  # int64 [B]; per-row seeds, override the config seed
    max_new_tokens: NotRequired[torch.Tensor]  # int64 [B], >= 1
    temperature: NotRequired[torch.Tensor]  # float [B], >= 0 (0: greedy)
    top_p: NotRequired[torch.Tensor]  # float [B], in (0, 1]
    top_k: NotRequired[torch.Tensor]  # int64 [B], >= 1, or 0 / -1 for off
    min_p: NotRequired[torch.Tensor]  # float [B], in [0, 1]
    top_logprobs: NotRequired[torch.Tensor]  # int64 [B], >= 0
    stop_token_ids: NotRequired[list[list[int] | None]]  # per row; None: the config's
    # per row: the conversation it continues (None: none). A backend with several replicas
    # sends rows of one session to the replica that served the session's last row, whose prefix
    # cache holds the conversation so far, while that replica's load allows. Changes no output.
    session_ids: NotRequired[list[str | None]]


class GenerationOutputSpec(TypedDict):
    """An output batch, rows in input order.

    Row i holds its unpadded prompt (p_i tokens), then its g_i generated tokens, then
    ``pad_token_id``. ``L = max_i(p_i + g_i)``.
    """

    output_ids: torch.Tensor  # int64 [B, L]
    generation_lengths: torch.Tensor  # int64 [B]: g_i
    unpadded_sequence_lengths: torch.Tensor  # int64 [B]: p_i + g_i
    logprobs: torch.Tensor  # float32 [B, L]: position p_i + j holds generated token j's; else 0.0
    truncated: torch.Tensor  # bool [B]: stopped for length, not for a stop token or string
    # bool [B]: ended early by a weight update in "abort" mode, tokens so far kept; resume the
    # row by generating from its prompt plus those tokens
    cut_short: torch.Tensor
    weight_version: torch.Tensor  # int64 [B]: the weight version the row started on
    # int64 [B, L]: position p_i + j holds the version that produced generated token j; else 0
    weight_versions: torch.Tensor
    # K = the largest top_logprobs of the batch's rows. int64 [B, L, K]: at position p_i + j,
    # the ids of the k_i likeliest tokens for generated token j (in the logprobs mode), most
    # likely first; -1 elsewhere and past k_i. float32 [B, L, K]: their logprobs; 0.0 elsewhere.
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    # Only with return_routed_experts. int16 [B, L, layers, top_k]: at every position the model
    # read (the prompt and every generated token but the last, which was sampled, never fed),
    # the ids of the top_k experts each MoE layer routed that token to (as a set: their order is
    # the backend's); -1 at the last generated token and past the row's end.
    routed_experts: NotRequired[torch.Tensor]


class ScoreSpec(TypedDict):
    """Complete sequences to score with teacher forcing (``GenerationInterface.score``).

    Row i holds its p_i prompt tokens then its g_i response tokens from column 0, then padding.
    """

    input_ids: torch.Tensor  # int64 [B, L]
    prompt_lengths: torch.Tensor  # int64 [B]: p_i (>= 1)
    unpadded_sequence_lengths: torch.Tensor  # int64 [B]: p_i + g_i


class ScoreOutputSpec(TypedDict):
    """What ``score_top_logprobs`` returns: ``score``'s logprobs and the top-k of every response
    position (raw log-probabilities, the layout of ``GenerationOutputSpec``'s top-k fields)."""

    logprobs: torch.Tensor  # float32 [B, L]: p_i + j holds response token j's; else 0.0
    topk_ids: torch.Tensor  # int64 [B, L, k]: the k likeliest tokens at p_i + j; else -1
    topk_logprobs: torch.Tensor  # float32 [B, L, k]; else 0.0
    # Only with return_routed_experts. int16 [B, L, layers, top_k]: the experts of every
    # position of the sequence (all were read); -1 past the row's end.
    routed_experts: NotRequired[torch.Tensor]

"""Routed experts checked against a reference: transformers' own router logits, no cache.

A backend's ``routed_experts`` (``return_routed_experts``) must name, at every position the
model read, the experts the model's routers pick for that token. The reference runs the whole
sequence once through the inner transformers model with ``output_router_logits=True`` (the
causal LM with it crashes while decoding with a cache in transformers 5.19) and takes each
layer's top-k of the router's softmax. Two honest backends may split where a router's k-th and
(k+1)-th logits are within a near-tie margin: those positions are counted apart, like greedy
near-ties.

Needs transformers (``gen-testkit[models]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "ROUTER_NEAR_TIE",
    "Routing",
    "RoutingComparison",
    "compare_routing",
    "reference_routing",
]

#: Router-logit margin (k-th minus (k+1)-th) under which two float32 backends may pick different
#: k-th experts: a few times the float32 logit error of these models (about 1e-5).
ROUTER_NEAR_TIE = 1e-4


@dataclass(frozen=True)
class Routing:
    """One sequence's reference routing.

    Attributes:
        experts: int64 ``[n, layers, top_k]``: each position's experts, heaviest first.
        margins: float32 ``[n, layers]``: the router's k-th minus (k+1)-th logit there.
    """

    experts: torch.Tensor
    margins: torch.Tensor


def reference_routing(model: torch.nn.Module, sequence: Sequence[int], top_k: int) -> Routing:
    """The routing of every position of ``sequence`` under transformers ``model`` (a causal LM
    whose inner ``model`` takes ``output_router_logits``), in one forward pass with no cache."""
    ids = torch.as_tensor([list(sequence)], dtype=torch.int64)
    with torch.inference_mode():
        out = model.model(input_ids=ids, output_router_logits=True)  # type: ignore[operator]
    logits = torch.stack([layer.float() for layer in out.router_logits], dim=1)  # [n, layers, E]
    values, experts = logits.topk(top_k + 1, dim=-1)
    return Routing(
        experts=experts[..., :top_k], margins=values[..., top_k - 1] - values[..., top_k]
    )


@dataclass(frozen=True)
class RoutingComparison:
    """How one backend's routing agrees with the reference.

    Attributes:
        compared: (position, layer) pairs compared.
        equal: pairs whose expert sets agree.
        near_ties: pairs that differ where the reference's k-th margin is under the near-tie.
        mismatches: ``(row, position, layer)`` of pairs that differ anywhere else.
    """

    compared: int = 0
    equal: int = 0
    near_ties: int = 0
    mismatches: list[tuple[int, int, int]] = field(default_factory=list)

    def __add__(self, other: RoutingComparison) -> RoutingComparison:
        return RoutingComparison(
            self.compared + other.compared,
            self.equal + other.equal,
            self.near_ties + other.near_ties,
            self.mismatches + other.mismatches,
        )


def compare_routing(
    got: Sequence[torch.Tensor],
    reference: Sequence[Routing],
    *,
    near_tie: float = ROUTER_NEAR_TIE,
) -> RoutingComparison:
    """Compare per-row routing ``got[i]`` (``[n_i, layers, top_k]``, any int dtype) with
    ``reference[i]`` on the first ``n_i`` positions, as sets of experts per (position, layer)."""
    compared = equal = ties = 0
    mismatches: list[tuple[int, int, int]] = []
    for row, (mine, ref) in enumerate(zip(got, reference, strict=True)):
        count = mine.shape[0]
        same = (mine.long().sort(dim=-1).values == ref.experts[:count].sort(dim=-1).values).all(
            dim=-1
        )  # [n, layers]
        tied = ref.margins[:count] < near_tie
        compared += same.numel()
        equal += int(same.sum())
        ties += int((~same & tied).sum())
        mismatches += [(row, int(p), int(layer)) for p, layer in (~same & ~tied).nonzero()]
    return RoutingComparison(compared, equal, ties, mismatches)

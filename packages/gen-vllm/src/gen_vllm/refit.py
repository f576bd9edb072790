"""Driver side of a weight update: did every worker take the same weights?

Each tensor-parallel rank reports the checksum of what it received (the full tensors, the same on
every rank of every replica) and of its parameters after loading (its own shard, so rank r of
one replica is compared with rank r of the others, never with another rank).
"""

from __future__ import annotations

from collections.abc import Sequence

from gen_interface import GenerationError, WeightUpdateError

from gen_vllm.messages import UpdateReport

__all__ = ["MixedWeightsError", "verify_update"]


class MixedWeightsError(WeightUpdateError):
    """Replicas or ranks hold different weights after an update: the backend cannot be trusted."""


def verify_update(outcomes: Sequence[list[UpdateReport] | GenerationError]) -> list[UpdateReport]:
    """Check every replica's reports; return them flattened in replica and rank order.

    Args:
        outcomes: per replica, its ranks' reports in rank order, or the error it raised.

    Raises:
        WeightUpdateError: every replica refused the update before writing anything (the old
            weights are in force everywhere).
        MixedWeightsError: some replicas loaded and others failed, or checksums disagree.
    """
    errors = [o for o in outcomes if isinstance(o, GenerationError)]
    if errors:
        if len(errors) == len(outcomes) and all(isinstance(e, WeightUpdateError) for e in errors):
            raise errors[0]
        failed = [i for i, o in enumerate(outcomes) if isinstance(o, GenerationError)]
        where = (
            "on every replica"
            if len(errors) == len(outcomes)
            else f"on replica(s) {failed} and not on the others"
        )
        raise MixedWeightsError(
            f"the weight update failed {where} ({errors[0]}), so the weights the engines hold "
            "are unknown or differ between replicas"
        )
    reports = [r for r in outcomes if not isinstance(r, GenerationError)]
    ranks = {len(r) for r in reports}
    if len(ranks) != 1:
        raise MixedWeightsError(f"replicas report different numbers of ranks: {sorted(ranks)}")
    received = {rank["received_checksum"] for replica in reports for rank in replica}
    if len(received) > 1:
        raise MixedWeightsError(
            f"workers received different bytes ({len(received)} distinct checksums): the update "
            "did not reach every worker intact"
        )
    for rank in range(ranks.pop()):
        loaded = {replica[rank]["model_checksum"] for replica in reports}
        if len(loaded) > 1:
            raise MixedWeightsError(
                f"tensor-parallel rank {rank} holds different weights on different replicas "
                "after loading the same update"
            )
    return [rank for replica in reports for rank in replica]

"""Driver side of a weight update: did every worker take the same weights?

Each tensor-parallel rank reports, while its engine is still paused:

- ``received_checksum``: of what it received (the full tensors, the same on every rank of every
  replica);
- ``model_checksum``: of its parameters after loading (its own shard, so rank r of one replica
  is compared with rank r of the others, never with another rank);
- ``packed_checksum``: of what its packed layers compute on a fixed input, for the weights the
  parameters no longer hold (vLLM's CPU linear layers move theirs into oneDNN or SGL buffers).
  A kernel's exact output depends on the machine and thread count, so only ranks that report
  the same ``kernel`` (CPU model, threads) are compared; GPU ranks report none.
- ``drafter_checksum``: the drafter model's parameters and packed layers together (speculative
  method ``draft_model``), compared as ``packed_checksum`` is: between ranks of one kernel.

Every comparison is exact: the values are computed in isolation, not beside running rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gen_interface import GenerationError, MixedWeightsError, WeightUpdateError

from gen_vllm.messages import UpdateReport

__all__ = ["MixedWeightsError", "verify_update", "weights_differ"]

logger = logging.getLogger(__name__)


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
        same_rank = [replica[rank] for replica in reports]
        if len({r["model_checksum"] for r in same_rank}) > 1:
            raise MixedWeightsError(
                f"tensor-parallel rank {rank} holds different weights on different replicas "
                "after loading the same update"
            )
        _check_kernel_bound(rank, same_rank)
    return [rank for replica in reports for rank in replica]


def _check_kernel_bound(rank: int, same_rank: Sequence[UpdateReport]) -> None:
    """Ranks on the same kind of kernel must compute the same on the fixed input and hold the
    same drafter model."""
    by_kernel: dict[str, set[tuple[int | None, int | None]]] = {}
    for report in same_rank:
        by_kernel.setdefault(report["kernel"], set()).add(_kernel_bound(report))
    for kernel, values in by_kernel.items():
        if len({packed for packed, _ in values}) > 1:
            raise MixedWeightsError(
                f"tensor-parallel rank {rank}: replicas on the same kernels ({kernel}) compute "
                "different results with their packed layers after loading the same update: "
                "their weights differ"
            )
        if len({drafter for _, drafter in values}) > 1:
            raise MixedWeightsError(
                f"tensor-parallel rank {rank}: replicas on the same kernels ({kernel}) hold "
                "different drafter models after the same update: their drafter weights differ"
            )
    if len(by_kernel) > 1:
        logger.info(
            "rank %d: packed layers not compared across %d kinds of CPU or thread count (their "
            "exact results differ by design); parameters and received bytes were",
            rank,
            len(by_kernel),
        )


def weights_differ(
    reference: Sequence[UpdateReport],
    candidate: Sequence[UpdateReport],
    *,
    drafter: bool = True,
) -> str | None:
    """Why ``candidate`` (a replacement replica's ranks) does not hold the weights
    ``reference`` (a serving replica's ranks) holds, or None when it does: each rank's
    parameters, and its packed layers' and drafter model's checksums where both run the same
    kernel, exactly as replicas are compared after a refit. Received bytes are not compared: a
    replacement reads another copy (a peer's) than the trainer's buckets.

    Args:
        drafter: compare the drafter models too; False: the target model alone."""
    if len(reference) != len(candidate):
        return f"{len(candidate)} ranks where the fleet's replicas have {len(reference)}"
    for rank, (ours, theirs) in enumerate(zip(reference, candidate)):
        if ours["model_checksum"] != theirs["model_checksum"]:
            return (
                f"tensor-parallel rank {rank} holds other parameters than the fleet's "
                f"(checksum {theirs['model_checksum']:#x}, the fleet's {ours['model_checksum']:#x})"
            )
        same_kernel = ours["kernel"] == theirs["kernel"]
        if same_kernel and ours["packed_checksum"] != theirs["packed_checksum"]:
            return f"tensor-parallel rank {rank}'s packed layers compute other results"
        if drafter and same_kernel and _kernel_bound(ours)[1] != _kernel_bound(theirs)[1]:
            return f"tensor-parallel rank {rank}'s drafter model holds other weights"
    return None


def _kernel_bound(report: UpdateReport) -> tuple[int | None, int | None]:
    """The checksums compared only between ranks of one kernel: packed layers, drafter."""
    return report["packed_checksum"], report.get("drafter_checksum")

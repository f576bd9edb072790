"""Consumer side of a weight-update transaction: what must arrive, what has.

Every backend follows the same rule: an update carries every weight of the model exactly once
(tied weights under one of their names), in any number of bucket loads between
``start_weight_update`` and ``commit_weight_update``. Each load is checked before anything of it
is written (known names, matching shapes, castable dtypes, nothing twice); the commit checks that
nothing is missing. A backend keeps one ``WeightTransaction`` per update in progress.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from gen_interface.errors import WeightUpdateError

from gen_backend_kit.weights.consumer import (
    TensorSpecs,
    check_update_is_complete,
    check_weights_match,
)

__all__ = ["WeightTransaction", "next_version"]


def next_version(current: int, requested: int | None) -> int:
    """The version a transaction commits: ``requested``, or ``current + 1``.

    Raises:
        WeightUpdateError: ``requested`` is not an integer >= 0.
    """
    if requested is None:
        return current + 1
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise WeightUpdateError(f"weight versions are integers >= 0, got {requested!r}")
    return requested


@dataclass
class WeightTransaction:
    """One update in progress.

    Attributes:
        model: the model's ``{name: (shape, dtype)}``, what an update may carry.
        optional: names an update may omit (aliases of tied weights).
        version: the version the commit sets.
        groups: sets of names refitted on their own (an adapter; see
            ``check_update_is_complete``).
        received: names loaded so far.
        loads: how many loads were accepted (a load may have written part of the weights).
    """

    model: TensorSpecs
    optional: Collection[str]
    version: int
    groups: tuple[frozenset[str], ...] = ()
    received: set[str] = field(default_factory=set)
    loads: int = 0

    def accept_specs(self, specs: TensorSpecs) -> None:
        """Check one load, described by ``{name: (shape, dtype)}``, before any of it is
        written; record it.

        Raises:
            WeightUpdateError: a name the model lacks, a shape or dtype that does not fit, or a
                name that already arrived in this transaction.
        """
        check_weights_match(specs, self.model)
        again = sorted(set(specs) & self.received)
        if again:
            raise WeightUpdateError(
                f"weight update refused, nothing of this load was written: {again[:5]} already "
                "arrived in this transaction (each weight is sent once)"
            )
        self.received.update(specs)
        self.loads += 1

    def check_complete(self) -> None:
        """Raise ``WeightUpdateError`` naming the weights that never arrived."""
        check_update_is_complete(self.received, self.model, self.optional, self.groups)

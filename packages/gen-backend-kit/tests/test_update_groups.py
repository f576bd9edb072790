"""The completeness rule with an adapter: the base and each group are carried whole or not at
all, at least one of them; the tied aliases stay optional. Checked against a plain statement of
the rule over every subset of a small model's names."""

from __future__ import annotations

import itertools

import pytest
import torch
from gen_backend_kit.weights.consumer import check_update_is_complete
from gen_interface import WeightUpdateError

SPEC = (torch.Size([2]), torch.float32)
BASE = ["embed", "layer.q", "layer.v", "head"]
ADAPTER = ["layer.q.lora_A", "layer.q.lora_B"]
MODEL = {name: SPEC for name in BASE + ADAPTER}
OPTIONAL = {"head"}  # tied to the embedding


def allowed(names: set[str]) -> bool:
    base = set(BASE) - OPTIONAL
    parts = [base, set(ADAPTER)]
    touched = [p for p in parts if p & names]
    return bool(touched) and all(p <= names for p in touched)


@pytest.mark.parametrize(
    "names",
    [
        set(subset)
        for size in range(len(MODEL) + 1)
        for subset in itertools.combinations(sorted(MODEL), size)
    ],
)
def test_each_part_whole_or_absent(names: set[str]):
    if allowed(names):
        check_update_is_complete(names, MODEL, OPTIONAL, [ADAPTER])
    else:
        with pytest.raises(WeightUpdateError, match="missing"):
            check_update_is_complete(names, MODEL, OPTIONAL, [ADAPTER])


def test_without_groups_every_weight_is_needed():
    check_update_is_complete(set(BASE) - OPTIONAL | set(ADAPTER), MODEL, OPTIONAL)
    with pytest.raises(WeightUpdateError, match=r"missing layer\.q\.lora_A, layer\.q\.lora_B"):
        check_update_is_complete(set(BASE), MODEL, OPTIONAL)

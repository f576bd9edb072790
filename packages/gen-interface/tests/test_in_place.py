"""Zero-copy refits: a module's weights moved into shared memory keep everything a trainer relies
on, are sent where they are, and are refused when written while being read."""

from __future__ import annotations

import os

import pytest
import torch
from gen_backend_kit.weights import read_shared_weights
from gen_interface import WeightUpdateError
from gen_interface.weights import share_parameters
from gen_interface.weights.in_place import in_place_handles, split_in_place
from gen_interface.weights.producer import named_tensors


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(300, 64)
        self.mlp = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(ids)) * self.scale)


def test_shared_parameters_keep_values_identity_ties_and_training():
    model = _Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with share_parameters(model, segment_bytes=2**16) as shared:
        assert list(model.parameters()) == params  # same Parameter objects
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        assert model.head.weight is model.embed.weight and model.embed.weight.requires_grad
        assert len(shared.paths) > 1 and all(os.path.exists(p) for p in shared.paths)
        in_place, rest = split_in_place(named_tensors(model.state_dict()))
        assert not rest and {segment.path for segment, _ in in_place} <= set(shared.paths)
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        optimizer.step()  # the optimizer writes into the shared tensors
        assert not torch.equal(model.mlp.weight, before["mlp.weight"])
        segment, group = in_place[0]
        read = dict(read_shared_weights(in_place_handles(segment, group)))
        assert all(torch.equal(read[name], tensor) for name, tensor in group)
    assert not any(os.path.exists(p) for p in shared.paths)
    # once closed, the tensors stay valid but are sent by copy
    assert model(torch.tensor([[1]])).shape == (1, 1, 300)
    assert split_in_place(named_tensors(model.state_dict()))[0] == []


def test_a_tensor_written_while_it_is_read_is_refused():
    model = _Tied()
    with share_parameters(model):
        (segment, group), *_ = split_in_place(named_tensors(model.state_dict()))[0]
        handles = in_place_handles(segment, group)
        with torch.no_grad():
            group[0][1].add_(1.0)  # an optimizer step during the refit
        with pytest.raises(WeightUpdateError, match="changed after it was shared"):
            read_shared_weights(handles)


def test_gpu_or_views_are_not_sent_in_place():
    model = _Tied()
    with share_parameters(model):
        transposed = [("t", model.mlp.weight.t())]
        assert split_in_place(transposed) == ([], transposed)
        outside = [("o", torch.ones(3))]
        assert split_in_place(outside) == ([], outside)
    with pytest.raises(ValueError, match="on meta"):
        share_parameters(torch.nn.Linear(2, 2, device="meta"))

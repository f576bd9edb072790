"""A deterministic n-gram language model in pure torch: logits from the last few tokens."""

from __future__ import annotations

import torch

__all__ = ["NgramModel"]


class NgramModel:
    """Next-token logits ``bias + sum_k tables[k][token at distance k]`` for k = 1..order.

    Weights are drawn from a generator seeded with ``init_seed``, so equal arguments give equal
    models. ``state_dict`` names: ``bias`` ``[V]`` and ``tables.<k>`` ``[V, V]``.
    """

    def __init__(self, vocab_size: int, order: int = 2, init_seed: int = 0, scale: float = 0.8):
        if vocab_size < 2 or order < 1:
            raise ValueError(f"need vocab_size >= 2 and order >= 1, got {vocab_size}, {order}")
        generator = torch.Generator().manual_seed(init_seed)
        #: While True, every forward pass raises ``RuntimeError``, as a failing kernel would
        #: (tests of the error paths).
        self.failing = False
        self.vocab_size = vocab_size
        self.order = order
        self.weights: dict[str, torch.Tensor] = {
            "bias": scale * torch.randn(vocab_size, generator=generator)
        }
        for k in range(1, order + 1):
            self.weights[f"tables.{k}"] = scale * torch.randn(
                vocab_size, vocab_size, generator=generator
            )

    def specs(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return {name: (w.shape, w.dtype) for name, w in self.weights.items()}

    def next_logits(self, contexts: list[list[int]]) -> torch.Tensor:
        """Logits ``[A, V]`` of the token following each of the A contexts.

        Raises:
            RuntimeError: ``failing`` is set.
        """
        if self.failing:
            raise RuntimeError("the n-gram model's forward pass failed (failing is set)")
        logits = self.weights["bias"].expand(len(contexts), -1).clone()
        for k in range(1, self.order + 1):
            rows = [i for i, c in enumerate(contexts) if len(c) >= k]
            if rows:
                tokens = torch.tensor([contexts[i][-k] for i in rows])
                logits[rows] += self.weights[f"tables.{k}"][tokens]
        return logits

    def sequence_logits(self, sequence: list[int]) -> torch.Tensor:
        """Logits ``[T, V]``: row t predicts token t + 1 of ``sequence`` (teacher forcing)."""
        return self.next_logits([sequence[: t + 1] for t in range(len(sequence))])

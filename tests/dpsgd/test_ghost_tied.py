"""Parameters used by several calls, from the calls' rules plus cross terms (no per-example
gradients): tied embedding and output layer, a Linear applied twice, a table looked up
twice; each against per-example autograd, and checked not to materialise per-example
gradients of the shared weight."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import _rules_embedding, _rules_linear, _tied
from tests.dpsgd.test_ghost_clipping import check, count_calls

V, D, B, T = 11, 6, 5, 7


@pytest.fixture
def materialised(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    weights = [0]  # per-example weight gradients formed from ghost operands (a bias's are cheap)
    original = _rules_linear.MatmulGrad.per_example

    def counted(self: Any, name: str) -> Any:
        if self._role(name) == "weight" and self._pe is None:
            weights[0] += 1
        return original(self, name)

    monkeypatch.setattr(_rules_linear.MatmulGrad, "per_example", counted)
    return {
        "embedding": count_calls(monkeypatch, _rules_embedding.EmbeddingGrad, "per_example"),
        "matmul": weights,
        "combined": count_calls(monkeypatch, _tied, "SumOfUses"),
    }


def token_losses(fmodel: Any) -> Any:
    def loss(p: Any, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fmodel(p, ids).transpose(1, 2), y, reduction="none").sum(1)

    return loss


class TiedLM(nn.Module):
    def __init__(self, padding_idx: int | None = None, seq_head: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx)
        self.mix = nn.Linear(D, D)
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.emb.weight
        self.seq_head = seq_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(ids)))
        return self.out(h) if self.seq_head else self.out(h.mean(1))  # [B, T, V] or [B, V]


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_tied_embedding_and_sequence_head(padding_idx: int | None, materialised: dict[str, list[int]]) -> None:
    torch.manual_seed(0)
    ids, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    ids[:, -2:] = 0  # some padding tokens (when padding_idx = 0), and repeated ids
    check(TiedLM(padding_idx), ids, y, token_losses)
    assert materialised["embedding"][0] == 0 and materialised["matmul"][0] == 0
    assert materialised["combined"][0] == 2  # once per backend


def test_tied_embedding_and_single_position_head(materialised: dict[str, list[int]]) -> None:
    torch.manual_seed(1)
    ids, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    def example_losses(fmodel: Any) -> Any:
        return lambda p, ids, y: F.cross_entropy(fmodel(p, ids), y, reduction="none")

    check(TiedLM(seq_head=False), ids, y[:, 0], example_losses)
    assert materialised["embedding"][0] == 0 and materialised["matmul"][0] == 0


def test_linear_applied_twice(materialised: dict[str, list[int]]) -> None:
    torch.manual_seed(2)
    wide = 40  # d_in * d_out > T (d_in + d_out): ghost norms, so the cross Gram formula runs

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(3, wide)
            self.lin = nn.Linear(wide, wide)
            self.head = nn.Linear(wide, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.lin(torch.tanh(self.lin(self.inp(x)))))).squeeze(-1)

    x, y = torch.randn(B, 4, 3, dtype=torch.float64), torch.randn(B, 4, dtype=torch.float64)
    check(Twice(), x, y, backends=("ghost",))
    assert materialised["matmul"][0] == 0 and materialised["combined"][0] == 2  # its weight and its bias


def test_table_looked_up_twice(materialised: dict[str, list[int]]) -> None:
    torch.manual_seed(3)

    class TwoLookups(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.head = nn.Linear(D, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.emb(ids) * self.emb(ids.flip(1)).sin())).squeeze(-1)

    ids = torch.randint(0, V, (B, T))
    check(TwoLookups(), ids, torch.randn(B, T, dtype=torch.float64))
    assert materialised["embedding"][0] == 0 and materialised["combined"][0] == 2

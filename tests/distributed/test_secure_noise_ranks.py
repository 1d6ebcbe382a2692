"""gaussian_noise(secure=True) on 2 gloo ranks: rank 0 draws, every rank ends with the same values."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed


def _secure_noise(rank: int, world_size: int) -> list:
    from opake_fx.dpsgd.noise import gaussian_noise
    from opake_fx.random import key
    from opake_fx.types import ClippedPytree

    fn, s = gaussian_noise(noise_multiplier=1.0, key=key(5), secure=True)
    out, _ = fn(ClippedPytree({"w": torch.zeros(1000), "b": torch.zeros(3, dtype=torch.bfloat16)}, max_norm=1.0), s)
    return [out.pytree["w"], out.pytree["b"]]


def test_every_rank_gets_rank_zeros_secure_draw(group2):
    (w0, b0), (w1, b1) = group2.run(_secure_noise)
    assert torch.equal(w0, w1) and torch.equal(b0, b1)
    assert 0.9 < float(w0.std()) < 1.1 and b0.dtype == torch.bfloat16

"""Red team: per-example gradients that are finite where the norm is computed but not where they are summed.

The vmap path computes each example's norm (float64, certified) on the gradient as the loss
(or the ``pre_clip`` hook) returned it, then casts the gradient to the output dtype and
multiplies by the weight there. An example whose gradient is finite in float64 but beyond
float32's range becomes ``inf`` in the cast while its weight ``C / norm`` underflows to 0:
``0 * inf = NaN`` in the released sum. With the example the release is NaN, without it it is
finite: one attacker example is distinguishable with probability 1, whatever the noise.

Fixed in ``opake_fx/dpsgd/clipping/_engine.py`` (``clipped_step``): ``w * g`` is formed in the
wider of the gradient's and the output's dtype, and only the weighted sum (norm <= C per
example) is cast to the output dtype; the same for the second-moment square.
"""

from __future__ import annotations

import pytest
import torch

from opake_fx.dpsgd import clipped_grad

def _loss(p, x):
    return (p["w"] * x).sum()


def test_output_dtype_narrower_than_an_attacker_gradient_keeps_the_release_finite() -> None:
    params = {"w": torch.ones(3, dtype=torch.float64)}
    batch = torch.tensor([[1e300, 1.0, 1.0], [0.5, 0.5, 0.5]], dtype=torch.float64)  # example 0: the attacker
    fn, state = clipped_grad(_loss, clipping_norm=1.0, dtype=torch.float32)
    out, _ = fn(params, batch, state=state)
    released = out.pytree["w"]
    assert bool(torch.isfinite(released).all()), released
    assert float(released.double().norm()) <= 2.0  # two examples, each clipped to 1


def test_a_pre_clip_hook_that_widens_the_dtype_keeps_the_release_finite() -> None:
    params = {"w": torch.ones(3)}
    batch = torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    fn, state = clipped_grad(_loss, clipping_norm=1.0, pre_clip=lambda g: {"w": g["w"].double() * 1e300})
    out, _ = fn(params, batch, state=state)
    assert bool(torch.isfinite(out.pytree["w"]).all()), out.pytree["w"]


def test_the_second_moment_stream_stays_finite_for_an_attacker_gradient() -> None:
    params = {"w": torch.ones(3, dtype=torch.float64)}
    batch = torch.tensor([[1e300, 1.0, 1.0], [0.5, 0.5, 0.5]], dtype=torch.float64)
    fn, state = clipped_grad(_loss, clipping_norm=1.0, dtype=torch.float32, second_moment=True)
    out, _ = fn(params, batch, state=state)
    assert bool(torch.isfinite(out.squared_grads.pytree["w"]).all())


def test_a_pre_clip_hook_returning_nan_or_another_shape_cannot_break_the_bound() -> None:
    params = {"w": torch.ones(3)}
    batch = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])

    def nan_for_first(g):  # NaN for one example, a huge finite value for the other
        w = g["w"]
        return {"w": torch.where(w[0] == 1.0, torch.full_like(w, float("nan")), w * 1e30)}

    fn, state = clipped_grad(_loss, clipping_norm=1.0, pre_clip=nan_for_first)
    out, _ = fn(params, batch, state=state)
    assert bool(torch.isfinite(out.pytree["w"]).all())
    assert float(out.pytree["w"].norm()) <= 1.0 * (1 + 1e-6)
    fn, state = clipped_grad(_loss, clipping_norm=1.0, pre_clip=lambda g: {"w": g["w"][:2]})
    with pytest.raises(Exception, match="pre_clip"):
        fn(params, batch, state=state)

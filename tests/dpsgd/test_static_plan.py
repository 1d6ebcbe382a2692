"""The per-function cache of structure-only derivations (``_engine.StaticPlan``).

A clipped-gradient function keeps, per parameter structure, leaf dtypes/devices and clip
norm, what it derives from them alone (groups, output dtypes, the clip-norm tensor) and
skips the argument checks on a matching call. These tests show that a call whose
structure, dtypes or clip norm differs is planned (and checked) afresh, never served a
stale plan.
"""

from __future__ import annotations

import pytest
import torch

from opake_fx.dpsgd.clipping import adaptive_clipped_grad, clipped_grad, per_group
from opake_fx.errors import InputTypeError
from opake_fx.random import key


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (x * p["w"]).sum() + p["b"].sum() * x.sum()


def _params(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), 2.0, dtype=dtype), "b": torch.ones(1, dtype=dtype)}


X = torch.arange(12.0).reshape(4, 3)


def test_a_new_dtype_is_planned_afresh() -> None:
    fn, s = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=1)
    out32, s = fn(_params(torch.float32), X, state=s)
    out64, s = fn(_params(torch.float64), X.double(), state=s)
    assert out32.pytree["w"].dtype == torch.float32 and out64.pytree["w"].dtype == torch.float64
    torch.testing.assert_close(out64.pytree["w"].float(), out32.pytree["w"])


def test_checks_still_run_after_a_cached_call() -> None:
    fn, s = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=1)
    _, s = fn(_params(), X, state=s)
    bad = {"w": torch.full((3,), 2, dtype=torch.int64), "b": torch.ones(1)}
    with pytest.raises(InputTypeError, match="floating-point"):
        fn(bad, X, state=s)
    with pytest.raises(InputTypeError, match="non-tensor leaf"):
        fn({"w": 2.0, "b": torch.ones(1)}, X, state=s)


def test_a_changing_clip_norm_is_used_every_step() -> None:
    # Adaptive clipping changes the norm every call: each call must clip at its own norm.
    fn, s = adaptive_clipped_grad(_loss, initial_clipping_norm=5.0, count_noise_multiplier=1.0, key=key(0),
                                  learning_rate=0.5, batch_argnums=1)
    seen = []
    for _ in range(4):
        norm = s.clipping_norm
        got, s = fn(_params(), X, state=s)
        ref_fn, ref_s = clipped_grad(_loss, clipping_norm=norm, batch_argnums=1)
        ref, _ = ref_fn(_params(), X, state=ref_s)
        assert got.max_norm == ref.max_norm == norm
        assert torch.equal(got.pytree["w"], ref.pytree["w"]) and torch.equal(got.pytree["b"], ref.pytree["b"])
        seen.append(norm)
    assert len(set(seen)) == 4  # the norm did move


def test_per_group_norms_are_planned_per_object() -> None:
    params = _params()
    # Two PerGroup objects with the same groups but other norms: each call clips at its own.
    for bias_norm in (0.1, 0.2):
        norms = per_group(params, bias=(bias_norm, "b"), rest=(1.0, "*"))
        fn, s = clipped_grad(_loss, clipping_norm=norms, batch_argnums=1, return_aux=True)
        for _ in range(2):
            (out, aux), s = fn(params, X, state=s)
            assert set(aux.group_norms) == {"bias", "rest"}
            # every example's bias gradient (its x.sum() >= 3) is clipped to exactly bias_norm
            assert float(out.pytree["b"]) == pytest.approx(X.shape[0] * bias_norm, rel=1e-5)


def test_too_few_arguments_is_refused_after_a_cached_call() -> None:
    from opake_fx.errors import InputValueError

    fn, s = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=1)
    _, s = fn(_params(), X, state=s)
    with pytest.raises(InputValueError, match="positional arguments"):
        fn(_params(), state=s)

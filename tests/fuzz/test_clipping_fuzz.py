"""Fuzz: clipping over drawn configurations, models and gradient trees, on every backend.

For every draw: each example's contribution (the clipped sum of a one-example batch) is
within ``max_norm`` in L2 norm, checked in float64 on the returned values; the batch's
sum equals the sum of the contributions; outputs are finite for finite inputs; the
parameters, the batch and the state passed in are never modified.

Profiles: 200 draws per test in the default suite (about 10 s for both);
``HYPOTHESIS_PROFILE=nightly`` runs 2000 per test.
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.errors import SlowPathWarning
from opake_fx.pytree import leaves
from opake_fx.serialization import state_dict
from opake_fx.testing import (
    assert_clipped,
    assert_tree_finite,
    assert_trees_close,
    assert_trees_equal,
    clipping_configs,
    pytrees,
    small_models,
)

NIGHTLY = os.environ.get("HYPOTHESIS_PROFILE") == "nightly"
FUZZ_EXAMPLES = 2000 if NIGHTLY else 200
BACKENDS = ("vmap", "ghost", "auto")


def _profile(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


def _check_model(model, cfg, backend) -> None:
    fmodel, params = model.functional()
    params = tuple(p.detach() for p in params)
    if backend == "vmap":
        loss, extra = model.example_loss(fmodel), {}
    else:
        loss, extra = model.batched_loss(fmodel), {"clip_backend": backend, "model": fmodel}
    grad_fn, state = clipped_grad(loss, batch_argnums=(1, 2), **cfg.kwargs(params), **extra)
    inputs = (params, model.x, model.y)
    saved_inputs, saved_state = copy.deepcopy(inputs), state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)  # speed only; the fallbacks are exact
        warnings.filterwarnings("ignore", message="There is a performance drop")
        out, _ = grad_fn(*inputs, state=state)
        contributions = [grad_fn(params, model.x[i : i + 1], model.y[i : i + 1], state=state)[0] for i in range(model.batch_size)]
    assert_trees_equal(inputs, saved_inputs)  # nothing passed in was modified
    assert_trees_equal(state_dict(state), saved_state)
    assert_tree_finite(out.pytree)
    stacked = tuple(torch.stack([c.pytree[j] for c in contributions]) for j in range(len(params)))
    assert_clipped(stacked, out.max_norm)
    total = tuple(s.sum(0) for s in stacked)
    scale = max(float(out.sensitivity) * model.batch_size, 1e-30)
    assert_trees_close(tuple(out.pytree), total, rtol=1e-4, atol=1e-5 * scale)


def _check_tree(batched, cfg) -> None:
    # Per-example "gradients" are the drawn leaves themselves: loss = <params, x>.
    params = tuple(torch.zeros_like(leaf[0]) for leaf in leaves(batched))
    xs = tuple(leaves(batched))
    grad_fn, state = clipped_grad(lambda p, *x: sum((pi * xi).sum() for pi, xi in zip(p, x)),
                                  batch_argnums=tuple(range(1, len(xs) + 1)), **cfg.kwargs(params))
    saved = copy.deepcopy((params, xs)), state_dict(state)
    out, _ = grad_fn(params, *xs, state=state)
    assert_trees_equal(((params, xs), state_dict(state)), saved)
    assert_tree_finite(out.pytree)
    per_example = [grad_fn(params, *(x[i : i + 1] for x in xs), state=state)[0].pytree for i in range(xs[0].shape[0])]
    assert_clipped(tuple(torch.stack([p[j] for p in per_example]) for j in range(len(xs))), out.max_norm)


MODEL_DRAWS = dict(model=small_models(), cfg=clipping_configs(), backend=st.sampled_from(BACKENDS))
TREE_DRAWS = dict(
    batched=pytrees(batch=3, max_leaves=4, empty_leaves=True,
                    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])),
    cfg=clipping_configs(),
)


@_profile(FUZZ_EXAMPLES)
@given(**MODEL_DRAWS)
def test_fuzz_models(model, cfg, backend):
    _check_model(model, cfg, backend)


@_profile(FUZZ_EXAMPLES)
@given(**TREE_DRAWS)
def test_fuzz_gradient_trees(batched, cfg):
    _check_tree(batched, cfg)

"""A testing kit for DP code: hypothesis strategies and tree asserts.

Needs ``hypothesis`` (the ``test`` extra); it is imported only when this package is.
See ``docs/testing.md``.

* Strategies: :func:`keys`, :func:`pytrees` / :func:`batched_pytrees` (dtypes incl.
  bfloat16/float16, extreme values, empty leaves), :func:`clipping_configs`,
  :func:`small_models`, :func:`poisson_batches`, :func:`dp_processes`.
* Asserts, whose failures name the leaf path: :func:`assert_trees_close`,
  :func:`assert_trees_equal`, :func:`assert_tree_finite`,
  :func:`assert_tree_shapes_dtypes`, :func:`assert_clipped`.

Example:
    >>> import torch
    >>> from hypothesis import given, settings
    >>> from opake_fx.pytree import tree_map
    >>> @settings(max_examples=10, database=None)
    ... @given(tree=pytrees(max_leaves=3, batch=2))
    ... def test_halving_keeps_shapes(tree):
    ...     assert_tree_shapes_dtypes(tree_map(lambda x: x / 2, tree), tree)
    >>> test_halving_keeps_shapes()
"""

from opake_fx.testing.asserts import (
    assert_clipped,
    assert_tree_finite,
    assert_tree_shapes_dtypes,
    assert_trees_close,
    assert_trees_equal,
)
from opake_fx.testing.dp import ClippingConfig, PoissonBatch, clipping_configs, dp_processes, poisson_batches
from opake_fx.testing.models import SelfAttention, SmallModel, small_models
from opake_fx.testing.strategies import EXTREME_SCALES, batched_pytrees, keys, pytrees

__all__ = [
    "keys",
    "pytrees",
    "batched_pytrees",
    "EXTREME_SCALES",
    "clipping_configs",
    "ClippingConfig",
    "small_models",
    "SmallModel",
    "SelfAttention",
    "poisson_batches",
    "PoissonBatch",
    "dp_processes",
    "assert_trees_close",
    "assert_trees_equal",
    "assert_tree_finite",
    "assert_tree_shapes_dtypes",
    "assert_clipped",
]

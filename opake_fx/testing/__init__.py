"""Helpers for testing DP code: hypothesis strategies for pytrees and tree asserts.

Needs ``hypothesis`` (the ``test`` extra); it is imported only when this module is.

Example:
    >>> from hypothesis import given
    >>> from opake_fx.testing import pytrees
    >>> @given(tree=pytrees(max_leaves=3))
    ... def test_something(tree): ...
"""

from opake_fx.testing.asserts import assert_trees_close
from opake_fx.testing.strategies import batched_pytrees, pytrees

__all__ = ["pytrees", "batched_pytrees", "assert_trees_close"]

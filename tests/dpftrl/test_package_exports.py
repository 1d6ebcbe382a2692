"""opake_fx.dpftrl re-exports the strategies package's names (but the ToeplitzLike base class)."""

from __future__ import annotations

import opake_fx.dpftrl as dpftrl
import opake_fx.dpftrl.strategies as strategies


def test_dpftrl_lists_every_strategy_name_but_the_toeplitz_base_once():
    listed = [n for n in dpftrl.__all__ if n in strategies.__all__]
    assert listed == [n for n in strategies.__all__ if n != "ToeplitzLike"]
    assert len(set(dpftrl.__all__)) == len(dpftrl.__all__)
    assert "ToeplitzLike" not in dpftrl.__all__


def test_the_re_exported_strategy_names_are_the_strategies_objects():
    for name in dpftrl.__all__:
        assert hasattr(dpftrl, name), name
    for name in set(dpftrl.__all__) & set(strategies.__all__):
        assert getattr(dpftrl, name) is getattr(strategies, name), name

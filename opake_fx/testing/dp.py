"""Hypothesis strategies for DP configurations: clipping, Poisson batches, accounting processes.

Example:
    >>> import math, torch
    >>> from hypothesis import given, settings
    >>> from opake_fx.dpsgd.clipping import clipped_grad
    >>> @settings(max_examples=5, database=None, deadline=None)
    ... @given(cfg=clipping_configs())
    ... def test_sensitivity_is_c_over_normalize_by(cfg):
    ...     params = {"w": torch.zeros(3), "b": torch.zeros(1)}
    ...     grad_fn, s = clipped_grad(lambda p, x: (p["w"] * x).sum() + p["b"].sum(), **cfg.kwargs(params))
    ...     out, _ = grad_fn(params, torch.randn(4, 3), state=s)
    ...     assert math.isclose(out.sensitivity, cfg.sensitivity(params), rel_tol=1e-12)
    >>> test_sensitivity_is_c_over_normalize_by()
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from hypothesis import strategies as st

from opake_fx.accounting import DpProcess, compose
from opake_fx.dpsgd import accounting as dpsgd_acc
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.pytree import tree_flatten_with_paths
from opake_fx.testing.strategies import keys
from opake_fx.types import PerGroup

__all__ = ["ClippingConfig", "clipping_configs", "PoissonBatch", "poisson_batches", "dp_processes"]


@dataclass(frozen=True)
class ClippingConfig:
    """One drawn clipping configuration.

    Attributes:
        clipping_norm: the clip norm ``C`` (used when ``group_norms`` is ``None``).
        group_norms: per-group clip norms; parameter leaf ``i`` (in tree order) goes to
            group ``i % len(group_norms)``.
        normalize_by: the divisor of the clipped sum.
        microbatch_size: examples per microbatch (``None``: the whole batch at once).
    """

    clipping_norm: float
    group_norms: tuple[float, ...] | None
    normalize_by: float
    microbatch_size: int | None

    def norm_for(self, params: Any) -> float | PerGroup:
        """The ``clipping_norm`` argument for ``params``: ``C``, or a :class:`PerGroup` over its leaves."""
        if self.group_norms is None:
            return self.clipping_norm
        paths, _, _ = tree_flatten_with_paths(params)
        groups = {tuple(p): f"g{i % len(self.group_norms)}" for i, p in enumerate(paths)}
        used = set(groups.values())
        return PerGroup(groups, {f"g{j}": c for j, c in enumerate(self.group_norms) if f"g{j}" in used})

    def per_example_bound(self, params: Any) -> float | PerGroup:
        """What each example's clipped gradient is bounded by (per group for per-group clipping)."""
        return self.norm_for(params)

    def sensitivity(self, params: Any) -> float:
        """The L2 sensitivity of the clipped sum: ``C / normalize_by`` (``C`` over all groups for per-group norms)."""
        bound = self.norm_for(params)
        return (bound.effective if isinstance(bound, PerGroup) else bound) / self.normalize_by

    def kwargs(self, params: Any) -> dict[str, Any]:
        """Keyword arguments for ``clipped_grad`` / ``clip``: ``clipping_norm``, ``normalize_by``, ``microbatch_size``."""
        return {"clipping_norm": self.norm_for(params), "normalize_by": self.normalize_by, "microbatch_size": self.microbatch_size}


def clipping_configs(
    *, per_group: bool = True, norms: st.SearchStrategy[float] | None = None, max_microbatch: int = 4
) -> st.SearchStrategy[ClippingConfig]:
    """Draws clipping configurations: scalar or per-group norms, ``normalize_by``, microbatch sizes.

    Norms span tiny to huge on purpose (``1e-6`` .. ``1e6`` by default), so that both the
    always-clipped and the never-clipped regimes are drawn.

    Args:
        per_group: also draw per-group norms (2 or 3 groups).
        norms: strategy for each clip norm.
        max_microbatch: the largest microbatch size drawn (besides ``None``).

    Returns:
        A strategy of :class:`ClippingConfig`.

    Privacy: none (a test helper).

    Example:
        >>> from hypothesis import find
        >>> find(clipping_configs(), lambda c: c.group_norms is not None).group_norms
        (1e-06, 1e-06)
    """
    norm = norms if norms is not None else st.sampled_from([1e-6, 1e-3, 0.1, 1.0, 10.0, 1e6]) | st.floats(1e-3, 1e3)
    groups = st.none() | (st.lists(norm, min_size=2, max_size=3).map(tuple) if per_group else st.none())
    return st.builds(
        ClippingConfig,
        clipping_norm=norm,
        group_norms=groups,
        normalize_by=st.sampled_from([1.0, 4.0, 0.5]) | st.floats(0.1, 100.0),
        microbatch_size=st.none() | st.integers(1, max_microbatch),
    )


@dataclass(frozen=True)
class PoissonBatch:
    """A drawn Poisson-sampled batch: step ``step`` of ``sampler``."""

    sampler: PoissonSampler
    step: int

    @cached_property
    def indices(self) -> list[int]:
        """``sampler.batch(step)``: sorted distinct indices (computed in the test, not while drawing)."""
        return self.sampler.batch(self.step)

    @property
    def size(self) -> int:
        """How many examples the batch has (0 happens, on purpose)."""
        return len(self.indices)


def poisson_batches(*, max_dataset_size: int = 64, max_steps: int = 8) -> st.SearchStrategy[PoissonBatch]:
    """Draws batches from :class:`~opake_fx.dpsgd.sampling.PoissonSampler` s, empty and single ones included.

    Sample rates include the extremes (``1e-9``: nearly always empty, ``1.0``: every
    example) next to ordinary ones; dataset sizes start at 1.

    Args:
        max_dataset_size: the largest dataset drawn.
        max_steps: the sampler's ``n_steps`` is drawn up to this.

    Returns:
        A strategy of :class:`PoissonBatch`.

    Privacy: none (a test helper); the batches are exactly the sampler's.

    Example:
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=10, database=None, deadline=None)
        ... @given(b=poisson_batches())
        ... def test_batches_are_sorted_distinct_indices(b):
        ...     assert b.indices == sorted(set(b.indices)) and all(0 <= i < b.sampler.dataset_size for i in b.indices)
        >>> test_batches_are_sorted_distinct_indices()
    """

    @st.composite
    def batch(draw: Any) -> PoissonBatch:
        n = draw(st.integers(1, max_dataset_size))
        q = draw(st.sampled_from([1e-9, 0.01, 0.1, 0.5, 1.0]) | st.floats(1e-6, 1.0))
        steps = draw(st.integers(1, max_steps))
        sampler = PoissonSampler(n, sample_rate=q, n_steps=steps, key=draw(keys()))
        step = draw(st.integers(0, steps - 1))
        return PoissonBatch(sampler, step)

    return batch()


def dp_processes(*, max_components: int = 3, max_count: int = 100) -> st.SearchStrategy[DpProcess]:
    """Draws compositions of DP-SGD mechanisms for accounting properties.

    Each component is a Gaussian (noise multiplier 0.5..20), optionally Poisson-subsampled
    (rate 1e-4..1), repeated 1..``max_count`` times; 1..``max_components`` of them are
    composed. Small enough for the PLD engine to answer in well under a second.

    Args:
        max_components: the most components composed.
        max_count: the most repetitions of one component.

    Returns:
        A strategy of :class:`~opake_fx.accounting.DpProcess`.

    Privacy: none (a test helper).

    Example:
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=3, database=None, deadline=None)
        ... @given(p=dp_processes(max_components=2, max_count=10))
        ... def test_composing_never_lowers_epsilon(p):
        ...     assert (p | p).epsilon_at(1e-5) >= p.epsilon_at(1e-5)
        >>> test_composing_never_lowers_epsilon()
    """
    sigma = st.floats(0.5, 20.0)
    rate = st.floats(1e-4, 1.0)

    @st.composite
    def component(draw: Any) -> DpProcess:
        step = dpsgd_acc.gaussian(draw(sigma))
        if draw(st.booleans()):
            step = dpsgd_acc.poisson(step, draw(rate))
        return step * draw(st.integers(1, max_count))

    return st.lists(component(), min_size=1, max_size=max_components).map(lambda parts: compose(*parts))

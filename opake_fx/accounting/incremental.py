"""IncrementalPld: a privacy loss distribution composed one process at a time.

``IncrementalPld`` keeps the composed 'remove' and 'add' PMFs of everything folded in so
far; ``pld.then(process)`` costs one convolution per pair, whatever came before, so a run
of ``T`` different steps costs ``O(T)`` convolutions instead of recomposing the whole
history at every step (``O(T^2)``). Queries (``epsilon_at``, ``delta_at``, ...) read the
kept PMFs and are cached on them. The :class:`~opake_fx.accounting.Accountant` keeps one
for a PLD budget. ``state_dict()`` / ``from_state_dict()`` save and restore it exactly
(the Accountant's checkpoints hold it, so a resumed run rounds as the uninterrupted one).

Numerics (:func:`opake_fx.accounting._pmf.convolve`): full-length FFT convolution with a
rounding bound of each bin's own order added (never an under-report), then a cut to the
Chernoff window of the composition with ``1e-16`` mass per step to ``+inf`` for the upper
cut (the mass below the window is rounded up). The result is pessimistic like the
one-shot composition and agrees with it to far better than 1e-6 relative in epsilon
(tests/accounting/test_incremental.py).

Example:
    >>> import opake_fx.accounting as acc
    >>> import opake_fx.dpsgd.accounting as dpsgd_acc
    >>> schedule = [dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0 + 0.01 * i), 0.01) for i in range(20)]
    >>> running = acc.IncrementalPld()
    >>> for step in schedule:
    ...     running = running.then(step)
    >>> one_shot = acc.compose(*schedule).epsilon_at(1e-5)
    >>> abs(running.epsilon_at(1e-5) - one_shot) <= 1e-6 * one_shot
    True
"""

from __future__ import annotations

import math
from typing import Any

from opake_fx._typecheck import typechecked
from opake_fx.accounting import _pmf
import opake_fx.validation as check
from opake_fx.accounting.pld import DEFAULT_DISCRETIZATION, PrivacyLossDistribution, pmfs_of
from opake_fx.accounting.process import ADD_OR_REMOVE_ONE, REPLACE_ONE, DpProcess
from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["IncrementalPld"]


class IncrementalPld:
    """The discretised, pessimistic PLD of the processes folded in so far (immutable).

    Privacy contract: after ``then(p1).then(p2)...``, every metric bounds the privacy of
    the adaptive composition of ``p1, p2, ...`` under their (shared) neighbouring
    relation, from above: the discrete PMFs dominate the exact ones (connect-the-dots),
    truncated upper mass goes to ``+inf`` by a Chernoff bound, and floating-point
    rounding is bounded and added. Pure-Gaussian steps are discretised too (the one-shot
    :meth:`DpProcess.epsilon_at` answers those in closed form), so expect agreement to
    ~1e-7, not bit equality.

    Args:
        discretization: spacing of the privacy-loss grid (as ``DpProcess.pld``).

    Example:
        >>> import opake_fx.accounting as acc
        >>> import opake_fx.dpsgd.accounting as dpsgd_acc
        >>> warmup = dpsgd_acc.poisson(dpsgd_acc.gaussian(0.8), 0.01) * 100
        >>> running = acc.IncrementalPld().then(warmup)
        >>> running = running.then(dpsgd_acc.poisson(dpsgd_acc.gaussian(1.2), 0.01))
        >>> round(running.epsilon_at(1e-5), 3)
        1.511
    """

    @typechecked
    def __init__(self, discretization: float = DEFAULT_DISCRETIZATION) -> None:
        d = check.positive(discretization, "discretization", "IncrementalPld", "A typical value is 1e-4.")
        if d > 1.0:
            raise InputValueError(f"IncrementalPld: discretization must be <= 1; got {d}. A typical value is 1e-4.")
        self._remove = _pmf.unit(d)
        self._add: _pmf.Pmf | None = None  # None: same as remove (symmetric so far)
        self._relation: str | None = None
        self._steps = 0

    @property
    def discretization(self) -> float:
        """Grid spacing in use (coarser than requested only after a huge composition)."""
        return self._remove.d

    @property
    def folds(self) -> int:
        """How many processes were folded in (``then`` calls with a non-identity process)."""
        return self._steps

    def then(self, process: DpProcess) -> IncrementalPld:
        """This composition followed by ``process``: one convolution per pair.

        ``process`` may be anything (a step, ``step * k`` -- self-composed by repeated
        squaring first --, ``a | b``); this value is unchanged.

        Raises:
            InputTypeError: ``process`` is not a DpProcess.
            InputValueError: its neighbouring relation differs from what was folded before.

        Example:
            >>> import opake_fx.accounting as acc
            >>> import opake_fx.dpsgd.accounting as dpsgd_acc
            >>> step = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
            >>> acc.IncrementalPld().then(step).then(step * 99).folds
            2
        """
        if not isinstance(process, DpProcess):
            raise InputTypeError(f"IncrementalPld.then: expected a DpProcess; got {type(process).__name__}.")
        components = process._components()
        if not components:
            return self
        relation = _joined_relation(self._relation, process.neighboring_relation)
        remove, add = pmfs_of(components, self._remove.d)
        out = object.__new__(IncrementalPld)
        if self._add is None and add is None:
            out._remove, out._add = _fold(self._remove, remove), None
        else:
            mine_add = self._add if self._add is not None else self._remove
            out._remove, out._add = _fold_pairs((self._remove, remove), (mine_add, add if add is not None else remove))
        out._relation = relation
        out._steps = self._steps + 1
        return out

    __or__ = then

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides this composition's metrics and its next fold, exactly.

        ``{"relation", "folds", "remove", "add"}``; each pair is the dict of its PMF (grid
        spacing ``d``, offset ``lo``, mass at infinity ``inf``, the float64 ``probs``
        and the kept ``log_mgfs`` that decide the next Chernoff cut); ``add`` is ``None``
        while the composition is symmetric. The arrays are copies. What is left out
        (the query tails) is a cache, rebuilt from ``probs``.

        Privacy: none by itself; :meth:`from_state_dict` of it continues the composition
        bit for bit (the next ``then`` rounds as this one's would).

        Example:
            >>> import opake_fx.accounting as acc
            >>> import opake_fx.dpsgd.accounting as dpsgd_acc
            >>> step = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
            >>> running = acc.IncrementalPld().then(step * 10)
            >>> back = acc.IncrementalPld.from_state_dict(running.state_dict())
            >>> back.then(step).epsilon_at(1e-5) == running.then(step).epsilon_at(1e-5)
            True
        """
        return {
            "relation": self._relation,
            "folds": self._steps,
            "remove": self._remove.to_dict(),
            "add": None if self._add is None else self._add.to_dict(),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> IncrementalPld:
        """The composition :meth:`state_dict` described, bit for bit.

        Only the form is checked (non-negative finite masses, a known neighbouring
        relation, ...).

        Privacy: the values are trusted to come from :meth:`state_dict` of the same run
        (e.g. through a checksummed checkpoint, as the Accountant's are): a hand-made or
        altered state can under-report privacy.

        Raises:
            InputValueError: a missing or extra field, or a field of the wrong form,
                named (e.g. ``'IncrementalPld state/remove/probs'``).

        Example:
            >>> import opake_fx.accounting as acc
            >>> acc.IncrementalPld.from_state_dict(acc.IncrementalPld().state_dict())
            IncrementalPld(discretization=0.0001, folds=0, points=1)
        """
        where = "IncrementalPld state"
        fields = ("relation", "folds", "remove", "add")
        if not isinstance(state, dict) or set(state) != set(fields):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise InputValueError(f"{where}: expected the fields {list(fields)}; got {got}.")
        relation, folds = state["relation"], state["folds"]
        if relation is not None and relation not in (ADD_OR_REMOVE_ONE, REPLACE_ONE):
            raise InputValueError(
                f"{where}/relation: expected None, {ADD_OR_REMOVE_ONE!r} or {REPLACE_ONE!r}; got {relation!r}."
            )
        if isinstance(folds, bool) or not isinstance(folds, int) or folds < 0:
            raise InputValueError(f"{where}/folds: expected an int >= 0; got {folds!r}.")
        out = object.__new__(cls)
        out._remove = _pmf.pmf_from_dict(state["remove"], f"{where}/remove")
        out._add = None if state["add"] is None else _pmf.pmf_from_dict(state["add"], f"{where}/add")
        out._relation = relation
        out._steps = folds
        return out

    def pld(self) -> PrivacyLossDistribution:
        """The composed distribution as a :class:`PrivacyLossDistribution`."""
        return PrivacyLossDistribution(self._remove, self._add)

    def epsilon_at(self, delta: float) -> float:
        """Smallest eps >= 0 with delta(eps) <= ``delta`` (worse pair; ``inf`` if none)."""
        delta = check.delta(delta, "IncrementalPld.epsilon_at")
        return float(self.pld().epsilon_at(delta))

    def delta_at(self, epsilon: float) -> float:
        """The hockey-stick divergence at ``epsilon`` (worse pair)."""
        epsilon = check.non_negative(epsilon, "epsilon", "IncrementalPld.delta_at", allow_inf=True)
        return float(self.pld().delta_at(epsilon))

    def advantage(self) -> float:
        """``delta_at(0)``: the best membership-inference advantage."""
        return self.delta_at(0.0)

    def beta_at(self, alpha: float) -> float:
        """Smallest type-II error of a membership test with type-I error ``alpha``."""
        alpha = check.unit_interval(alpha, "alpha", "IncrementalPld.beta_at")
        return float(self.pld().beta_at(alpha))

    def __repr__(self) -> str:
        sizes = "/".join(str(p.size) for p in (self._remove, self._add) if p is not None)
        return f"IncrementalPld(discretization={self.discretization:g}, folds={self._steps}, points={sizes})"


def _fold_pairs(first: tuple[_pmf.Pmf, _pmf.Pmf], second: tuple[_pmf.Pmf, _pmf.Pmf]) -> tuple[_pmf.Pmf, _pmf.Pmf]:
    """Both pairs' folds, on two threads (FFTs release the GIL).

    Each thread also prepares its pair's query tails, which every metric reads.
    """

    def fold_and_warm(pair: tuple[_pmf.Pmf, _pmf.Pmf]) -> _pmf.Pmf:
        out = _fold(*pair)
        out.tails()
        return out

    return _pmf.both(lambda: fold_and_warm(first), lambda: fold_and_warm(second))


def _fold(mine: _pmf.Pmf, other: _pmf.Pmf) -> _pmf.Pmf:
    """``convolve`` on a common grid (the coarser one), coarsening both when too large."""
    while True:
        if mine.d != other.d:
            coarse = max(mine.d, other.d)
            mine = _pmf.coarsen(mine, round(coarse / mine.d))
            other = _pmf.coarsen(other, round(coarse / other.d))
        try:
            return _pmf.convolve(mine, other)
        except _pmf.GridTooLarge as exc:
            factor = max(2, math.ceil(exc.size / _pmf.MAX_GRID))
            mine, other = _pmf.coarsen(mine, factor), _pmf.coarsen(other, factor)


def _joined_relation(mine: str | None, theirs: Any) -> str | None:
    if mine is not None and theirs is not None and mine != theirs:
        raise InputValueError(
            f"IncrementalPld.then: cannot compose a process under {theirs!r} onto a composition under "
            f"{mine!r}; account the whole run under one neighbouring relation."
        )
    return mine if mine is not None else theirs

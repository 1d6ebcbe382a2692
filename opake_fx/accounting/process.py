"""DpProcess: immutable, hashable descriptions of DP mechanisms and their compositions.

A :class:`DpProcess` says *what* was released, never *how much privacy* that cost; the
metrics (``epsilon_at``, ``delta_at``, ``advantage``, ``beta_at``) are computed on demand
by the PLD engine (default) or the RDP engine. Processes form a small algebra:

* ``p * k`` / ``k * p`` / :func:`repeat`: ``k`` independent runs of ``p`` (int ``k >= 1``);
* ``a | b`` / :func:`compose`: ``a`` then ``b`` (adaptive composition; order is irrelevant);
* :func:`identity` (no release, epsilon 0) and :func:`nonprivate` (epsilon ``inf``).

Values are normalised on construction, so equal processes compare and hash equal:
``(p * 2) | p == p * 3``, ``a | b == b | a``, ``p | identity() == p``.

Example:
    >>> import opake_fx.accounting as acc
    >>> import opake_fx.dpsgd.accounting as dpsgd_acc
    >>> step = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
    >>> (step * 2) | step == step * 3
    True
    >>> round((step * 1000).epsilon_at(1e-5), 2)
    1.83
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from typing import Any, ClassVar

import numpy as np

from opake_fx._typecheck import typechecked
import opake_fx.validation as check
from opake_fx.accounting import pld as _pld
from opake_fx.accounting import rdp as _rdp
from opake_fx.errors import InputTypeError, InputValueError

__all__ = [
    "ADD_OR_REMOVE_ONE",
    "REPLACE_ONE",
    "DpProcess",
    "Identity",
    "NonPrivate",
    "Repeated",
    "Composed",
    "identity",
    "nonprivate",
    "compose",
    "repeat",
    "compose_unchecked",
    "repeat_unchecked",
    "process_from_dict",
]

ADD_OR_REMOVE_ONE = "add_or_remove_one"
"""Neighbouring datasets differ by adding or removing one example (DP-SGD's default)."""
REPLACE_ONE = "replace_one"
"""Neighbouring datasets of equal size differ in one example."""

_ACCOUNTANTS = ("pld", "rdp")
_REGISTRY: dict[str, type[DpProcess]] = {}


class DpProcess:
    """An immutable, hashable description of a differentially private process.

    Privacy contract: the metrics bound the privacy of the released outputs under the
    process's :attr:`neighboring_relation`, for every pair of neighbouring datasets,
    with adaptive composition. The PLD engine is pessimistic (never below the exact
    value, up to floating point); the RDP engine is an upper bound too, usually looser.

    Example:
        >>> import opake_fx.dpsgd.accounting as dpsgd_acc
        >>> g = dpsgd_acc.gaussian(1.0)
        >>> round(g.epsilon_at(1e-5), 4)
        4.3772
    """

    __slots__ = ()
    _TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls._TYPE:
            _REGISTRY[cls._TYPE] = cls

    # -------------------------------------------------------------- algebra

    def __mul__(self, count: int) -> DpProcess:
        return repeat(self, count)

    __rmul__ = __mul__

    def __or__(self, other: object) -> DpProcess:
        if not isinstance(other, DpProcess):
            return NotImplemented
        return compose(self, other)

    # -------------------------------------------------------------- metrics

    def epsilon_at(
        self,
        delta: float,
        *,
        accountant: str = "pld",
        discretization: float = _pld.DEFAULT_DISCRETIZATION,
    ) -> float:
        """The smallest epsilon such that the process is (epsilon, ``delta``)-DP.

        Args:
            delta: in (0, 1).
            accountant: ``"pld"`` (default, tight) or ``"rdp"``.
            discretization: PLD grid spacing; smaller is tighter and slower.

        Returns:
            epsilon >= 0, or ``inf`` when no finite epsilon reaches ``delta``.
        """
        delta = check.delta(delta, "epsilon_at")
        if _engine(accountant, "epsilon_at") == "rdp":
            return _rdp.epsilon_from_rdp(_rdp.DEFAULT_RDP_ORDERS, self.rdp(), delta)
        return float(self._profile(discretization).epsilon_at(delta))

    def delta_at(
        self,
        epsilon: float,
        *,
        accountant: str = "pld",
        discretization: float = _pld.DEFAULT_DISCRETIZATION,
    ) -> float:
        """The smallest delta such that the process is (``epsilon``, delta)-DP.

        Args:
            epsilon: >= 0 (``inf`` allowed: the probability of an unbounded loss).
            accountant: ``"pld"`` (default) or ``"rdp"``.
            discretization: PLD grid spacing.
        """
        epsilon = check.non_negative(epsilon, "epsilon", "delta_at", allow_inf=True)
        if _engine(accountant, "delta_at") == "rdp":
            return _rdp.delta_from_rdp(_rdp.DEFAULT_RDP_ORDERS, self.rdp(), epsilon)
        return float(self._profile(discretization).delta_at(epsilon))

    def advantage(
        self,
        *,
        accountant: str = "pld",
        discretization: float = _pld.DEFAULT_DISCRETIZATION,
    ) -> float:
        """``delta_at(0)``: total-variation distance = best membership-inference advantage.

        An attacker guessing membership succeeds with probability at most
        ``(1 + advantage) / 2`` under a uniform prior.
        """
        return self.delta_at(0.0, accountant=accountant, discretization=discretization)

    def beta_at(self, alpha: float, *, discretization: float = _pld.DEFAULT_DISCRETIZATION) -> float:
        """Trade-off curve: the smallest type-II error of any membership test with type-I ``alpha``.

        Higher is more private; a perfectly private process gives ``1 - alpha``.
        Computed from the PLD (worse of the add and remove pairs).
        """
        alpha = check.unit_interval(alpha, "alpha", "beta_at")
        return float(self._profile(discretization).beta_at(alpha))

    def pld(self, discretization: float = _pld.DEFAULT_DISCRETIZATION) -> _pld.PrivacyLossDistribution:
        """The discretised, pessimistic privacy loss distribution (always discretised)."""
        d = _discretization(discretization)
        return _pld.pld_of(self._components(), d)

    def rdp(self, orders: tuple[float, ...] = _rdp.DEFAULT_RDP_ORDERS) -> np.ndarray:
        """The RDP curve at ``orders`` (dp_accounting's default grid unless given)."""
        return _rdp.rdp_curve(self._components(), orders)

    def _profile(self, discretization: float) -> Any:
        return _pld.privacy_profile(self._components(), _discretization(discretization))

    # ------------------------------------------------------------ structure

    @property
    def neighboring_relation(self) -> str | None:
        """``"add_or_remove_one"``, ``"replace_one"``, or None for relation-agnostic processes."""
        return None

    def _components(self) -> tuple[tuple[DpProcess, int], ...]:
        """The multiset of single-step mechanisms: ``((leaf, count), ...)``."""
        return ((self, 1),)

    # -------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-able data; :func:`process_from_dict` rebuilds an equal process."""
        return {"type": self._TYPE, **self._fields()}

    def _fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> DpProcess:
        return cls()

    @staticmethod
    def from_dict(data: dict[str, Any]) -> DpProcess:
        """Inverse of :meth:`to_dict` (same as :func:`process_from_dict`)."""
        return process_from_dict(data)

    # leaf hooks (overridden by mechanisms)
    def _directions(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _gaussian_mu(self) -> float | None:
        return None

    def _rdp(self, orders: np.ndarray) -> np.ndarray:
        raise InputValueError(
            f"The RDP accountant has no curve for {self!r}; use accountant='pld' (the default)."
        )


@dataclass(frozen=True)
class Identity(DpProcess):
    """Releases nothing: epsilon 0 at every delta. The unit of composition."""

    _TYPE: ClassVar[str] = "identity"

    def _components(self) -> tuple[tuple[DpProcess, int], ...]:
        return ()

    def _rdp(self, orders: np.ndarray) -> np.ndarray:
        return np.zeros_like(np.asarray(orders, dtype=np.float64))

    def __repr__(self) -> str:
        return "identity()"


@dataclass(frozen=True)
class NonPrivate(DpProcess):
    """Releases its input unprotected: epsilon ``inf`` at every delta < 1."""

    _TYPE: ClassVar[str] = "nonprivate"

    def _gaussian_mu(self) -> float | None:
        return math.inf

    def _rdp(self, orders: np.ndarray) -> np.ndarray:
        return np.full_like(np.asarray(orders, dtype=np.float64), math.inf)

    def __repr__(self) -> str:
        return "nonprivate()"


@dataclass(frozen=True)
class Repeated(DpProcess):
    """``count`` independent runs of one single-step mechanism (build it with ``p * count``)."""

    process: DpProcess
    count: int
    _TYPE: ClassVar[str] = "repeat"

    @property
    def neighboring_relation(self) -> str | None:
        return self.process.neighboring_relation

    def _components(self) -> tuple[tuple[DpProcess, int], ...]:
        return ((self.process, self.count),)

    def _fields(self) -> dict[str, Any]:
        return {"process": self.process.to_dict(), "count": self.count}

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> DpProcess:
        return repeat(process_from_dict(data["process"]), data["count"])

    def __repr__(self) -> str:
        return f"{self.process!r} * {self.count}"


@dataclass(frozen=True)
class Composed(DpProcess):
    """A composition of different mechanisms, as a canonical multiset (build it with ``|``)."""

    parts: tuple[tuple[DpProcess, int], ...]
    _TYPE: ClassVar[str] = "compose"

    @property
    def neighboring_relation(self) -> str | None:
        return _relation([leaf for leaf, _ in self.parts])

    def _components(self) -> tuple[tuple[DpProcess, int], ...]:
        return self.parts

    def _fields(self) -> dict[str, Any]:
        return {"parts": [{"process": p.to_dict(), "count": k} for p, k in self.parts]}

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> DpProcess:
        return compose(*(repeat(process_from_dict(part["process"]), part["count"]) for part in data["parts"]))

    def __repr__(self) -> str:
        return " | ".join(repr(p) if k == 1 else f"{p!r} * {k}" for p, k in self.parts)


# ------------------------------------------------------------------ builders


def identity() -> DpProcess:
    """The process that releases nothing (epsilon 0); ``p | identity() == p``.

    Example:
        >>> import opake_fx.accounting as acc
        >>> acc.identity().epsilon_at(1e-5)
        0.0
    """
    return Identity()


def nonprivate() -> DpProcess:
    """A release with no protection (epsilon ``inf``); absorbs anything composed with it.

    Example:
        >>> import opake_fx.accounting as acc
        >>> acc.nonprivate().epsilon_at(1e-5)
        inf
    """
    return NonPrivate()


@typechecked
def repeat(process: DpProcess, count: Integral) -> DpProcess:
    """``count`` independent runs of ``process`` (same as ``process * count``).

    Args:
        process: any DpProcess.
        count: int >= 1 (e.g. the number of training steps).

    Privacy: adaptive composition; the PLD of the result is the ``count``-fold
    convolution of the PLD of ``process``.

    Example:
        >>> import opake_fx.accounting as acc
        >>> import opake_fx.dpsgd.accounting as dpsgd_acc
        >>> acc.repeat(dpsgd_acc.gaussian(2.0), 4) == dpsgd_acc.gaussian(2.0) * 4
        True
    """
    return repeat_unchecked(process, count)


def repeat_unchecked(process: DpProcess, count: int) -> DpProcess:
    """:func:`repeat` without its runtime signature check, for per-step hot paths (the Accountant).

    The result is the same as :func:`repeat`'s. ``process`` must still be a DpProcess
    (InputTypeError otherwise) and ``count`` an int >= 1 (InputValueError otherwise); only
    the annotation check of the public function is skipped.
    """
    if not isinstance(process, DpProcess):
        raise InputTypeError(f"repeat: expected a DpProcess; got {type(process).__name__}.")
    count = check.integer(count, "count", "repeat (p * k)", 1, "Pass the number of steps as an int >= 1.")
    return _canonical([(leaf, k * count) for leaf, k in process._components()], process)


@typechecked
def compose(*processes: DpProcess) -> DpProcess:
    """Adaptive composition of ``processes`` (same as ``a | b | ...``; order is irrelevant).

    Privacy: the PLDs of the parts are convolved; the result is the privacy of
    releasing all their outputs. Parts must share a neighbouring relation.

    Example:
        >>> import opake_fx.accounting as acc
        >>> import opake_fx.dpsgd.accounting as dpsgd_acc
        >>> warmup = dpsgd_acc.poisson(dpsgd_acc.gaussian(0.8), 0.01) * 100
        >>> main = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.2), 0.01) * 900
        >>> acc.compose(warmup, main) == warmup | main
        True
    """
    return compose_unchecked(*processes)


def compose_unchecked(*processes: DpProcess) -> DpProcess:
    """:func:`compose` without its runtime signature check, for per-step hot paths (the Accountant).

    The result is the same as :func:`compose`'s; every part must still be a DpProcess
    (InputTypeError otherwise) and the parts must share a neighbouring relation.
    """
    items: list[tuple[DpProcess, int]] = []
    for p in processes:
        if not isinstance(p, DpProcess):
            raise InputTypeError(f"compose: expected DpProcess values; got {type(p).__name__}.")
        items.extend(p._components())
    return _canonical(items, None)


@typechecked
def process_from_dict(data: dict[str, Any]) -> DpProcess:
    """Rebuilds a process from :meth:`DpProcess.to_dict` output.

    Example:
        >>> import opake_fx.accounting as acc
        >>> import opake_fx.dpsgd.accounting as dpsgd_acc
        >>> p = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01) * 10
        >>> acc.process_from_dict(p.to_dict()) == p
        True
    """
    if not isinstance(data, dict) or "type" not in data:
        raise InputTypeError(f"process_from_dict: expected a dict with a 'type' key; got {data!r}.")
    # The mechanism types register themselves when opake_fx.accounting.mechanisms is imported,
    # which the package's __init__ does before any of its modules can be used.
    cls = _REGISTRY.get(data["type"])
    if cls is None:
        raise InputValueError(
            f"process_from_dict: unknown process type {data['type']!r}; known: {sorted(_REGISTRY)}."
        )
    try:
        return cls._from_fields(data)
    except KeyError as exc:
        raise InputValueError(f"process_from_dict: {data['type']!r} is missing field {exc}.") from None


# ------------------------------------------------------------------- helpers


def _canonical(items: list[tuple[DpProcess, int]], original: DpProcess | None) -> DpProcess:
    counts: dict[DpProcess, int] = {}
    for leaf, k in items:
        if isinstance(leaf, NonPrivate):
            return NonPrivate()
        counts[leaf] = counts.get(leaf, 0) + k
    _relation(list(counts))  # raises on mixed neighbouring relations
    parts = tuple(sorted(counts.items(), key=lambda kv: repr(kv[0])))
    if not parts:
        return Identity()
    if len(parts) == 1:
        leaf, k = parts[0]
        if k == 1:
            return leaf
        return original if isinstance(original, Repeated) and original.count == k else Repeated(leaf, k)
    return Composed(parts)


def _relation(leaves: list[DpProcess]) -> str | None:
    relations = {leaf.neighboring_relation for leaf in leaves} - {None}
    if len(relations) > 1:
        raise InputValueError(
            "compose: cannot compose processes accounted under different neighbouring relations "
            f"({sorted(relations)}). A process under add_or_remove_one (gaussian, poisson, ...) "
            "has twice the sensitivity under replace_one; account the whole run under one relation "
            "(e.g. sampled_without_replacement(gaussian(z), n, n) for a full-batch step under replace_one)."
        )
    return relations.pop() if relations else None


def _engine(accountant: object, where: str) -> str:
    if accountant not in _ACCOUNTANTS:
        raise InputValueError(f"{where}: accountant must be 'pld' or 'rdp'; got {accountant!r}.")
    return str(accountant)


def _discretization(value: object) -> float:
    d = check.positive(value, "discretization", "DpProcess metrics", "A typical value is 1e-4.")
    if d > 1.0:
        raise InputValueError(f"DpProcess metrics: discretization must be <= 1; got {d}. A typical value is 1e-4.")
    return d

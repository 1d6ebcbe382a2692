"""The :class:`Strategy` base class and the helpers every strategy shares."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
import torch

import opake_fx.validation as check
from opake_fx.dpftrl import _toeplitz
from opake_fx.dpftrl import sensitivity as _sens
from opake_fx.dpftrl.streaming import StreamingInverse
from opake_fx.dpftrl.workloads import Workload, prefix_workload
from opake_fx.errors import InputValueError
from opake_fx.typing import typechecked

__all__ = ["Strategy", "Reduction", "strategy_from_dict"]

Reduction = Literal["mean", "max"]
_REGISTRY: dict[str, type[Strategy]] = {}


class Strategy:
    """A DP-FTRL strategy: a lower-triangular, invertible ``n x n`` matrix ``C``.

    DP-FTRL releases ``C x + z`` for the gradient stream ``x``; equivalently it adds
    ``(C^{-1} z)_t`` to the gradient of step ``t``, with ``z`` i.i.d.
    ``N(0, (noise_multiplier * sensitivity * max_norm)^2)``. For a workload ``A`` the
    error is ``B z`` with ``B = A C^{-1}``.

    Strategies are immutable values. Every one provides:

    * ``n_steps`` (``None`` for strategies defined for any horizon, e.g. lambda-CGD;
      pass ``n=`` to the methods then);
    * :meth:`coefficients`: the numbers that define it;
    * :meth:`materialize` / :meth:`materialize_inverse`: dense ``C`` / ``C^{-1}``;
    * :meth:`inverse_noise`: the streaming state machine that yields row ``t`` of
      ``C^{-1} Z`` with O(bands or buffers) parameter-sized tensors;
    * :meth:`sensitivity`: under b-min-sep participation (exact for banded ``C`` with
      ``bands <= min_sep`` and for decreasing Toeplitz ``C``, an upper bound otherwise;
      :meth:`sensitivity_is_exact` says which);
    * :meth:`expected_error`: mean or max squared error on a workload times the
      squared sensitivity.

    Privacy contract: a strategy only shapes the noise. The privacy of a run is that of
    the Gaussian mechanism ``C x + z`` with the sensitivity returned by
    :meth:`sensitivity` for the participation pattern the sampler guarantees; see
    :mod:`opake_fx.dpftrl.accounting`.
    """

    kind: ClassVar[str] = "strategy"
    n_steps: int | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    # ---------------------------------------------------------------- structure

    @property
    def bands(self) -> int | None:
        """Number of non-zero diagonals of ``C`` (``None`` when ``C`` is not banded)."""
        return None

    @property
    def is_toeplitz(self) -> bool:
        """True when ``C`` is Toeplitz (its first column defines it)."""
        return False

    def coefficients(self) -> Any:
        """The numbers that define the strategy (a tensor or a dict of tensors, float64)."""
        raise NotImplementedError

    def materialize(self, n: int | None = None) -> torch.Tensor:
        """The dense ``n x n`` float64 matrix ``C`` (``n`` defaults to ``n_steps``)."""
        raise NotImplementedError

    def materialize_inverse(self, n: int | None = None) -> torch.Tensor:
        """The dense ``n x n`` float64 matrix ``C^{-1}``."""
        c = self.materialize(n)
        eye = torch.eye(c.shape[0], dtype=torch.float64)
        return torch.linalg.solve_triangular(c, eye, upper=False)

    def inverse_noise(self) -> StreamingInverse:
        """The streaming ``C^{-1}`` (see :mod:`opake_fx.dpftrl.streaming`)."""
        raise NotImplementedError

    def column_norms(self, n: int | None = None) -> torch.Tensor:
        """``||C[:, i]||`` for every step ``i``."""
        return self.materialize(n).norm(dim=0)

    def inverse_row_norms(self, n: int | None = None) -> torch.Tensor:
        """``||C^{-1}[t, :]||``: the per-coordinate noise std of step ``t`` in units of the z std."""
        return self.materialize_inverse(n).norm(dim=1)

    # -------------------------------------------------------------- sensitivity

    def sensitivity(self, min_sep: int = 1, max_participations: int | None = 1, *, n: int | None = None) -> float:
        """L2 sensitivity of ``C`` (unit clip norm) under b-min-sep participation.

        Args:
            min_sep: ``b``, the minimum number of steps between two participations of
                one example (1 allows consecutive steps).
            max_participations: ``k``, the most participations of one example (None:
                as many as ``n`` and ``b`` allow).
            n: horizon (defaults to ``n_steps``).

        Returns:
            The sensitivity: exact for banded ``C`` with ``bands <= min_sep`` and for
            Toeplitz ``C`` with non-negative, non-increasing coefficients; otherwise an
            upper bound (see :meth:`sensitivity_is_exact`).
        """
        return self._sensitivity(self._n(n), *_pattern(self, "sensitivity", min_sep, max_participations))[0]

    def sensitivity_is_exact(self, min_sep: int = 1, max_participations: int | None = 1, *, n: int | None = None) -> bool:
        """True when :meth:`sensitivity` is exact (not only an upper bound) for this pattern."""
        return self._sensitivity(self._n(n), *_pattern(self, "sensitivity_is_exact", min_sep, max_participations))[1]

    def epoch_sensitivity(self, epochs: int, *, n: int | None = None) -> float:
        """Sensitivity under fixed-epoch order (``epochs`` passes in the same order).

        Tighter than ``sensitivity(n // epochs, epochs)`` for dense multi-epoch strategies,
        whose columns within an epoch class are orthogonal.
        """
        return _sens.fixed_epoch_sensitivity(
            self.materialize(n), check.integer(epochs, "epochs", f"{type(self).__name__}.epoch_sensitivity", minimum=1)
        )

    def _sensitivity(self, n: int, min_sep: int, k: int | None) -> tuple[float, bool]:
        bands = self.bands
        if bands is not None and (bands <= min_sep or _sens.max_participations_of(n, min_sep, k) == 1):
            return _sens.banded_sensitivity(self.column_norms(n) ** 2, min_sep, k), True
        return _sens.minsep_sensitivity(self.materialize(n), min_sep, k)

    # -------------------------------------------------------------------- error

    def per_query_error(self, workload: Workload | None = None, *, n: int | None = None) -> torch.Tensor:
        """``||B[t, :]||^2`` for ``B = A C^{-1}``: the error variance of each step under unit noise.

        Not multiplied by the sensitivity (see :meth:`expected_error`).
        """
        n = self._n(n, workload)
        a = _workload(workload, n)
        b = a.materialize() @ self.materialize_inverse(n)
        return (b * b).sum(dim=1)

    def expected_error(
        self,
        workload: Workload | None = None,
        reduction: Reduction = "mean",
        *,
        min_sep: int = 1,
        max_participations: int | None = 1,
    ) -> float:
        """The loss of the factorisation: reduced per-query error times squared sensitivity.

        ``mean``: ``||B||_F^2 * sens^2 / n``; ``max``: ``max_t ||B[t]||^2 * sens^2``
        (with the default single participation, ``sens`` is the largest column norm of
        ``C``). For the identity strategy on prefix sums these are ``(n + 1) / 2`` and ``n``.

        Example:
            >>> from opake_fx.dpftrl import identity_strategy
            >>> identity_strategy(64).expected_error(), identity_strategy(64).expected_error(reduction="max")
            (32.5, 64.0)
        """
        errors = self.per_query_error(workload)
        n = errors.shape[0]
        sens = self.sensitivity(min_sep, max_participations, n=n)
        return float(_reduce(errors, reduction)) * sens * sens

    # ---------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-able data; :func:`strategy_from_dict` rebuilds an equal strategy."""
        out: dict[str, Any] = {"type": type(self).__name__}
        for name in self._fields():
            value = getattr(self, name)
            out[name] = value.tolist() if isinstance(value, np.ndarray) else value
        return out

    def _fields(self) -> tuple[str, ...]:
        import dataclasses

        return tuple(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]

    # ---------------------------------------------------------------- helpers

    def _n(self, n: int | None = None, workload: Workload | None = None) -> int:
        if n is None and workload is not None:
            n = workload.n_steps
        if n is None:
            n = self.n_steps
        if n is None:
            raise InputValueError(
                f"{type(self).__name__} has no fixed n_steps; pass n= (the number of training steps)."
            )
        n = check.integer(n, "n", type(self).__name__, minimum=1)
        if self.n_steps is not None and n > self.n_steps:
            raise InputValueError(
                f"{type(self).__name__} was built for n_steps={self.n_steps}; got n={n}. Build the strategy "
                "for the full run: a longer run is not covered by its sensitivity or accounting."
            )
        return n

    @property
    def label(self) -> str:
        """A short name of how the strategy was made (e.g. ``"band_mf"``, ``"bsr"``)."""
        return getattr(self, "name", self.kind)

    def __repr__(self) -> str:
        extra = f", bands={self.bands}" if self.bands is not None else ""
        return f"{type(self).__name__}({self.label!r}, n_steps={self.n_steps}{extra})"


class ToeplitzLike(Strategy):
    """A strategy whose ``C`` is lower-triangular Toeplitz: first columns do all the work."""

    @property
    def is_toeplitz(self) -> bool:
        return True

    def toeplitz_coefficients(self, n: int | None = None) -> torch.Tensor:
        """The first column of ``C`` (length ``n``)."""
        raise NotImplementedError

    def inverse_toeplitz_coefficients(self, n: int | None = None) -> torch.Tensor:
        """The first column of ``C^{-1}`` (length ``n``)."""
        n = self._n(n)
        return _toeplitz.series_inverse(self.toeplitz_coefficients(n), n)

    def materialize(self, n: int | None = None) -> torch.Tensor:
        n = self._n(n)
        return _toeplitz.materialize(self.toeplitz_coefficients(n), n)

    def materialize_inverse(self, n: int | None = None) -> torch.Tensor:
        n = self._n(n)
        return _toeplitz.materialize(self.inverse_toeplitz_coefficients(n), n)

    def column_norms(self, n: int | None = None) -> torch.Tensor:
        n = self._n(n)
        c = self.toeplitz_coefficients(n)
        return torch.flip(torch.cumsum(c * c, 0), (0,)).sqrt()

    def inverse_row_norms(self, n: int | None = None) -> torch.Tensor:
        g = self.inverse_toeplitz_coefficients(n)
        return torch.cumsum(g * g, 0).sqrt()

    def _sensitivity(self, n: int, min_sep: int, k: int | None) -> tuple[float, bool]:
        c = self.toeplitz_coefficients(n)
        bands = self.bands
        if bands is not None:
            c = c[:bands]
        return _sens.toeplitz_sensitivity(c, n, min_sep, k)

    def per_query_error(self, workload: Workload | None = None, *, n: int | None = None) -> torch.Tensor:
        n = self._n(n, workload)
        a = _workload(workload, n)
        g = self.inverse_toeplitz_coefficients(n)
        if a.is_toeplitz:
            beta = _toeplitz.conv(a.toeplitz_coefficients(), g, n)
            return torch.cumsum(beta * beta, 0)
        b = a.materialize() @ _toeplitz.materialize(g, n)
        return (b * b).sum(dim=1)


# ------------------------------------------------------------------- helpers


@typechecked
def strategy_from_dict(data: dict[str, Any]) -> Strategy:
    """Rebuilds a strategy from :meth:`Strategy.to_dict` output.

    Example:
        >>> from opake_fx.dpftrl import bsr_strategy
        >>> s = bsr_strategy(16, bandwidth=4)
        >>> strategy_from_dict(s.to_dict()).coefficients().tolist() == s.coefficients().tolist()
        True
    """
    if not isinstance(data, dict) or data.get("type") not in _REGISTRY:
        raise InputValueError(
            f"strategy_from_dict: expected the dict of Strategy.to_dict(); got type {data.get('type') if isinstance(data, dict) else type(data).__name__!r}."
        )
    cls = _REGISTRY[data["type"]]
    kwargs = {k: v for k, v in data.items() if k != "type"}
    return cls._from_dict(kwargs)  # type: ignore[attr-defined]


def frozen(x: Any) -> np.ndarray:
    """A read-only float64 numpy copy of ``x`` (tensor, array or list)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    a = np.array(x, dtype=np.float64)
    a.setflags(write=False)
    return a


def toeplitz_column(coefs: torch.Tensor, n: int) -> torch.Tensor:
    """The first column of an ``n x n`` lower-triangular Toeplitz matrix given its leading coefficients.

    The first ``n`` entries of ``coefs``, zero-padded to length ``n`` (a banded matrix
    stores only its bands).

    Args:
        coefs: the leading coefficients, a 1-d tensor.
        n: the size of the matrix.

    Returns:
        A tensor of length ``n``, of the dtype of ``coefs``.

    Example:
        >>> import torch
        >>> toeplitz_column(torch.tensor([1.0, 0.5]), 4).tolist()
        [1.0, 0.5, 0.0, 0.0]
        >>> toeplitz_column(torch.tensor([1.0, 0.5, 0.25]), 2).tolist()
        [1.0, 0.5]
    """
    c = coefs[:n]
    return torch.nn.functional.pad(c, (0, n - c.shape[0]))


def _reduce(errors: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return errors.mean()
    if reduction == "max":
        return errors.max()
    raise InputValueError(f"reduction must be 'mean' or 'max'; got {reduction!r}.")


def _workload(workload: Workload | None, n: int) -> Workload:
    from opake_fx.dpftrl.workloads import resolve_workload

    if workload is None:
        return prefix_workload(n)
    return resolve_workload(workload, n, "per_query_error")


def _pattern(strategy: Strategy, method: str, min_sep: Any, max_participations: Any) -> tuple[int, int | None]:
    where = f"{type(strategy).__name__}.{method}"
    k = None if max_participations is None else check.integer(max_participations, "max_participations", where, minimum=1)
    return check.integer(min_sep, "min_sep", where, minimum=1), k


def check_n_steps(n: Any, where: str, *, allow_none: bool = False) -> int | None:
    """Validates an ``n_steps`` argument (an int >= 1, or ``None`` where ``allow_none``)."""
    if n is None and allow_none:
        return None
    return check.integer(n, "n_steps", where, minimum=1)

"""Accountant: the privacy spent so far, checked against a budget before every step.

Example:
    >>> import opake_fx.accounting as acc
    >>> import opake_fx.dpsgd.accounting as dpsgd_acc
    >>> acct = acc.Accountant(acc.epsilon_budget(1.0, delta=1e-5))
    >>> step = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
    >>> acct |= step * 100
    >>> acct.remaining_steps(step)
    154
    >>> round(acct.epsilon, 3), acct.delta          # spent so far, at the budget's delta
    (0.718, 1e-05)
    >>> acct                                        # one step() call charged the 100 steps at once
    Accountant(epsilon=0.718 per example at delta=1e-05, steps=1, budget: epsilon <= 1 per example at delta=1e-05, pld)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from opake_fx._typecheck import typechecked
from opake_fx.accounting import rdp as _rdp
from opake_fx.accounting.budgets import Budget, budget_from_dict
from opake_fx.accounting.incremental import IncrementalPld

# compose/repeat without their signature check: step() runs once per training step and
# checks its own argument.
from opake_fx.accounting.process import DpProcess, compose_unchecked, identity, process_from_dict, repeat_unchecked
from opake_fx.errors import BudgetExceededError, InputTypeError, InputValueError, OpakeError

__all__ = ["Accountant"]

_STATE_VERSION = 2  # 1: budget and spent; 2: also the running composition (bit-exact resume)


class Accountant:
    """Tracks the composition of every step taken and refuses steps that would exceed the budget.

    Privacy contract: after any sequence of successful :meth:`step` calls, ``spent``
    meets ``budget`` (as measured by the budget's accountant). A refused step raises
    :class:`~opake_fx.errors.BudgetExceededError` and leaves the accountant unchanged, so
    the caller must not release that step's output.

    Cost: with a PLD budget the accountant keeps the composed privacy-loss distribution
    (an :class:`~opake_fx.accounting.IncrementalPld`) and folds each new step in with one
    convolution, so ``T`` different steps cost ``O(T)`` convolutions, and the check of a
    step is reused when the step is then taken. Runs of the same step are grouped: from
    the second consecutive one on, the accountant computes once how many more fit and
    counts down, and folds the whole run in at once (self-composed by repeated squaring)
    when a metric is read or a different step comes. The metrics it reports come from
    that running composition, which is pessimistic and agrees with the one-shot
    ``spent.epsilon_at`` to ~1e-7 (never a bit-exact copy of it). The RDP curve of the
    steps is kept too (summed lazily), so both engines can be reported.

    Checkpoints: :meth:`state_dict` with ``running=True`` (what
    :func:`~opake_fx.serialization.save_checkpoint` saves) holds that running state, so a
    resumed accountant reports and decides bit for bit as the uninterrupted one.

    Args:
        budget: from :func:`epsilon_budget` or :func:`delta_budget`.
        spent: what was already spent (default: nothing); it must meet the budget.
    """

    @typechecked
    def __init__(self, budget: Budget, spent: DpProcess | None = None) -> None:
        if not isinstance(budget, Budget):
            raise InputTypeError(f"Accountant: budget must come from epsilon_budget/delta_budget; got {type(budget).__name__}.")
        spent = identity() if spent is None else spent
        if not isinstance(spent, DpProcess):
            raise InputTypeError(f"Accountant: spent must be a DpProcess; got {type(spent).__name__}.")
        self._budget = budget
        self._counts: dict[DpProcess, int] = {}  # the multiset of single steps spent
        self._spent: DpProcess | None = spent
        self._add_counts(spent)
        # the PLD of everything but the trailing run (PLD budgets only)
        self._pld = IncrementalPld(budget.discretization).then(spent) if budget.accountant == "pld" else None
        self._run: tuple[DpProcess, int] | None = None  # trailing identical steps not folded yet
        self._rdp_sum: np.ndarray | None = None  # RDP of the steps before _rdp_todo
        # the steps not summed yet, as runs (process, n): n consecutive steps of process
        self._rdp_todo: list[tuple[DpProcess, int]] = [(spent, 1)]
        self._probe: tuple[DpProcess, Any, float] | None = None  # (step, composed with it, metric)
        # (process, n): n more runs of `process` fit (computed once when the same process
        # is stepped twice in a row, so long runs are checked in O(1))
        self._headroom: tuple[DpProcess, int] | None = None
        self._last: DpProcess | None = None
        # step() calls recorded; unknown (None) when built from a spent process of unknown length
        self._steps: int | None = 0 if spent == identity() else None

    @property
    def budget(self) -> Budget:
        """The budget every step is checked against."""
        return self._budget

    @property
    def steps(self) -> int | None:
        """How many steps (:meth:`step` calls) were recorded, across checkpoints.

        ``None`` when the accountant was built from a ``spent`` process (its number of
        steps is not known) or restored from a state saved without the count. A
        checkpoint of a :class:`~opake_fx.plan.DPPlan` run checks it against the run's
        other counters (:meth:`opake_fx.plan.DPPlan.load_checkpoint`).
        """
        return self._steps

    @property
    def delta(self) -> float | None:
        """The delta :attr:`epsilon` is reported at: the budget's.

        For an :func:`~opake_fx.accounting.epsilon_budget` (what
        :meth:`opake_fx.plan.DPPlan.accountant` builds, with the plan's ``delta``) it is
        the delta the budget's epsilon is measured at; for a
        :func:`~opake_fx.accounting.delta_budget`, the delta bound. ``None`` for a budget
        without a delta.
        """
        d = getattr(self._budget, "delta", None)
        return None if d is None else float(d)

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far, at :attr:`delta` (the budget's delta), by the budget's accountant.

        The same number as ``spent_epsilon(accountant.delta)``; use :meth:`spent_epsilon`
        for another delta or the other engine.

        Raises:
            InputValueError: the budget has no delta (call ``spent_epsilon(delta)``).

        Example:
            >>> import opake_fx.accounting as acc
            >>> import opake_fx.dpsgd.accounting as dpsgd_acc
            >>> acct = acc.Accountant(acc.epsilon_budget(3.0, delta=1e-5))
            >>> for _ in range(140):
            ...     acct.step(dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01))
            >>> acct.epsilon == acct.spent_epsilon(1e-5), acct.steps
            (True, 140)
        """
        delta = self.delta
        if delta is None:
            raise InputValueError(
                f"Accountant.epsilon: the budget {self._budget!r} has no delta to report epsilon at; call "
                "accountant.spent_epsilon(delta) with the delta you report."
            )
        return self.spent_epsilon(delta)

    @property
    def spent(self) -> DpProcess:
        """The composition of all steps taken so far."""
        if self._spent is None:
            self._spent = compose_unchecked(*(repeat_unchecked(leaf, k) for leaf, k in self._counts.items()))
        return self._spent

    @property
    def budget_exceeded(self) -> bool:
        """True if ``spent`` does not meet the budget (only possible via the constructor)."""
        return self._budget.measure_profile(self._profile()) > self._budget.value

    def spent_epsilon(self, delta: float, *, accountant: str | None = None) -> float:
        """Epsilon spent so far at ``delta``.

        Args:
            delta: in (0, 1).
            accountant: ``None`` (the budget's), ``"pld"`` or ``"rdp"``: both can be
                reported whatever the budget uses (RDP is the cheap cross-check).
        """
        return float(self._profile(accountant).epsilon_at(delta))

    def spent_delta(self, epsilon: float, *, accountant: str | None = None) -> float:
        """Delta spent so far at ``epsilon`` (``accountant`` as in :meth:`spent_epsilon`)."""
        return float(self._profile(accountant).delta_at(epsilon))

    def would_exceed(self, process: DpProcess) -> bool:
        """True if taking ``process`` now would exceed the budget (nothing changes).

        The composition with ``process`` is kept, so a :meth:`step` with the same process
        right after reuses it.
        """
        process = _checked(process)
        if self._headroom is not None and self._headroom[0] == process:
            return self._headroom[1] < 1
        return self._try(process)[1] > self._budget.value

    def step(self, process: DpProcess) -> None:
        """Records ``process`` as spent.

        The first steps are checked directly (one convolution each); from the second
        consecutive step of the same process on, the accountant computes once how many
        more of it fit (:meth:`remaining_steps`) and counts down.

        Raises:
            BudgetExceededError: the step would exceed the budget; nothing is recorded.
        """
        process = _checked(process)
        if self._headroom is None and process == self._last and process._components():
            self._headroom = (process, self.remaining_steps(process))
        if self._headroom is not None and self._headroom[0] == process:
            if self._headroom[1] < 1:
                self._refuse(process, self._try(process)[1])
            self._headroom = (process, self._headroom[1] - 1)
            self._materialize(keep=process)
            self._run = (process, (self._run[1] if self._run else 0) + 1)
        else:
            self._headroom = None
            composed, value = self._try(process)
            if value > self._budget.value:
                self._refuse(process, value)
            self._materialize()
            if self._pld is not None:
                self._pld = composed
        self._add_counts(process)
        last = self._rdp_todo[-1] if self._rdp_todo else None
        if last is not None and (last[0] is process or last[0] == process):
            self._rdp_todo[-1] = (last[0], last[1] + 1)
        else:
            self._rdp_todo.append((process, 1))
        self._probe = None
        self._last = process
        if self._steps is not None:
            self._steps += 1

    def __ior__(self, process: DpProcess) -> Accountant:
        self.step(process)
        return self

    def __or__(self, process: DpProcess) -> Accountant:
        """A new accountant with ``process`` recorded (this one is unchanged)."""
        out = object.__new__(Accountant)
        out.__dict__.update(self.__dict__)
        out._counts = dict(self._counts)
        out._rdp_todo = list(self._rdp_todo)
        out.step(process)
        return out

    def remaining_steps(self, process: DpProcess, *, limit: int = 10**9) -> int:
        """How many more runs of ``process`` fit in the budget (at most ``limit``).

        Each candidate count ``k`` costs one self-composition of ``process`` (repeated
        squaring) and one convolution with the running composition.

        Raises:
            InputValueError: ``process`` spends no privacy (the answer would be unbounded).
        """
        process = _checked(process)
        if not process._components():
            raise InputValueError(
                "remaining_steps: the process spends no privacy, so any number of steps fits."
            )

        def fits(k: int) -> bool:
            return self._measure_with(repeat_unchecked(process, k)) <= self._budget.value

        if not fits(1):
            return 0
        good, bad = 1, 2
        while bad <= limit and fits(bad):
            good, bad = bad, bad * 2
        if bad > limit:
            if fits(limit):
                return limit
            bad = limit
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
        return good

    # ------------------------------------------------------------ internals

    def _add_counts(self, process: DpProcess) -> None:
        for leaf, k in process._components():
            self._counts[leaf] = self._counts.get(leaf, 0) + k
        self._spent = None

    def _materialize(self, keep: DpProcess | None = None) -> None:
        """Folds the trailing run into the running PLD (unless it is a run of ``keep``)."""
        if self._run is None or self._run[0] == keep:
            return
        process, n = self._run
        self._run = None
        if self._pld is not None:
            self._pld = self._pld.then(repeat_unchecked(process, n))

    def _rdp_curve(self) -> np.ndarray:
        done = 0
        try:
            for process, n in self._rdp_todo:
                curve = process.rdp()  # may raise: no RDP curve for this mechanism
                total = self._rdp_sum
                for _ in range(n):  # one addition per step, in step order (as the steps came)
                    total = curve if total is None else total + curve
                self._rdp_sum = total
                done += 1
        finally:
            del self._rdp_todo[:done]
        return self._rdp_sum if self._rdp_sum is not None else np.zeros(len(_rdp.DEFAULT_RDP_ORDERS))

    def _profile(self, accountant: str | None = None) -> Any:
        """Everything spent so far, in the requested engine."""
        engine = self._budget.accountant if accountant is None else accountant
        if engine == "rdp":
            return _RdpProfile(self._rdp_curve())
        if engine != "pld":
            raise InputValueError(f"Accountant: accountant must be None, 'pld' or 'rdp'; got {accountant!r}.")
        if self._pld is None:  # an RDP budget asked for the PLD: compose once
            return self.spent.pld(self._budget.discretization)
        self._materialize()
        return self._pld

    def _try(self, process: DpProcess) -> tuple[Any, float]:
        """The composition with ``process`` and its budgeted metric (kept for the next step)."""
        if self._probe is None or self._probe[0] != process or self._run is not None:
            if self._pld is not None:
                self._materialize()
                composed: Any = self._pld.then(process)
            else:
                composed = _RdpProfile(self._rdp_curve() + process.rdp())
            self._probe = (process, composed, self._budget.measure_profile(composed))
        return self._probe[1], self._probe[2]

    def _measure_with(self, process: DpProcess) -> float:
        if self._pld is not None:
            self._materialize()
            return self._budget.measure_profile(self._pld.then(process))
        return self._budget.measure_profile(_RdpProfile(self._rdp_curve() + process.rdp()))

    def _refuse(self, process: DpProcess, value: float) -> None:
        raise BudgetExceededError(
            f"Accountant: taking {process!r} would spend {self._budget.metric}={value:.6g} > budget "
            f"{self._budget.value:g}; the step was not recorded. Do not release its output: stop "
            "training, or add noise / use fewer steps."
        )

    def state_dict(self, *, running: bool = False) -> dict[str, Any]:
        """The accountant's state: ``{"version": 1, "budget", "spent"}``, plain and JSON-able.

        With ``running=True`` (what :mod:`opake_fx.serialization` saves) the state is
        ``{"version": 2, "budget", "spent", "running"}``: ``"running"`` holds everything
        that decides the next report and the next step's rounding -- the running
        composition (:meth:`IncrementalPld.state_dict`, float64 numpy arrays, so not
        JSON-able), the trailing run of identical steps not folded in yet, the counted-down
        headroom, the last step, and the RDP curve summed so far with the steps not summed
        yet -- so that :meth:`from_state_dict` resumes bit for bit: every later report and
        every accept/refuse decision is the one the uninterrupted accountant makes. It
        also holds :attr:`steps` (``"steps"``; a state saved before it had none restores
        ``steps=None``).

        Without it, :meth:`from_state_dict` recomposes the spent process in one go: the
        restored accountant reports what the uninterrupted one does to ~1e-9 relative
        (another order of convolutions rounds differently), not bit for bit, and at the
        budget's very edge it may accept or refuse one step differently.

        Privacy: the spent process is saved exactly either way; nothing is forgotten.

        Example:
            >>> import opake_fx.accounting as acc
            >>> import opake_fx.dpsgd.accounting as dpsgd_acc
            >>> step = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
            >>> acct = acc.Accountant(acc.epsilon_budget(2.0, delta=1e-5, discretization=1e-3))
            >>> for _ in range(3):
            ...     acct.step(step)
            >>> sorted(acct.state_dict())
            ['budget', 'spent', 'version']
            >>> resumed = acc.Accountant.from_state_dict(acct.state_dict(running=True))
            >>> resumed.step(step); acct.step(step)
            >>> resumed.spent_epsilon(1e-5) == acct.spent_epsilon(1e-5)
            True
        """
        state: dict[str, Any] = {"version": 1, "budget": self._budget.to_dict(), "spent": self.spent.to_dict()}
        if not running:
            return state
        state["version"] = _STATE_VERSION
        state["running"] = {
            "pld": None if self._pld is None else self._pld.state_dict(),
            "run": None if self._run is None else [self._run[0].to_dict(), self._run[1]],
            "headroom": None if self._headroom is None else [self._headroom[0].to_dict(), self._headroom[1]],
            "last": None if self._last is None else self._last.to_dict(),
            "rdp_sum": None if self._rdp_sum is None else np.array(self._rdp_sum, dtype=np.float64),
            "rdp_todo": [[process.to_dict(), n] for process, n in self._rdp_todo],
            "steps": self._steps,
        }
        return state

    @classmethod
    @typechecked
    def from_state_dict(cls, state: dict[str, Any]) -> Accountant:
        """Rebuilds an accountant from :meth:`state_dict` output (either version).

        A version-2 state (``running=True``) resumes bit for bit; a version-1 state
        recomposes the spent process (reports agree to ~1e-9, see :meth:`state_dict`).

        Raises:
            InputValueError: an unknown version, or a field missing or of the wrong form
                (named).

        Privacy: the running composition is not trusted blindly (a checkpoint's digest is a
        checksum, not a MAC): it is compared once with the one-shot composition of the saved
        spent process, and a state that would report less epsilon (beyond 1e-4 relative
        rounding), a lower RDP curve, or a counted-down headroom that no longer fits the
        budget is refused. That comparison costs one composition of the spent process (as
        loading a version-1 state does; closed form when every step is a Gaussian mechanism,
        as a DP-FTRL plan's are).
        """
        version = state.get("version")
        expected = {1: {"version", "budget", "spent"}, 2: {"version", "budget", "spent", "running"}}
        if version not in expected or set(state) != expected[version]:
            raise InputValueError(
                f"Accountant.from_state_dict: expected a state_dict of version 1 or {_STATE_VERSION} "
                f"(keys version, budget, spent[, running]); got {state!r:.200}."
            )
        budget, spent = budget_from_dict(state["budget"]), process_from_dict(state["spent"])
        if version == 1:
            return cls(budget, spent)
        return cls._resumed(budget, spent, state["running"])

    @classmethod
    def _resumed(cls, budget: Budget, spent: DpProcess, running: Any) -> Accountant:
        """The accountant whose running state is ``running`` (see :meth:`state_dict`)."""
        where = "Accountant state/running"
        fields = {"pld", "run", "headroom", "last", "rdp_sum", "rdp_todo"}
        if not isinstance(running, dict) or set(running) - {"steps"} != fields:
            got = sorted(running) if isinstance(running, dict) else type(running).__name__
            raise InputValueError(f"{where}: expected the fields {sorted(fields | {'steps'})}; got {got}.")
        steps = running.get("steps")  # absent in states saved before the count was kept
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise InputValueError(f"{where}/steps: expected None or an int >= 0; got {steps!r}.")
        out = object.__new__(cls)
        out._budget = budget
        out._counts = {}
        out._add_counts(spent)
        out._spent = spent
        pld = running["pld"]
        if (pld is None) != (budget.accountant != "pld"):
            raise InputValueError(
                f"{where}/pld: a {budget.accountant.upper()} budget "
                + ("keeps a running PLD; the state has none." if pld is None else "keeps no running PLD; the state has one.")
            )
        out._pld = None if pld is None else IncrementalPld.from_state_dict(pld)
        out._run = _counted(running["run"], f"{where}/run", 1)
        out._headroom = _counted(running["headroom"], f"{where}/headroom", 0)
        out._last = None if running["last"] is None else _process(running["last"], f"{where}/last")
        for name, pair in (("run", out._run), ("headroom", out._headroom)):
            if pair is not None and pair[0] != out._last:
                raise InputValueError(f"{where}/{name}: its process is not the last step taken.")
        rdp_sum = running["rdp_sum"]
        if rdp_sum is not None:
            n_orders = len(_rdp.DEFAULT_RDP_ORDERS)
            if not isinstance(rdp_sum, np.ndarray) or rdp_sum.dtype != np.float64 or rdp_sum.shape != (n_orders,):
                raise InputValueError(f"{where}/rdp_sum: expected None or a float64 array of shape ({n_orders},).")
            if bool(np.isnan(rdp_sum).any()):
                raise InputValueError(f"{where}/rdp_sum: NaN in the RDP curve.")
            rdp_sum = np.array(rdp_sum, dtype=np.float64)
        out._rdp_sum = rdp_sum
        todo = running["rdp_todo"]
        if not isinstance(todo, list):
            raise InputValueError(f"{where}/rdp_todo: expected a list of [process, count]; got {type(todo).__name__}.")
        out._rdp_todo = []
        for i, item in enumerate(todo):
            run = _counted(item, f"{where}/rdp_todo/{i}", 1)
            if run is None:
                raise InputValueError(f"{where}/rdp_todo/{i}: expected [process, count]; got None.")
            out._rdp_todo.append(run)
        out._probe = None
        out._steps = steps
        if steps == 0 and spent != identity():
            raise InputValueError(f"{where}/steps: 0 steps recorded, but the spent process is {spent!r}.")
        out._check_running_against_spent()
        return out

    def _check_running_against_spent(self) -> None:
        """Refuses a running state that reports less than the saved spent process composes to.

        The running state is not a MAC-protected value: a hand-made, spliced or edited state
        (even with a recomputed checkpoint digest) could carry an empty composition next to a
        long spent process. So it is compared once with the one-shot composition of
        ``spent`` (the version-1 load path's cost): the running PLD (with its pending run)
        must report a delta at least the one-shot one's, less ``_DELTA_TOLERANCE``, on a grid
        of epsilons and at the budget's point; the running RDP curve at least the spent
        one; and a counted-down headroom must still fit in the budget.
        """
        where = "Accountant state/running"
        fix = (
            "Resume from the checkpoint the run saved (its running state and spent process together), or drop "
            "the running state (state_dict() without running=True) to recompose the spent process."
        )
        try:
            spent_rdp: np.ndarray | None = self.spent.rdp()
        except OpakeError:  # a step without an RDP curve: the RDP side is never reported
            spent_rdp = None
        if spent_rdp is not None:
            running_rdp = np.zeros_like(spent_rdp) if self._rdp_sum is None else np.array(self._rdp_sum)
            for process, n in self._rdp_todo:
                running_rdp = running_rdp + n * process.rdp()
            if bool((running_rdp < spent_rdp * (1.0 - 1e-9) - 1e-12).any()):
                raise InputValueError(
                    f"{where}: its RDP curve is below that of the saved spent process (it would under-report "
                    f"epsilon). {fix}"
                )
        if self._pld is not None:
            running = self._pld if self._run is None else self._pld.then(repeat_unchecked(*self._run))
            oneshot = self.spent._profile(self._budget.discretization)  # closed form for Gaussian compositions
            top = oneshot.epsilon_at(_CHECK_DELTA_FLOOR)
            grid = np.linspace(0.0, 1.25 * top if math.isfinite(top) else 100.0, _CHECK_POINTS).tolist()
            if self._budget.metric == "epsilon":
                grid.append(oneshot.epsilon_at(self._budget.delta))
            else:
                grid.append(self._budget.epsilon)
            for e in grid:
                got, want = running.delta_at(e), oneshot.delta_at(e)
                if got < want - _DELTA_TOLERANCE:
                    raise InputValueError(
                        f"{where}: the running composition reports delta={got:.6g} at epsilon={e:.6g}, below the "
                        f"{want:.6g} that the saved spent process composes to (it would under-report what was spent): "
                        f"the running state does not belong to this spent process. {fix}"
                    )
            if self._headroom is not None and self._headroom[1] > 0:
                process, n = self._headroom
                if self._budget.measure_profile(running.then(repeat_unchecked(process, n))) > self._budget.value * (1.0 + _RUNNING_TOLERANCE):
                    raise InputValueError(
                        f"{where}/headroom: {n} more steps of {process!r} do not fit in the budget; the accountant "
                        f"would take them unchecked. {fix}"
                    )
        elif self._headroom is not None and self._headroom[1] > 0 and spent_rdp is not None:
            process, n = self._headroom
            if self._budget.measure_profile(_RdpProfile(spent_rdp + n * process.rdp())) > self._budget.value * (1.0 + _RUNNING_TOLERANCE):
                raise InputValueError(
                    f"{where}/headroom: {n} more steps of {process!r} do not fit in the budget; the accountant "
                    f"would take them unchecked. {fix}"
                )

    def __repr__(self) -> str:
        """``Accountant(epsilon=... per example at delta=..., steps=..., budget: ...)``: what was spent and against what.

        The unit (``per example`` / ``per user``) is the budget's :attr:`~Budget.unit`.

        The full composition is :attr:`spent`.
        """
        if self.delta is None:
            spent = f"spent={self.spent!r}"
        else:
            try:
                spent = f"epsilon={self.epsilon:.4g} {self._budget.per_unit} at delta={self.delta:g}"
            except OpakeError:  # a mechanism without a PLD/RDP curve for this engine: show the composition
                spent = f"spent={self.spent!r}"
        steps = "unknown" if self._steps is None else str(self._steps)
        return f"Accountant({spent}, steps={steps}, budget: {_budget_line(self._budget)})"


def _budget_line(budget: Budget) -> str:
    """``epsilon <= 3 per example at delta=1e-05, pld`` (or the budget's repr for a budget of another kind)."""
    eps, delta = getattr(budget, "epsilon", None), getattr(budget, "delta", None)
    if budget.metric == "epsilon" and eps is not None and delta is not None:
        return f"epsilon <= {eps:g} {budget.per_unit} at delta={delta:g}, {budget.accountant}"
    if budget.metric == "delta" and eps is not None and delta is not None:
        return f"delta <= {delta:g} {budget.per_unit} at epsilon={eps:g}, {budget.accountant}"
    return repr(budget)


# A resumed running composition is compared with the one-shot one in delta at _CHECK_POINTS
# epsilons from 0 to 1.25 x the one-shot epsilon at delta = _CHECK_DELTA_FLOOR (and at the
# budget's point); honest pairs differ by <= ~1e-12 in delta there (their tails are cut
# differently), so _DELTA_TOLERANCE is what a state may under-report by. Headroom checks allow
# _RUNNING_TOLERANCE (relative) for the other order of composition.
_CHECK_POINTS = 64
_CHECK_DELTA_FLOOR = 1e-12
_DELTA_TOLERANCE = 1e-11
_RUNNING_TOLERANCE = 1e-4


class _RdpProfile:
    """Metrics of an RDP curve on the default orders (the RDP side of the accountant)."""

    def __init__(self, curve: np.ndarray) -> None:
        self.curve = curve

    def epsilon_at(self, delta: float) -> float:
        return _rdp.epsilon_from_rdp(_rdp.DEFAULT_RDP_ORDERS, self.curve, delta)

    def delta_at(self, epsilon: float) -> float:
        return _rdp.delta_from_rdp(_rdp.DEFAULT_RDP_ORDERS, self.curve, epsilon)


def _process(data: Any, where: str) -> DpProcess:
    if not isinstance(data, dict):
        raise InputValueError(f"{where}: expected a process dict; got {type(data).__name__}.")
    return process_from_dict(data)


def _counted(data: Any, where: str, minimum: int) -> tuple[DpProcess, int] | None:
    """``[process dict, count]`` (count an int >= ``minimum``) as ``(process, count)``; None stays None."""
    if data is None:
        return None
    if not isinstance(data, (list, tuple)) or len(data) != 2:
        raise InputValueError(f"{where}: expected None or [process, count]; got {data!r:.100}.")
    count = data[1]
    if isinstance(count, bool) or not isinstance(count, int) or count < minimum:
        raise InputValueError(f"{where}: the count must be an int >= {minimum}; got {count!r}.")
    return _process(data[0], where), count


def _checked(process: object) -> DpProcess:
    if not isinstance(process, DpProcess):
        raise InputTypeError(f"Accountant: expected a DpProcess step; got {type(process).__name__}.")
    return process

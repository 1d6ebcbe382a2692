"""An end-to-end audit of a DP-SGD configuration in one training run.

:func:`audit_dpsgd` adds Dirac canaries (gradient-space canaries on an extra
parameter vector the model never reads) to the data, includes each by a fair coin,
trains once with the plan's sampler, clipping, noise and accountant, scores every
canary by its coordinate of the total update, and returns the empirical lower bounds
next to the accountant's epsilon. A correct mechanism audits below its claim; a
mechanism whose noise or clipping is broken while the accountant still claims the same
epsilon audits above it.

With ``user_ids=`` the audit is user-level (:mod:`opake_fx.auditing.users`): each canary
is a *user* with ``canary_examples`` rows that all carry its Dirac direction, the coin
includes or excludes the whole user, and the bounds are on the epsilon *per user*, next
to the accountant's epsilon per user: of user-level sampling (``user_sampling="users"``)
or of example-level sampling with each user capped at ``max_examples_per_user`` and the
group privacy conversion (``user_sampling="examples"``).

Example:
    >>> import torch
    >>> from opake_fx.random import key
    >>> x = torch.randn(200, 3, generator=torch.Generator().manual_seed(0))
    >>> loss = lambda w, xi: ((xi * w).sum() - 1.0) ** 2
    >>> r = audit_dpsgd(loss, torch.zeros(3), (x,), key=key(0), num_canaries=200, batch_size=40, steps=20,
    ...                 noise_multiplier=1.0, delta=1e-5)
    >>> r.epsilon_lower < r.epsilon_accountant
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opake_fx.auditing._canary_run import pad_rows, param_leaves, row_loss, train_slots
from opake_fx.auditing.canaries import CoinFlip, coin_flip, dirac_canaries
from opake_fx.auditing.single_run import OneRunEstimate, one_run
from opake_fx.auditing.scores import canary_scores
from opake_fx.auditing.two_sample import CanaryScoreAuditor
from opake_fx.auditing.users import audit_users, check_user_arguments
from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["AuditResult", "audit_dpsgd"]


@dataclass(frozen=True)
class AuditResult:
    """What :func:`audit_dpsgd` measured.

    Attributes:
        epsilon_lower: the largest of the three bounds below, each at
            ``significance / 3``, so it holds at ``1 - significance`` for a mechanism
            with a Gaussian-shaped trade-off curve (DP-SGD, by the CLT).
        epsilon_any_mechanism: Steinke et al.'s one-run bound: holds for every
            (epsilon, delta)-DP mechanism, but cannot exceed the ceiling of the canary
            count (3.6 for 1000 canaries at delta 1e-5: :func:`perfect_attack_ceiling`).
        epsilon_fdp: the f-DP one-run bound with Gaussian trade-offs (Mahloujifar et al.).
        epsilon_gdp: the two-sample mu-GDP bound on the in/out scores (the Dirac
            canaries' scores are independent given the coins, so the rates are binomial).
        epsilon_accountant: the epsilon the accountant charged for the run.
        delta, significance: of the bounds.
        estimate: the scores and coins (:class:`OneRunEstimate`), e.g. for ``attack_auc()``.
        auditor: the same scores as a :class:`CanaryScoreAuditor`.
        plan: the :class:`~opake_fx.plan.DPPlan` of the run (dataset_size includes the canary slots;
            of a user-level plan, the canary users).
        params: the trained model parameters.
        unit: what one epsilon protects: ``"per example"``, or ``"per user"`` for a
            user-level audit (``audit_dpsgd(user_ids=...)``), where every epsilon above,
            the accountant's included, is per user.
    """

    epsilon_lower: float
    epsilon_any_mechanism: float
    epsilon_fdp: float
    epsilon_gdp: float
    epsilon_accountant: float
    delta: float
    significance: float
    estimate: OneRunEstimate
    auditor: CanaryScoreAuditor
    plan: Any
    params: Any
    unit: str = "per example"

    @property
    def consistent(self) -> bool:
        """True when the lower bound does not contradict the accountant (``epsilon_lower <= epsilon_accountant``)."""
        return self.epsilon_lower <= self.epsilon_accountant

    def __str__(self) -> str:
        verdict = "consistent with" if self.consistent else "CONTRADICTS"
        return (f"audit at {1 - self.significance:.0%} confidence, delta={self.delta:g}: epsilon {self.unit} >= "
                f"{self.epsilon_lower:.3f} (one-run any mechanism {self.epsilon_any_mechanism:.3f}, f-DP "
                f"{self.epsilon_fdp:.3f}, GDP {self.epsilon_gdp:.3f}); {verdict} the accountant's epsilon "
                f"{self.unit} {self.epsilon_accountant:.3f}")


def audit_dpsgd(
    loss_fn: Callable[..., Any],
    params: Any,
    data: Sequence[Any],
    *,
    key: Any,
    steps: int,
    num_canaries: int = 1000,
    batch_size: float | None = None,
    sample_rate: float | None = None,
    clipping_norm: float = 1.0,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    delta: float = 1e-5,
    optimizer: Any = None,
    learning_rate: float = 0.1,
    canary_norm: float | None = None,
    significance: float = 0.05,
    pipeline: Callable[..., Any] | None = None,
    sampler: Callable[..., Any] | None = None,
    progress: bool = False,
    user_ids: Any = None,
    max_examples_per_user: int | None = None,
    canary_examples: int | None = None,
    user_sampling: str = "users",
) -> AuditResult:
    """Trains once with Dirac canaries and returns the empirical epsilon lower bound and the accountant's.

    Args:
        loss_fn: ``loss_fn(params, *example)``: the scalar loss of ONE example (the
            ``"vmap"`` clipping backend). It must be finite on an all-zeros example
            (the canary rows carry zeros; their model loss is multiplied by 0).
        params: the model's initial parameters (a tensor or pytree of tensors).
        data: the ordinary examples, a sequence of tensors with the same first dimension.
        key: an :func:`opake_fx.random.key`; split into the coin flip, the canaries,
            the sampler and the noise keys (user-level: and the cap's key).
        steps: training steps.
        num_canaries: Dirac canaries added (slots ``len(data[0])..`` of the dataset; with
            ``user_ids``, canary users numbered after the ordinary users).
        batch_size, sample_rate: the plan's sampling (one of them), over ordinary
            examples *plus* canary slots (``user_sampling="users"``: over users, the
            ordinary ones plus the canary users).
        clipping_norm: C.
        target_epsilon, noise_multiplier: the plan's budget (one of them) at ``delta``.
        delta: the delta of the plan and of the bounds.
        optimizer: a :mod:`opake_fx.optimizers` transform (default ``sgd(learning_rate)``).
        learning_rate: of the default optimizer.
        canary_norm: the canaries' gradient norm (default ``10 * clipping_norm``, so a
            pipeline that does not clip to C shows it).
        significance: the bounds hold with probability ``1 - significance``.
        pipeline: ``pipeline(plan, loss_fn, optimizer, key) -> Transform`` building the
            training pipeline (default ``plan.pipeline(loss_fn, optimizer, key=key,
            batch_argnums=...)``): the hook to audit your own pipeline against the plan's accountant.
        sampler: ``sampler(plan, slots, key) -> batch sampler`` over ``slots`` (a
            ``range`` of all ``dataset_size`` slots; default ``plan.sampler(slots, key)``):
            the hook to audit your own batch sampler. Excluded canaries are dropped
            from its batches either way.
        progress: show a progress bar (tqdm if installed, else a line on stderr).
        user_ids: one user id per ordinary example (ints or strings, as
            :class:`~opake_fx.users.UserIndex` takes them). When given, the audit is
            user-level (:mod:`opake_fx.auditing.users`): each canary is a canary *user*,
            included or excluded whole by its coin, and every epsilon is per user
            (:attr:`AuditResult.unit` ``"per user"``).
        max_examples_per_user: ``k``, required with ``user_ids`` (refused without): the
            most examples of one user in a step (``"users"``) or in the capped data
            (``"examples"``).
        canary_examples: with ``user_ids``: the rows of each canary user (default ``k``),
            all carrying the canary's direction. More than ``k`` is allowed: the user-level
            sampler then uses a keyed subset of ``k`` each step, and the example-level cap
            keeps ``k``.
        user_sampling: with ``user_ids``: ``"users"`` (user-level sampling: the plan is
            ``DPPlan(privacy_unit="user", dataset_size=<ordinary users + num_canaries>)``,
            and ``batch_size`` counts users) or ``"examples"`` (the plan
            ``DPPlan(privacy_unit="user", user_sampling="examples")`` over the ordinary
            rows and the canary users' rows: every user capped at ``k`` rows for the run,
            rows Poisson-sampled, the claim per user by group privacy for ``k``;
            ``target_epsilon`` is then per user). In a user-level audit the ``sampler``
            hook is called as ``sampler(plan, slots, key, user_ids=ids)`` (``slots`` the
            rows, ``ids`` one user number per row; under ``"users"`` it yields lists of
            groups, under ``"examples"`` row indices) and the ``pipeline`` hook's transform gets the
            batch ``(*blocks, which, mask)`` of :func:`~opake_fx.users.collate_users`
            under ``"users"``; ``loss_fn`` given to the hook is the per-row loss either way.

    Returns:
        An :class:`AuditResult`.

    Raises:
        InputTypeError / InputValueError: a bad key, data, count or hook argument; user
            arguments without ``user_ids``, ``user_ids`` of the wrong length or without
            ``max_examples_per_user``, ``canary_examples < 1``, an unknown
            ``user_sampling``.

    Privacy contract: the accountant charges ``plan.steps`` times ``plan.step_cost``
    (before the first step), as a training run would; the audit checks that the pipeline delivers it. The run's model
    is trained on the ordinary data as usual, so the audit doubles as a training run
    (the canaries only touch their own parameter vector). A user-level audit checks the
    claim per user: under ``"users"`` the plan's own (its unit is the user), under
    ``"examples"`` :func:`~opake_fx.users.user_epsilon_of_examples` of the plan's run
    over the capped data and canary users (so the group is the largest user, measured).
    The user-level model trains on the capped data (``"examples"``) or on each drawn
    user's mean loss (``"users"``).
    """
    import torch

    from opake_fx.optimizers import sgd
    from opake_fx.plan import DPPlan
    from opake_fx.random import RngKey, split

    if not isinstance(key, RngKey):
        raise InputTypeError(f"audit_dpsgd needs key=opake_fx.random.key(seed); got {type(key).__name__}.")
    tensors = tuple(data)
    if not tensors or any(not isinstance(t, torch.Tensor) for t in tensors):
        raise InputTypeError("audit_dpsgd: data must be a non-empty sequence of tensors (e.g. (x, y)).")
    n = len(tensors[0])
    if any(len(t) != n for t in tensors):
        raise InputValueError(f"audit_dpsgd: the data tensors have different lengths {[len(t) for t in tensors]}.")
    m = int(num_canaries)
    if m < 2:
        raise InputValueError(f"audit_dpsgd: num_canaries must be >= 2; got {num_canaries}.")
    unit_args = check_user_arguments(n, user_ids, max_examples_per_user, canary_examples, user_sampling,
                                     target_epsilon)
    opt = optimizer if optimizer is not None else sgd(learning_rate)
    norm = float(canary_norm if canary_norm is not None else 10 * clipping_norm)
    if unit_args is not None:
        plan_args = dict(batch_size=batch_size, sample_rate=sample_rate, steps=steps, clipping_norm=clipping_norm,
                         target_epsilon=target_epsilon, noise_multiplier=noise_multiplier, delta=delta,
                         clip_backend="vmap")
        scores, flip, eps_user, plan, trained = audit_users(
            loss_fn, params, tensors, unit_args, key=key, num_canaries=m, plan_args=plan_args, canary_norm=norm,
            optimizer=opt, pipeline=pipeline, sampler=sampler, progress=progress)
        return _result(scores, flip, eps_user, plan, trained, delta, significance, unit="per user")
    total = n + m
    plan = DPPlan(dataset_size=total, batch_size=batch_size, sample_rate=sample_rate, steps=steps,
                  clipping_norm=clipping_norm, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
                  delta=delta, clip_backend="vmap")
    k_flip, k_canary, k_sampler, k_noise = split(key, 4)
    flip = coin_flip(total, m, k_flip, candidate_indices=np.arange(n, total))
    canaries = dirac_canaries(m, k_canary, norm=norm)
    dtype = next(iter(param_leaves(params))).dtype
    audit_params = (params, torch.zeros(m, dtype=dtype))
    padded = pad_rows(tensors, m)
    audit_loss = row_loss(loss_fn, canaries)
    argnums = tuple(range(1, len(tensors) + 2))
    if pipeline is None:
        pipe = plan.pipeline(audit_loss, opt, key=k_noise, batch_argnums=argnums)
    else:
        pipe = pipeline(plan, audit_loss, opt, k_noise)
    accountant, state, p = plan.accountant(), pipe.init(audit_params), audit_params
    # The whole planned run is charged before it starts (one composition instead of one per
    # step; the accountant refuses it up front if it exceeds the budget).
    accountant.step(plan.step_cost * plan.steps)
    slots = range(total)
    inner = plan.sampler(slots, k_sampler) if sampler is None else sampler(plan, slots, k_sampler)
    batches = flip.sampler(inner)
    slot_to_canary = np.full(total, -1, dtype=np.int64)
    slot_to_canary[flip.canary_indices] = np.arange(m)
    p = train_slots(pipe, state, p, padded, batches, slot_to_canary, m, dtype, progress)
    # canary j sits at slot flip.canary_indices[j]; its coordinate is canaries.coordinates[j]
    scores = canary_scores(canaries.scores(p[1] - audit_params[1]), flip.canary_indices)
    return _result(scores, flip, accountant.spent_epsilon(delta), plan, p[0], delta, significance)


def _result(scores: Any, flip: CoinFlip, eps_accountant: float, plan: Any, params: Any, delta: float,
            significance: float, unit: str = "per example") -> AuditResult:
    estimate = one_run(scores, flip)
    auditor = CanaryScoreAuditor(estimate.scores[estimate.included], estimate.scores[~estimate.included])
    share = significance / 3
    any_mechanism = estimate.epsilon_at(delta, share)
    fdp = estimate.epsilon_fdp_at(delta, share)
    gdp = auditor.epsilon_from_gdp(share, delta)
    return AuditResult(epsilon_lower=max(any_mechanism, fdp, gdp), epsilon_any_mechanism=any_mechanism,
                       epsilon_fdp=fdp, epsilon_gdp=gdp, epsilon_accountant=float(eps_accountant), delta=delta,
                       significance=significance, estimate=estimate, auditor=auditor, plan=plan, params=params,
                       unit=unit)

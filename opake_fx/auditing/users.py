"""User-level audits: canary *users* for :func:`~opake_fx.auditing.audit_dpsgd` (``user_ids=...``).

A user-level guarantee protects everything one person contributed, so its audit inserts
canary users, not canary examples: canary ``j`` is a user with ``canary_examples`` rows,
every row carrying canary ``j``'s Dirac direction (the gradient ``-norm * sign_j *
e_{coordinate_j}`` on the extra parameter vector; the rows' model inputs are zeros and
their model loss is multiplied by 0), and one fair coin includes or excludes the whole
user. Each canary is then scored by its coordinate of the total update, as in the
example-level audit, and the one-run, f-DP and GDP lower bounds are bounds on the
epsilon *per user*. Two ways of training, each against its own claim per user:

* ``user_sampling="users"`` (ULS, :mod:`opake_fx.users`): the plan is
  ``DPPlan(privacy_unit="user", max_examples_per_user=k, dataset_size=<ordinary users +
  canaries>)``; the sampler draws users and up to ``k`` of their rows (a keyed subset of
  a canary user who has more), the pipeline clips each user's mean gradient once, and
  the claim is the plan's accountant (its unit is the user). A pipeline that clips each
  row instead lets a canary user of ``k`` rows move its coordinate ``k`` times as far,
  which the audit sees.
* ``user_sampling="examples"`` (ELS): the plan is ``DPPlan(privacy_unit="user",
  user_sampling="examples", max_examples_per_user=k)`` over the ordinary rows and the
  canary users' rows: its sampler caps every user (canary users included) at ``k`` rows
  for the whole run and samples rows; the claim is the plan's epsilon per user (group
  privacy for ``k``; ``target_epsilon`` is per user), checked against
  :func:`~opake_fx.users.user_epsilon_of_examples` of the run for the largest user's
  measured count in the capped data.

The coin flip is over users in both: canary ``j`` is user number ``n_users + j`` (the
ordinary users are numbered ``0 .. n_users - 1`` by first example, as
:class:`~opake_fx.users.UserIndex` numbers them), and that number is its id in the
scores (``result.estimate.canary_ids``).

Privacy contract: the coins are fair, from a key of their own, and an excluded canary
user is dropped whole from every step (under Poisson sampling of users, or of slots,
dropping a unit from every batch is training without it; the other units keep their
rates). The claim audited is per user for add-or-remove-one-user neighbours.

Example:
    >>> import torch
    >>> from opake_fx.auditing import audit_dpsgd
    >>> from opake_fx.random import key
    >>> x = torch.randn(60, 3, generator=torch.Generator().manual_seed(0))
    >>> loss = lambda w, xi: ((xi * w).sum() - 1.0) ** 2
    >>> r = audit_dpsgd(loss, torch.zeros(3), (x,), key=key(0), user_ids=[i % 20 for i in range(60)],
    ...                 max_examples_per_user=3, num_canaries=50, batch_size=20, steps=5,
    ...                 noise_multiplier=1.0, delta=1e-5)
    >>> r.unit, r.plan.dataset_size, r.consistent   # 20 ordinary users + 50 canary users
    ('per user', 70, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from opake_fx.auditing._canary_run import pad_rows, param_leaves, progress_bar, row_loss, train_slots
from opake_fx.auditing.canaries import CoinFlip, coin_flip, dirac_canaries
from opake_fx.auditing.scores import CanaryScores, canary_scores
from opake_fx.errors import InputValueError

__all__: list[str] = []  # reached through audit_dpsgd(user_ids=...)

USER_SAMPLING = ("users", "examples")


@dataclass(frozen=True)
class _UserArgs:
    """The checked user-level arguments of one audit."""

    user_ids: list[Any]
    k: int
    canary_examples: int
    sampling: str


def check_user_arguments(n: int, user_ids: Any, max_examples_per_user: Any, canary_examples: Any, user_sampling: Any,
                         target_epsilon: Any) -> _UserArgs | None:
    """The user-level arguments of :func:`~opake_fx.auditing.audit_dpsgd`, checked; ``None`` for an example-level audit.

    Raises:
        InputValueError: see :func:`~opake_fx.auditing.audit_dpsgd`.
    """
    import opake_fx.validation as check

    sampling = check.choice(user_sampling, "user_sampling", "audit_dpsgd", USER_SAMPLING,
                            hint="'users': user-level sampling (each user drawn and clipped as one unit); 'examples': "
                                 "example-level sampling with each user capped at max_examples_per_user, accounted "
                                 "per user by group privacy.")
    if user_ids is None:
        given = [f"{name}={value!r}" for name, value, default in (
            ("max_examples_per_user", max_examples_per_user, None), ("canary_examples", canary_examples, None),
            ("user_sampling", user_sampling, "users")) if value != default]
        if given:
            raise InputValueError(
                f"audit_dpsgd: {', '.join(given)} applies to a user-level audit; give user_ids=... too (one user id per "
                "example of data), or leave it out for an example-level audit."
            )
        return None
    ids = user_ids.tolist() if hasattr(user_ids, "tolist") else list(user_ids)
    if len(ids) != n:
        raise InputValueError(f"audit_dpsgd: {len(ids)} user ids for {n} examples; give one user id per example of "
                              "data (len(data[0])).")
    if max_examples_per_user is None:
        raise InputValueError(
            "audit_dpsgd(user_ids=...) needs max_examples_per_user=k: the most examples of one user in a step "
            "(user_sampling='users') or in the capped data (user_sampling='examples'), e.g. 8."
        )
    k = check.integer(max_examples_per_user, "max_examples_per_user", "audit_dpsgd", minimum=1)
    ce = k if canary_examples is None else check.integer(
        canary_examples, "canary_examples", "audit_dpsgd", minimum=1,
        hint="It is the number of rows of each canary user (default max_examples_per_user).")
    return _UserArgs(user_ids=ids, k=k, canary_examples=ce, sampling=sampling)


def audit_users(loss_fn: Callable[..., Any], params: Any, tensors: tuple[Any, ...], args: _UserArgs, *, key: Any,
                num_canaries: int, plan_args: dict[str, Any], canary_norm: float, optimizer: Any,
                pipeline: Callable[..., Any] | None, sampler: Callable[..., Any] | None, progress: bool,
                ) -> tuple[CanaryScores, CoinFlip, float, Any, Any]:
    """The user-level run (``user_sampling`` ``"users"`` or ``"examples"``) from
    :func:`~opake_fx.auditing.audit_dpsgd`'s checked arguments: the canary users' scores, their
    coin flip (over users), the claim per user, the plan and the trained model parameters."""
    import torch

    from opake_fx.random import split
    from opake_fx.users import UserIndex

    m = num_canaries
    users = UserIndex(args.user_ids)
    n_users = users.n_users
    row_user = np.empty(users.n_examples, dtype=np.int64)
    for u in range(n_users):
        row_user[users.examples_of(u)] = u
    k_flip, k_canary, k_sampler, k_noise = split(key, 4)
    # one coin per canary USER: canary j is user n_users + j
    flip = coin_flip(n_users + m, m, k_flip, candidate_indices=np.arange(n_users, n_users + m))
    canaries = dirac_canaries(m, k_canary, norm=canary_norm)
    dtype = next(iter(param_leaves(params))).dtype
    audit_params = (params, torch.zeros(m, dtype=dtype))
    run = _Run(row_loss(loss_fn, canaries), optimizer, audit_params, k_noise, pipeline, tuple(range(1, len(tensors) + 2)))
    if args.sampling == "users":
        plan, p, eps = _users(tensors, args, row_user, n_users, flip, run, plan_args, k_sampler, sampler, dtype, progress)
    else:
        plan, p, eps = _examples(tensors, args, users, row_user, n_users, flip, run, plan_args, k_sampler, sampler,
                                 dtype, progress)
    scores = canary_scores(canaries.scores(p[1] - audit_params[1]), flip.canary_indices)
    return scores, flip, eps, plan, p[0]


@dataclass(frozen=True)
class _Run:
    """What both ways of training share: the per-row loss, the optimizer, the parameters, the noise key, the hook."""

    loss: Callable[..., Any]
    optimizer: Any
    params: Any
    noise_key: Any
    pipeline: Callable[..., Any] | None
    argnums: tuple[int, ...]

    def build(self, plan: Any) -> Any:
        if self.pipeline is None:
            return plan.pipeline(self.loss, self.optimizer, key=self.noise_key, batch_argnums=self.argnums)
        return self.pipeline(plan, self.loss, self.optimizer, self.noise_key)

    def charge(self, plan: Any) -> Any:
        """The plan's accountant with the whole run charged before the first step (refused up front if over budget)."""
        accountant = plan.accountant()
        accountant.step(plan.step_cost * plan.steps)
        return accountant


def _users(tensors: tuple[Any, ...], args: _UserArgs, row_user: np.ndarray, n_users: int, flip: CoinFlip, run: _Run,
           plan_args: dict[str, Any], k_sampler: Any, sampler: Callable[..., Any] | None, dtype: Any,
           progress: bool) -> tuple[Any, Any, float]:
    """ULS: canary users of ``canary_examples`` rows in a user-level plan; the claim is the plan's, per user."""
    import torch

    from opake_fx.plan import DPPlan
    from opake_fx.transforms import apply_updates
    from opake_fx.users import collate_users

    m, ce, k, n = flip.num_canaries, args.canary_examples, args.k, len(row_user)
    rows = n + m * ce
    row_canary = np.concatenate([np.full(n, -1, dtype=np.int64), np.repeat(np.arange(m), ce)])
    ids = np.concatenate([row_user, n_users + np.repeat(np.arange(m), ce)]).tolist()
    row_out = np.zeros(rows, dtype=bool)
    row_out[n:] = np.repeat(~flip.included, ce)
    plan = DPPlan(privacy_unit="user", max_examples_per_user=k, dataset_size=n_users + m, **plan_args)
    pipe = run.build(plan)
    accountant = run.charge(plan)
    slots = range(rows)
    inner = plan.sampler(slots, k_sampler, user_ids=ids) if sampler is None else sampler(plan, slots, k_sampler,
                                                                                          user_ids=ids)
    padded, index, canary_of = pad_rows(tensors, m * ce), torch.arange(rows), torch.as_tensor(row_canary)
    state, p = pipe.init(run.params), run.params
    bar = progress_bar(plan.steps, progress)
    for groups in _drop_rows(inner, row_out):
        (*blocks, rix), mask = collate_users((*padded, index), groups, k)
        c = torch.where(mask, canary_of[rix], -1)
        which = torch.zeros((*mask.shape, m), dtype=dtype)
        hit = torch.nonzero(c >= 0)
        which[hit[:, 0], hit[:, 1], c[hit[:, 0], hit[:, 1]]] = 1.0
        updates, state = pipe.update((*blocks, which, mask), state, p)
        p = apply_updates(p, updates)
        bar(1)
    bar(None)
    return plan, p, accountant.spent_epsilon(plan_args["delta"])


def _drop_rows(inner: Any, out: np.ndarray) -> Iterator[list[list[int]]]:
    """Each step's groups without the excluded canary users' rows (a group left empty is dropped)."""
    for groups in inner:
        kept = [[int(i) for i in g if not out[int(i)]] for g in groups]
        yield [g for g in kept if g]


def _examples(tensors: tuple[Any, ...], args: _UserArgs, users: Any, row_user: np.ndarray, n_users: int,
              flip: CoinFlip, run: _Run, plan_args: dict[str, Any], k_sampler: Any, sampler: Callable[..., Any] | None,
              dtype: Any, progress: bool) -> tuple[Any, Any, float]:
    """ELS: the plan ``user_sampling="examples"`` over the ordinary rows and ``canary_examples`` rows per canary
    user; the claim is the plan's epsilon per user (group privacy for ``k``), checked against the measured group."""
    import torch

    from opake_fx.plan import DPPlan
    from opake_fx.users import UserIndex, user_epsilon_of_examples

    m, k, ce, n = flip.num_canaries, args.k, args.canary_examples, len(row_user)
    rows = n + m * ce
    ids = np.concatenate([row_user, n_users + np.repeat(np.arange(m), ce)]).tolist()
    all_users = UserIndex(ids)
    plan = DPPlan(privacy_unit="user", user_sampling="examples", max_examples_per_user=k,
                  dataset_size=all_users.capped_size(k), **plan_args)
    pipe = run.build(plan)
    accountant = run.charge(plan)
    slots = range(rows)
    inner = plan.sampler(slots, k_sampler, user_ids=ids) if sampler is None else sampler(plan, slots, k_sampler,
                                                                                          user_ids=ids)
    # one coin per canary user, repeated over its rows: the excluded users' rows never appear
    row_flip = CoinFlip(dataset_size=rows, canary_indices=np.arange(n, rows, dtype=np.int64),
                        included=np.repeat(flip.included, ce))
    row_to_canary = np.concatenate([np.full(n, -1, dtype=np.int64), np.repeat(np.arange(m), ce)])
    p = train_slots(pipe, pipe.init(run.params), run.params, pad_rows(tensors, m * ce), row_flip.sampler(inner),
                    row_to_canary, m, dtype, progress)
    claim = plan.spent_epsilons(accountant)["per_user"]
    kept = getattr(inner, "indices", None)  # the rows the plan's cap keeps (a hooked sampler may not say)
    if kept is not None:
        measured = user_epsilon_of_examples(plan.run_cost(plan.noise_multiplier, plan.steps),
                                            UserIndex([ids[i] for i in kept]), plan_args["delta"],
                                            accountant=plan.accountant_kind)
        claim = max(claim, measured)  # the cap held: the largest kept user has at most k rows, so they agree
    return plan, p, claim

"""User-level DP: the user, not the example, as the unit of privacy (user-level sampling).

A data set with many examples per person (messages, reviews, records) protects a user
who wrote 300 examples only by group privacy over 300 examples, which says nothing.
User-level sampling (ULS; Charles et al. 2024, "Fine-tuning large language models with
user-level differential privacy") makes the user the unit instead:

1. :class:`UserIndex` records which examples each user owns (an id per example);
2. :class:`UserPoissonSampler` draws each *user* independently with probability
   ``sample_rate`` and, for each drawn user, up to ``max_examples`` of their examples
   (a keyed random subset when they have more);
3. :func:`collate_users` stacks a step's users into blocks ``[U, max_examples, ...]``
   with a mask ``[U, max_examples]`` of the real examples;
4. :func:`user_loss` (one user's block, for ``clip_backend="vmap"``) or
   :func:`batched_user_loss` (all blocks, for ``"ghost"``/``"auto"``) makes the loss of
   one unit the mean of its examples' losses, so the clip stage, which clips each unit
   along the leading axis, clips each *user's* mean gradient to ``clipping_norm``.

The rest of a DP-SGD pipeline is unchanged: ``normalize_by`` is the expected number of
users per step, and the accounting is DP-SGD's with users as the units,
``poisson(gaussian(noise_multiplier), sample_rate) * steps``.

Privacy: under add-or-remove-one-*user* neighbours (all of one user's examples present or
absent) a step's clipped sum changes by at most ``clipping_norm`` (the user is one unit,
whatever the number of their examples), the user's inclusion is an independent
``Bernoulli(sample_rate)`` coin from the key, and which of their examples are used depends
only on the key and their count. So the accountant's epsilon is an epsilon *per user*. A
user's examples beyond ``max_examples`` in a step are left out (never merged into another
unit), and an example belongs to exactly one user.

Example:
    >>> import torch
    >>> from opake_fx.random import key
    >>> users = UserIndex(["ann", "bob", "ann", "cy", "ann"])
    >>> users.n_users, users.examples_of(0)
    (3, [0, 2, 4])
    >>> sampler = UserPoissonSampler(users, sample_rate=1.0, max_examples=2, n_steps=1, key=key(0))
    >>> groups = sampler.batch(0)
    >>> [len(g) for g in groups]
    [2, 1, 1]
    >>> (x,), mask = collate_users((torch.arange(5.0),), groups, max_examples=2)
    >>> x.shape, mask.tolist()
    (torch.Size([3, 2]), [[True, True], [True, False], [True, False]])
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from numbers import Real
from typing import Any, SupportsIndex

import torch

import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.random import RngKey, fold_in, split
from opake_fx.sampling_base import KeyedSampler, poisson_indices, uniform53
from opake_fx.typing import typechecked

__all__ = ["UserIndex", "UserPoissonSampler", "collate_users", "user_loss", "batched_user_loss",
           "cap_examples_per_user", "user_epsilon_of_examples"]


class UserIndex:
    """Which examples each user owns, from one user id per example.

    Users are numbered in the order of their first example (so the numbering is a
    function of the data set's order, never of a hash); ``examples_of(u)`` lists user
    ``u``'s example indices in increasing order.

    Args:
        user_ids: one hashable id per example (ints, strings, a 1-d integer tensor or
            numpy array); a Hugging Face dataset's column works as ``dataset["user_id"]``.

    Raises:
        InputTypeError: an id that is not hashable (e.g. a list), or a float id (a
            rounding of it could split or merge users).
        InputValueError: no examples.

    Privacy: the index is the definition of the unit: every example must carry the id of
    the person it is about. Two ids for one person make two units, and the guarantee is
    then per id, not per person.

    Example:
        >>> UserIndex([7, 3, 7]).counts()
        [2, 1]
    """

    def __init__(self, user_ids: Sequence[Hashable] | torch.Tensor | Any) -> None:
        ids = user_ids.tolist() if hasattr(user_ids, "tolist") else list(user_ids)
        if not ids:
            raise InputValueError("UserIndex: user_ids is empty; give one user id per example.")
        number: dict[Hashable, int] = {}
        examples: list[list[int]] = []
        for i, uid in enumerate(ids):
            if isinstance(uid, float) or not isinstance(uid, Hashable):
                raise InputTypeError(
                    f"UserIndex: user id of example {i} is {uid!r} ({type(uid).__name__}); ids must be hashable and "
                    "not floats (ints or strings): an id decides whose privacy the example counts against."
                )
            u = number.setdefault(uid, len(number))
            if u == len(examples):
                examples.append([])
            examples[u].append(i)
        self.users: tuple[Hashable, ...] = tuple(number)
        self._examples = examples
        self.n_examples = len(ids)

    @property
    def n_users(self) -> int:
        """The number of users (the privacy units)."""
        return len(self._examples)

    def __len__(self) -> int:
        return self.n_users

    def examples_of(self, user: int) -> list[int]:
        """User number ``user``'s example indices (increasing)."""
        return list(self._examples[check.integer(user, "user", "UserIndex.examples_of", minimum=0,
                                                 maximum=self.n_users - 1)])

    def counts(self) -> list[int]:
        """The number of examples of each user."""
        return [len(e) for e in self._examples]

    def capped_size(self, max_examples: int) -> int:
        """``sum(min(count, max_examples))``: how many examples a cap of ``max_examples`` per user keeps.

        The ``dataset_size`` of a ``DPPlan(privacy_unit="user", user_sampling="examples")``.

        Example:
            >>> UserIndex([0, 0, 0, 1]).capped_size(2)
            3
        """
        k = check.integer(max_examples, "max_examples", "UserIndex.capped_size", minimum=1)
        return sum(min(c, k) for c in self.counts())

    def shard(self, start: int, stop: int) -> UserIndex:
        """The users ``start .. stop - 1`` only (renumbered from 0), with their examples' indices in the
        whole data set: one rank's users under ``torch.distributed``, so that a user's examples never
        straddle ranks.

        Example:
            >>> UserIndex([0, 1, 0, 2]).shard(1, 3).examples_of(1)
            [3]
        """
        n = self.n_users
        lo = check.integer(start, "start", "UserIndex.shard", minimum=0, maximum=n)
        hi = check.integer(stop, "stop", "UserIndex.shard", minimum=lo, maximum=n)
        part = object.__new__(UserIndex)
        part.users, part._examples = self.users[lo:hi], [list(e) for e in self._examples[lo:hi]]
        part.n_examples = self.n_examples
        return part


class UserPoissonSampler(KeyedSampler):
    """User-level Poisson sampling: each user joins a step with probability ``sample_rate``,
    with up to ``max_examples`` of their examples.

    ``batch(t)`` is a list of groups, one per drawn user (in user order), each the sorted
    indices (into the data set) of that user's examples used at step ``t``: all of them
    when the user has at most ``max_examples``, else a uniformly random subset of
    ``max_examples`` drawn from the step's key and the user's number. Iterate it directly
    (``for groups in sampler``) and stack the groups with :func:`collate_users`.

    Args:
        users: the :class:`UserIndex` of the data set.
        sample_rate: each user's probability of joining a step (expected users per step
            / number of users).
        max_examples: the most examples of one user in a step (``k``).
        n_steps: the number of steps.
        key: the sampler key; step ``t`` draws from ``fold_in(key, t)``.

    Privacy: the users drawn are Poisson-subsampled at ``sample_rate``, exactly the
    sampling that ``poisson(gaussian(nm), sample_rate)`` charges per step with users as
    the units (add-or-remove-one user). The subset of a user's examples is a function of
    the key, the step, the user's number and count only, never of the examples' content.
    Under ``torch.distributed`` give each rank the :meth:`UserIndex.shard` of its users and
    ``fold_in(key, rank)`` (``DPPlan.sampler`` does): a user's examples then never straddle
    ranks, and the union of the ranks' draws is this sampler over all users.

    Example:
        >>> from opake_fx.random import key
        >>> users = UserIndex([0] * 10 + [1] * 3)
        >>> s = UserPoissonSampler(users, sample_rate=1.0, max_examples=4, n_steps=2, key=key(1))
        >>> [len(g) for g in s.batch(0)], s.batch(0) != s.batch(1)  # a new subset of user 0's ten each step
        ([4, 3], True)
    """

    config_fields = ("sample_rate", "max_examples", "n_steps", "dataset_size")
    exhausted_hint = (
        "Training longer than n_steps is not covered by the accounting made for n_steps. Build a new sampler with "
        "a fresh key and account for the extra steps."
    )

    @typechecked
    def __init__(self, users: UserIndex, *, sample_rate: Real, max_examples: SupportsIndex, n_steps: SupportsIndex,
                 key: RngKey) -> None:
        if not isinstance(users, UserIndex):
            raise InputTypeError(f"UserPoissonSampler needs a UserIndex; got {type(users).__name__}.")
        super().__init__(users.n_users, n_steps, key)
        self.users = users
        self.sample_rate: float = check.probability(
            sample_rate, "sample_rate", "UserPoissonSampler", hint="It is each user's probability of joining a step: "
            "the expected users per step / the number of users.")
        self.max_examples: int = check.integer(max_examples, "max_examples", "UserPoissonSampler", minimum=1)

    @property
    def expected_users(self) -> float:
        """``sample_rate * n_users``: the mean number of users per step (``normalize_by``)."""
        return self.sample_rate * self.dataset_size

    def batch(self, step: int) -> list[list[int]]:  # type: ignore[override]
        """Step ``step``'s groups: the drawn users' example indices (pure: the cursor does not move)."""
        users_key, subset_key = split(self.step_key(step))
        groups = []
        for u in poisson_indices(users_key, self.dataset_size, self.sample_rate).tolist():
            groups.append(_keyed_subset(self.users._examples[u], self.max_examples, fold_in(subset_key, u)))
        return groups


def collate_users(tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[int]], max_examples: int,
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Stacks a step's groups into blocks: each tensor ``[N, ...]`` -> ``[U, max_examples, ...]``, and the mask.

    Rows past a user's examples are zeros and ``False`` in the mask ``[U, max_examples]``;
    :func:`user_loss` / :func:`batched_user_loss` leave them out of the user's loss.

    Raises:
        InputValueError: a group with more than ``max_examples`` examples (it would be
            cut silently otherwise), or an index out of range.

    Privacy: none by itself (rearranges the batch the sampler drew).
    """
    k = check.integer(max_examples, "max_examples", "collate_users", minimum=1)
    sizes = [len(g) for g in groups]
    if any(s > k for s in sizes):
        raise InputValueError(
            f"collate_users: a group has {max(sizes)} examples, more than max_examples={k}; use the sampler's "
            "max_examples (UserPoissonSampler caps each user's examples at it)."
        )
    mask = torch.zeros(len(groups), k, dtype=torch.bool)
    for u, s in enumerate(sizes):
        mask[u, :s] = True
    index = torch.zeros(len(groups), k, dtype=torch.long)
    for u, g in enumerate(groups):
        if g:
            index[u, : len(g)] = torch.as_tensor(list(g), dtype=torch.long)
    out = []
    for t in tensors:
        if index.numel() and int(index.max()) >= t.shape[0]:
            raise InputValueError(f"collate_users: an index is out of range for a tensor of {t.shape[0]} rows.")
        block = t[index.reshape(-1)].reshape(len(groups), k, *t.shape[1:])
        keep = mask.reshape(len(groups), k, *([1] * (t.dim() - 1)))
        out.append(torch.where(keep, block, torch.zeros((), dtype=t.dtype)))
    return tuple(out), mask


def user_loss(example_loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """One user's loss, the mean of their examples' losses, for ``clip_backend="vmap"``.

    ``example_loss(params, *example)`` is the loss of ONE example; the result is
    ``loss(params, *block, mask)`` with each block ``[max_examples, ...]`` (one user's, as
    the clip stage's vmap gives it) and ``mask [max_examples]``. Its gradient is the mean of
    the user's examples' gradients, which the clip stage clips as one unit.

    Privacy: the unit is the user: their whole contribution is clipped to ``clipping_norm``
    together. Masked rows add exactly zero (selected out, never multiplied). The result
    carries ``privacy_unit = "user"``, so a clip stage built on it reports its epsilon per
    user (``Transform.privacy_report``).

    Example:
        >>> import torch
        >>> f = user_loss(lambda w, x: (w * x).sum())
        >>> float(f(torch.tensor(1.0), torch.tensor([2.0, 4.0, 9.0]), torch.tensor([True, True, False])))
        3.0
    """

    def loss(params: Any, *args: Any) -> torch.Tensor:
        *block, mask = args
        _check_blocks(block, mask, 1, "user_loss")
        losses = torch.vmap(example_loss, in_dims=(None, *([0] * len(block))))(params, *block)
        kept = torch.where(mask, losses, torch.zeros((), dtype=losses.dtype, device=losses.device))
        return kept.sum() / mask.sum().clamp(min=1).to(losses.dtype)

    loss.privacy_unit = "user"  # type: ignore[attr-defined]  # the clip stage's unit (its privacy report)
    return loss


def batched_user_loss(batch_loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Every user's loss at once, for ``clip_backend="ghost"``/``"auto"``.

    ``batch_loss(params, *batch)`` returns the per-example losses ``[N]`` of a flat batch
    (``reduction="none"``); the result is ``loss(params, *blocks, mask) -> [U]`` with blocks
    ``[U, max_examples, ...]`` from :func:`collate_users`: the blocks are flattened to
    ``U * max_examples`` rows, and each user's loss is the mean over their real rows.

    Privacy: as :func:`user_loss`. The fast backends see units of several rows; where no
    rule can attribute rows to units, they take their exact path and say so (a
    ``SlowPathWarning``), never a per-row clip.

    Example:
        >>> import torch
        >>> f = batched_user_loss(lambda w, x: w * x.sum(-1))
        >>> f(torch.tensor(1.0), torch.ones(2, 3, 4), torch.tensor([[True] * 3, [True, False, False]])).tolist()
        [4.0, 4.0]
    """

    def loss(params: Any, *args: Any) -> torch.Tensor:
        *blocks, mask = args
        _check_blocks(blocks, mask, 2, "batched_user_loss")
        users, k = mask.shape
        flat = [b.reshape(users * k, *b.shape[2:]) for b in blocks]
        losses = batch_loss(params, *flat).reshape(users, k)
        kept = torch.where(mask, losses, torch.zeros((), dtype=losses.dtype, device=losses.device))
        return kept.sum(1) / mask.sum(1).clamp(min=1).to(losses.dtype)

    loss.privacy_unit = "user"  # type: ignore[attr-defined]  # the clip stage's unit (its privacy report)
    return loss


def cap_examples_per_user(users: UserIndex, max_examples: int, key: RngKey) -> list[int]:
    """Example-level sampling with a per-user cap (ELS): the examples kept, at most ``max_examples`` per user.

    A user with more keeps a uniformly random subset of ``max_examples`` (drawn once from
    ``fold_in(key, user)``); train example-level on the kept examples (e.g.
    ``torch.utils.data.Subset(dataset, kept)``) and measure the user-level epsilon with
    :func:`user_epsilon_of_examples` on their user index.

    Privacy: which examples are kept depends on the key and the users' counts only. The
    cap is what makes a user a group of at most ``max_examples`` examples.

    Example:
        >>> from opake_fx.random import key
        >>> users = UserIndex([0, 0, 0, 1])
        >>> kept = cap_examples_per_user(users, 2, key(0))
        >>> len(kept), 3 in kept
        (3, True)
    """
    k = check.integer(max_examples, "max_examples", "cap_examples_per_user", minimum=1)
    kept: list[int] = []
    for u, own in enumerate(users._examples):
        kept.extend(_keyed_subset(own, k, fold_in(key, u)))
    return sorted(kept)


def user_epsilon_of_examples(process: Any, users: UserIndex, delta: float, *, accountant: str = "pld") -> float:
    """The per-user epsilon of an example-level run: group privacy for the largest user.

    ``process`` is the run's example-level :class:`~opake_fx.accounting.DpProcess` (e.g.
    ``plan.run_cost(plan.noise_multiplier, plan.steps)`` of an example-level plan) and
    ``users`` the user index *of the examples it trained on*: the group size is measured,
    the largest user's number of examples, never assumed, so a user with more examples
    than intended is counted as the larger group they are
    (:func:`opake_fx.accounting.group_epsilon`).

    Privacy: valid for add-or-remove-one-user neighbours whenever ``process`` is valid for
    add-or-remove-one-example neighbours and ``users`` describes the training set.

    Example:
        >>> from opake_fx.dpsgd.accounting import gaussian
        >>> eps_user = user_epsilon_of_examples(gaussian(8.0) * 4, UserIndex([0, 0, 1]), 1e-6)
        >>> eps_user > 2 * (gaussian(8.0) * 4).epsilon_at(1e-6)
        True
    """
    from opake_fx.accounting.group import group_epsilon

    return group_epsilon(process, max(users.counts()), delta, accountant=accountant)


def _keyed_subset(own: list[int], k: int, key: RngKey) -> list[int]:
    """All of ``own`` when it has at most ``k``, else a uniformly random ``k`` of them, sorted: the ``k``
    smallest of one keyed uniform per element."""
    if len(own) <= k:
        return list(own)
    order = torch.argsort(uniform53(key, len(own)))[:k]
    return sorted(own[i] for i in order.tolist())


def _check_blocks(blocks: Sequence[Any], mask: Any, dims: int, where: str) -> None:
    """Refuses a batch that is not user blocks and their mask (an example-level batch fed to a user-level loss)."""
    shape = tuple(getattr(mask, "shape", ()))
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or len(shape) != dims or any(
        not isinstance(b, torch.Tensor) or tuple(b.shape[:dims]) != shape for b in blocks
    ):
        got = [tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__ for b in (*blocks, mask)]
        raise InputValueError(
            f"{where}: the batch must be user blocks and their mask, as collate_users makes them (blocks [U, k, ...], "
            f"a bool mask [U, k] last); got shapes {got}. An example-level batch here would be clipped as if each "
            "row were a user."
        )

"""The DP plan: one frozen value from which the sampler, the pipeline and the accountant are built.

Configured separately, the sample rate, the number of steps, the clip norm and the noise
multiplier of a DP-SGD run can disagree between the sampler, the noise stage and the
accountant, and nothing would notice. A :class:`DPPlan` holds them once (the model:
jax_privacy's ``DPExecutionPlan`` and Opacus's ``make_private_with_epsilon``); every
piece is derived from it, so they cannot disagree:

    plan = DPPlan(dataset_size=len(train), batch_size=128, epochs=20, clipping_norm=1.0,
                  target_epsilon=3.0, delta=1e-5)          # calibrates the noise multiplier
    sampler = plan.sampler(train, key(1))                  # Poisson, with the plan's rate and steps
    pipeline = plan.pipeline(loss_fn, sgd(0.1, momentum=0.9), key=key(0))  # clip, psum, noise, opt
    accountant = plan.accountant()                         # the plan's budget; step with plan.step_cost

The stage-by-stage APIs stay for researchers; the plan only wires them.

Example:
    >>> plan = DPPlan(dataset_size=10_000, batch_size=64, steps=500, target_epsilon=3.0, delta=1e-5)
    >>> round(plan.noise_multiplier, 2), plan.sample_rate
    (0.66, 0.0064)
    >>> plan.epsilon() <= 3.0
    True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import opake_fx.validation as check
from opake_fx.errors import CalibrationError, InputTypeError, InputValueError
from opake_fx.planning.clip_modes import CLIP_MODES, ClipMode, check_clipping_kwargs
from opake_fx.planning.clip_norms import clipping_norm_value, per_group_by_regex, regex_norms
from opake_fx.planning.key_roles import KeyRoles
from opake_fx.planning.loss_recording import RecordedLossState, loss_recording
from opake_fx.planning.mechanisms import MECHANISMS as MECHANISM_PARTS
from opake_fx.planning.mechanisms import NoiseMechanism, compatible_pairs
from opake_fx.planning.participation import Participation
from opake_fx.planning.samplers import SAMPLING, OffsetSampler, SamplingScheme, shard_sampler
from opake_fx.random import RngKey, fold_in, split
from opake_fx.types import PerGroup

__all__ = ["DPPlan", "PlanParts", "KeyRoles", "Participation", "RecordedLossState", "SAMPLERS", "MECHANISMS",
           "COMPATIBLE", "PRIVACY_UNITS", "CLIPPING_MODES", "CLIPPING_KWARGS", "check_clipping_kwargs", "per_group_by_regex",
           "regex_norms"]

SAMPLERS = SAMPLING.names()
"""The samplers a plan can use (:data:`opake_fx.planning.samplers.SAMPLING`); each comes with its own accounting."""

MECHANISMS = MECHANISM_PARTS.names()
"""The noise mechanisms (:data:`opake_fx.planning.mechanisms.MECHANISMS`): DP-SGD's Gaussian, or DP-FTRL with a
BandMF, BSR or BLT strategy."""

COMPATIBLE: dict[str, tuple[str, ...]] = compatible_pairs()
"""The samplers each mechanism goes with (the pairs whose accounting the plan knows), derived from the
sampling parts' accounting kinds and the kinds each mechanism accounts (the library's parts; the plan
itself reads the registries, :func:`opake_fx.planning.mechanisms.compatible_pairs`).

* ``gaussian`` (DP-SGD): Poisson amplification (``poisson``, ``truncated_poisson``).
* banded strategies (``band_mf``, ``bsr``) under ``cyclic_poisson``: amplified BandMF,
  ``ceil(steps / bands)`` Poisson-subsampled Gaussian opportunities.
* any strategy under ``b_min_sep`` or ``balls_in_bins``: the whole run ``C x + z`` as one
  Gaussian mechanism whose sensitivity is the strategy's under the sampler's guaranteed
  pattern (participations at least ``min_sep`` steps apart, at most
  ``ceil(steps / min_sep)`` of them), without amplification (the amplified accounting of
  these samplers is Monte Carlo and does not compose step by step; use
  :mod:`opake_fx.dpftrl.accounting` directly for it).
"""

PRIVACY_UNITS = ("example", "user")
"""What one unit of privacy is: an example, or a user with all of their examples (:mod:`opake_fx.users`)."""

USER_SAMPLINGS = ("users", "examples")
"""How a ``privacy_unit="user"`` plan samples: users (ULS, each drawn user one clipped unit), or examples
with every user capped at ``max_examples_per_user`` and the user protected as a group (ELS)."""

CLIPPING_MODES = CLIP_MODES.names()
"""How the plan clips: ``fixed`` (to ``clipping_norm``, one norm or per group), ``auto``
(AUTO-S, Bu et al. 2023: every gradient scaled to norm just under ``clipping_norm``) or
``adaptive`` (the norm tracks a quantile of the gradient norms through a noised count,
Andrew et al. 2021; ``clipping_norm`` is the initial norm)."""

CLIPPING_KWARGS: dict[str, dict[str, float | None]] = {mode.name: dict(mode.defaults) for mode in CLIP_MODES.parts()}
"""The ``clipping_kwargs`` each clipping mode takes, with their defaults (``None``: derived;
``count_noise_multiplier`` defaults to ``batch_size / 20``, Andrew et al.'s suggestion)."""


@dataclass(frozen=True)
class PlanParts:
    """The three objects a plan composes, looked up from its ``sampling``, ``mechanism`` and
    ``clipping_mode`` names (:mod:`opake_fx.planning`).

    Example:
        >>> DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0).parts.clip_mode.name
        'fixed'
    """

    sampling: SamplingScheme
    mechanism: NoiseMechanism
    clip_mode: ClipMode


@dataclass(frozen=True)
class DPPlan:
    """A DP-SGD run described once: sampling, steps, clipping, noise and budget.

    Give the dataset size, the expected batch size *or* the sample rate, the steps *or*
    the epochs, the clip norm, and either a target ``(target_epsilon, delta)`` (the
    noise multiplier is calibrated, without a bracket, by
    :func:`opake_fx.accounting.calibrate`) or a ``noise_multiplier`` (0: an explicit
    non-private baseline, epsilon = inf). After construction every field is filled in,
    so the plan is one self-consistent, serialisable value: ``DPPlan(**plan.to_dict())``
    equals ``plan``, and a plan given both a target and a multiplier checks that the
    multiplier meets the target instead of recalibrating.

    Attributes:
        dataset_size: number of examples (the neighbouring relation is add-or-remove-one).
        batch_size: the expected batch size ``sample_rate * dataset_size`` (it is also
            what the clipped sum is divided by).
        sample_rate: the Poisson sampling probability of each example at each step.
        steps: the number of steps (batches) of the run.
        epochs: ``steps * sample_rate`` (expected passes over the data).
        clipping_norm: the per-example L2 clip norm C, or a
            :class:`~opake_fx.types.PerGroup` of per-group norms ``C_g`` over the leaves of
            the parameters the pipeline is given (build one from parameter-name regexes
            with :func:`per_group_by_regex`; ``to_dict`` writes it as plain data
            ``{"groups": [[path, group], ...], "values": {group: C_g}}``, which is also
            accepted). One example's whole gradient is then bounded by the total
            sensitivity ``sqrt(sum_g C_g**2)`` (:attr:`sensitivity`), which the noise is
            scaled to. With ``clipping_mode="adaptive"``: the initial norm.
        clipping_mode: ``"fixed"`` (default), ``"auto"`` (AUTO-S: the same sensitivity
            ``clipping_norm`` and the same accounting as fixed clipping) or
            ``"adaptive"`` (quantile tracking; every step also releases a noised clipped
            count, which :meth:`step_cost_at` charges: ``adaptive_clipping_gaussian``).
            See :data:`CLIPPING_MODES`.
        clipping_kwargs: the mode's options, filled in with their defaults
            (:data:`CLIPPING_KWARGS`): ``auto``: ``gamma``; ``adaptive``:
            ``target_quantile``, ``learning_rate`` (of the geometric update) and
            ``count_noise_multiplier`` (the std of the count's noise, in counts;
            default ``batch_size / 20``). ``fixed`` takes none. Stored read-only.
        target_epsilon, delta: the budget; ``delta`` is required whenever epsilon is
            asked for.
        noise_multiplier: sigma, the noise multiplier of the GRADIENT; the noise stddev
            is ``sigma * sensitivity / batch_size`` (per-group norms: every coordinate
            gets ``sigma * sqrt(sum_g C_g**2) / batch_size``). An adaptive plan's
            accounting charges the gradient and the count together, with the effective
            multiplier ``(sigma**-2 + (2 * count_noise_multiplier)**-2)**-1/2``, and a
            target epsilon calibrates sigma for that combined mechanism.
        sampling: ``"poisson"`` or ``"truncated_poisson"`` (batches capped at
            ``max_batch_size``, accounted by ``truncated_poisson``) for the Gaussian
            mechanism; ``"cyclic_poisson"`` for a banded strategy (the data split into
            ``bands`` keyed groups, step ``t`` Poisson-samples group ``t mod bands`` at
            :attr:`group_rate`, so an example participates at least ``bands`` steps apart);
            ``"b_min_sep"`` (an available example joins with :attr:`participation_rate`,
            then rests ``min_sep - 1`` steps; warm-started, so the mean batch is
            ``batch_size`` from step 0) or ``"balls_in_bins"`` (each example in one of
            ``min_sep`` keyed bins, used every ``min_sep`` steps) for any DP-FTRL
            strategy. :data:`COMPATIBLE` lists the pairs.
        max_batch_size: the cap of ``"truncated_poisson"``.
        mechanism: ``"gaussian"`` (DP-SGD), or DP-FTRL with a strategy over ``steps``:
            ``"band_mf"`` (optimised ``bands``-banded), ``"bsr"`` (banded square root,
            ``bands`` wide) or ``"blt"`` (buffered linear Toeplitz, optimised for the
            plan's :attr:`participation`).
        bands: the number of bands of ``"band_mf"`` / ``"bsr"``.
        min_sep: the separation of ``"b_min_sep"`` / the cycle length (number of bins)
            of ``"balls_in_bins"``; ``batch_size`` of balls-in-bins is
            ``dataset_size / min_sep`` (derived when not given).
        clip_backend: ``"vmap"``, ``"ghost"`` or ``"auto"`` (see ``clipped_grad``).
        accountant_kind: ``"pld"`` (default) or ``"rdp"``: how epsilon is measured.
        privacy_unit: ``"example"`` (default) or ``"user"`` (user-level sampling,
            :mod:`opake_fx.users`): every count of the plan is then of users
            (``dataset_size`` the number of users, ``batch_size`` the expected users per
            step), :meth:`sampler` draws users (``user_ids`` required), :meth:`pipeline`
            makes each user's loss the mean over their examples and clips it as one unit,
            and every epsilon is per user. ``sampling="poisson"``,
            ``mechanism="gaussian"`` and ``augmult=1`` only (the other analyses over users
            are not built).
        max_examples_per_user: with ``privacy_unit="user"`` (required): the most examples
            of one user in a step (``k``; a keyed random subset of a user who has more).
        user_sampling: with ``privacy_unit="user"``: ``"users"`` (default; user-level
            sampling, as above) or ``"examples"`` (example-level sampling with each user
            capped at ``k`` examples: :meth:`sampler` keeps a keyed subset of at most ``k``
            examples per user once for the run and Poisson-samples the kept examples;
            ``dataset_size`` counts the kept examples,
            ``UserIndex(user_ids).capped_size(k)``; the pipeline clips each example; the
            per-user epsilon is the example-level run's by group privacy for ``k``,
            :func:`~opake_fx.accounting.group_epsilon`, and ``target_epsilon`` is per user).
            Not with ``clipping_mode="adaptive"``.

    Privacy contract: the pipeline clips each example to ``clipping_norm`` (per group:
    group g to ``C_g``; AUTO-S: scaled to norm below ``clipping_norm``; adaptive: to
    the current norm ``C_t``), sums over ranks and adds Gaussian noise of multiplier
    ``noise_multiplier`` to a sum of sensitivity ``sensitivity / batch_size`` (adaptive:
    ``C_t / batch_size``; DP-FTRL: correlated noise ``C^{-1} z`` with ``z`` scaled to the
    strategy's sensitivity under :attr:`participation`); the sampler draws the plan's
    batches for ``steps`` steps (each rank its disjoint shard, with ``fold_in(key,
    rank)``); the accountant charges ``step_cost_at(t)`` at step ``t`` (adaptive: the
    gradient and the noised count together). All three read the same fields, which is
    what makes the accounted epsilon the run's epsilon. Refused pairs (no sound
    accounting here): ``clipping_mode="adaptive"`` with a DP-FTRL mechanism or with
    per-group norms, ``"auto"`` with per-group norms.

    Raises:
        InputValueError / InputTypeError: a missing, contradictory or invalid field.
        CalibrationError: no noise multiplier in 0.05..1000 meets the target.
    """

    dataset_size: int
    batch_size: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    epochs: float | None = None
    clipping_norm: float | PerGroup = 1.0
    target_epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    sampling: str = "poisson"
    max_batch_size: int | None = None
    mechanism: str = "gaussian"
    bands: int | None = None
    clip_backend: str = "vmap"
    accountant_kind: str = "pld"
    min_sep: int | None = None
    augmult: int = 1
    clipping_mode: str = "fixed"
    clipping_kwargs: Mapping[str, float] | None = None
    privacy_unit: str = "example"
    max_examples_per_user: int | None = None
    user_sampling: str | None = None

    def __hash__(self) -> int:  # clipping_kwargs is a mapping: hash the canonical plain data
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key_roles", KeyRoles())  # (not a field: outside equality, hashing and to_dict)
        n = check.integer(self.dataset_size, "dataset_size", "DPPlan", minimum=1)
        check.integer(self.augmult, "augmult", "DPPlan", minimum=1)
        sampling = SAMPLING.get(self.sampling)
        mechanism = MECHANISM_PARTS.get(self.mechanism)
        if sampling.accounting not in mechanism.accounts:
            raise InputValueError(
                f"DPPlan: sampling={self.sampling!r} does not go with mechanism={self.mechanism!r} (the plan has no "
                f"sound accounting for that pair). mechanism={self.mechanism!r} takes sampling in "
                f"{compatible_pairs()[self.mechanism]}; the valid pairs are {_pairs()}."
            )
        min_sep = _used_field(self.min_sep, "min_sep", "sampling", sampling, SAMPLING.parts(), "uses_min_sep",
                              sampling.min_sep_message, minimum=1)
        batch_size = self.batch_size
        if batch_size is None and self.sample_rate is None:
            batch_size = sampling.default_batch_size(n, min_sep)
        q, b = _sampling(n, batch_size, self.sample_rate)
        steps, epochs = _length(q, self.steps, self.epochs)
        c = clipping_norm_value(self.clipping_norm)
        mode = CLIP_MODES.get(self.clipping_mode)
        given = check_clipping_kwargs(mode.name, self.clipping_kwargs, "DPPlan")
        object.__setattr__(self, "clipping_kwargs", MappingProxyType(mode.fill(given, b)))
        if mode.one_norm_reason is not None and isinstance(c, PerGroup):
            raise InputValueError(
                f"DPPlan: clipping_mode={mode.name!r} takes one clipping_norm, not per-group norms ("
                f"{mode.one_norm_reason}). Use clipping_mode='fixed' for per-group clipping, or one float clipping_norm."
            )
        mode.check(self)
        bands = _used_field(self.bands, "bands", "mechanism", mechanism, MECHANISM_PARTS.parts(), "needs_bands",
                            mechanism.bands_message, minimum=1)
        cap = _used_field(self.max_batch_size, "max_batch_size", "sampling", sampling, SAMPLING.parts(),
                          "uses_max_batch_size", lambda: (f"DPPlan(sampling={self.sampling!r}) needs max_batch_size "
                                                          "(the batch cap)."), minimum=1)
        for name, value in (("dataset_size", n), ("batch_size", b), ("sample_rate", q), ("steps", steps),
                            ("epochs", epochs), ("clipping_norm", c), ("min_sep", min_sep), ("bands", bands),
                            ("max_batch_size", cap)):
            object.__setattr__(self, name, value)
        sampling.check(self, b)
        check.choice(self.clip_backend, "clip_backend", "DPPlan", ("vmap", "ghost", "auto"))
        check.choice(self.accountant_kind, "accountant_kind", "DPPlan", ("pld", "rdp"))
        self._check_privacy_unit()
        delta = None
        if self.delta is not None:
            delta = check.real(self.delta, "delta", "DPPlan", "e.g. 1e-5, below 1 / dataset_size")
        if delta is not None and not 0 < delta < 1:
            raise InputValueError(f"DPPlan: delta must be in (0, 1); got {delta}.")
        object.__setattr__(self, "delta", delta)
        nm = self._resolve_noise_multiplier(delta)
        object.__setattr__(self, "noise_multiplier", nm)

    @functools.cached_property
    def parts(self) -> PlanParts:
        """The sampling, mechanism and clip-mode objects this plan composes (:mod:`opake_fx.planning`)."""
        return PlanParts(SAMPLING.get(self.sampling), MECHANISM_PARTS.get(self.mechanism),
                         CLIP_MODES.get(self.clipping_mode))

    # --- what the plan builds ----------------------------------------------------------

    def sampler(self, dataset: Any, key: RngKey, *, rank: int | None = None, world_size: int | None = None,
                user_ids: Any = None) -> Any:
        """The batch sampler of this rank: Poisson batches of its shard, ``sample_rate``, ``steps``.

        Args:
            dataset: the whole training set (its length must be ``dataset_size``; with
                ``privacy_unit="user"``, its number of users must be).
            key: the sampler key (NOT the noise key); each rank uses ``fold_in(key, rank)``.
            rank, world_size: default: the current process group's (1 process: 0, 1); under a
                process group, values other than the group's are refused.
            user_ids: with ``privacy_unit="user"`` (required): one user id per example of
                ``dataset``. The sampler is then a
                :class:`~opake_fx.users.UserPoissonSampler` over this rank's users (whole
                users per rank, ``fold_in(key, rank)``; its groups index the whole
                dataset): iterate it and stack each step's groups with
                :func:`~opake_fx.users.collate_users`.

        Returns:
            A ``DataLoader`` batch sampler yielding indices into ``dataset``, built by the
            plan's sampling part (:meth:`~opake_fx.planning.samplers.base.SamplingScheme.build`):
            ``PoissonSampler`` / ``TruncatedPoissonSampler`` (Gaussian), or
            ``CyclicPoissonSampler`` / ``MinSepSampler`` (warm-started) /
            ``BallsInBinsSampler`` from :mod:`opake_fx.dpftrl.sampling`.

        Privacy: each example's participation depends only on its own keyed draws, so the
        union of the ranks' batches (disjoint shards, independent keys) is the plan's
        sampler over the whole dataset, with the pattern the accountant charges.
        """
        from opake_fx.distributed import get_rank, get_world_size, is_distributed, shard_bounds

        if is_distributed() and (rank, world_size) != (None, None) and (
            (rank if rank is not None else get_rank(), world_size if world_size is not None else get_world_size())
            != (get_rank(), get_world_size())
        ):
            # Under a process group the shards must be the group's: ranks told world_size=1 would each
            # draw from the whole dataset with the same key, so every example would enter the psum once
            # per rank (sensitivity world_size * C, noise scaled to C).
            raise InputValueError(
                f"DPPlan.sampler: rank={rank}, world_size={world_size} differ from the process group's rank "
                f"{get_rank()} of {get_world_size()}. The ranks' shards must be disjoint and cover the dataset once; "
                "leave rank and world_size out under a process group."
            )

        if self.privacy_unit == "user":
            make = self._user_sampler if self.user_sampling == "users" else self._capped_sampler
            return make(dataset, key, get_rank() if rank is None else rank,
                        get_world_size() if world_size is None else world_size, user_ids)
        if user_ids is not None:
            raise InputValueError(
                "DPPlan.sampler(user_ids=...) applies to privacy_unit='user'; this plan's unit is the example (its "
                "epsilon would be per example). Build the plan with privacy_unit='user', dataset_size=<number of users>."
            )
        if len(dataset) != self.dataset_size:
            raise InputValueError(
                f"DPPlan.sampler: the dataset has {len(dataset)} examples but the plan was made for dataset_size="
                f"{self.dataset_size}; the sample rate and the accounting depend on it. Build the plan from len(dataset)."
            )
        if not isinstance(key, RngKey):
            raise InputTypeError(f"DPPlan.sampler needs key=opake_fx.random.key(seed); got {type(key).__name__}.")
        world_size = get_world_size() if world_size is None else world_size
        rank = get_rank() if rank is None else rank
        start, stop = shard_bounds(self.dataset_size, rank, world_size)
        local_key = fold_in(key, rank) if world_size > 1 else key
        self._key_roles.claim(("sampler", key), ("sampler", local_key))
        inner = self.parts.sampling.build(self, range(start, stop), local_key, world_size)
        return OffsetSampler(inner, start) if start else inner

    def _capped_sampler(self, dataset: Any, key: RngKey, rank: int, world_size: int, user_ids: Any) -> Any:
        """ELS: the plan's example sampler over the examples kept by a per-user cap, as indices of ``dataset``."""
        from opake_fx.distributed import shard_bounds
        from opake_fx.users import cap_examples_per_user

        users = self._user_index(dataset, key, user_ids)
        k = self.max_examples_per_user
        if users.capped_size(k) != self.dataset_size:
            raise InputValueError(
                f"DPPlan.sampler: capping each user at max_examples_per_user={k} keeps {users.capped_size(k)} "
                f"examples but the plan was made for dataset_size={self.dataset_size} (with user_sampling='examples' "
                "it counts the kept examples); the sample rate depends on it. Build the plan with "
                "dataset_size=UserIndex(user_ids).capped_size(max_examples_per_user)."
            )
        cap_key, sample_key = split(key)  # the cap is the same on every rank; each rank samples its shard
        kept = cap_examples_per_user(users, k, cap_key)
        start, stop = shard_bounds(len(kept), rank, world_size)
        local_key = fold_in(sample_key, rank) if world_size > 1 else sample_key
        self._key_roles.claim(("sampler", key), ("sampler", local_key))
        return OffsetSampler(self.parts.sampling.build(self, range(start, stop), local_key, world_size), start,
                             indices=kept)

    def _user_index(self, dataset: Any, key: RngKey, user_ids: Any) -> Any:
        """The :class:`~opake_fx.users.UserIndex` of ``user_ids``, checked against ``dataset`` and the key."""
        from opake_fx.users import UserIndex

        if user_ids is None:
            raise InputValueError(
                "DPPlan(privacy_unit='user').sampler needs user_ids=...: one user id per example of the dataset (e.g. "
                "a column of it); the users, not the examples, are what the plan protects."
            )
        if len(user_ids) != len(dataset):
            raise InputValueError(f"DPPlan.sampler: {len(user_ids)} user ids for a dataset of {len(dataset)} examples; "
                                  "give one user id per example.")
        if not isinstance(key, RngKey):
            raise InputTypeError(f"DPPlan.sampler needs key=opake_fx.random.key(seed); got {type(key).__name__}.")
        return UserIndex(user_ids)

    def _user_sampler(self, dataset: Any, key: RngKey, rank: int, world_size: int, user_ids: Any) -> Any:
        """ULS: a :class:`~opake_fx.users.UserPoissonSampler` over this rank's whole users."""
        from opake_fx.distributed import shard_bounds
        from opake_fx.users import UserPoissonSampler

        users = self._user_index(dataset, key, user_ids)
        if users.n_users != self.dataset_size:
            raise InputValueError(
                f"DPPlan.sampler: the dataset has {users.n_users} users but the plan was made for dataset_size="
                f"{self.dataset_size} (with privacy_unit='user' it counts users); the sample rate and the accounting "
                "depend on it. Build the plan from UserIndex(user_ids).n_users."
            )
        local_key = fold_in(key, rank) if world_size > 1 else key
        self._key_roles.claim(("sampler", key), ("sampler", local_key))
        start, stop = shard_bounds(users.n_users, rank, world_size)  # whole users per rank, never split
        return UserPoissonSampler(users.shard(start, stop) if world_size > 1 else users, sample_rate=self.sample_rate,
                                  max_examples=self.max_examples_per_user, n_steps=self.steps, key=local_key)

    def pipeline(
        self,
        loss_fn: Callable[..., Any],
        optimizer: Any,
        *,
        key: RngKey,
        model: Any = None,
        batch_argnums: Sequence[int] = (1, 2),
        augment: Callable[..., Any] | None = None,
        augment_key: RngKey | None = None,
        microbatch_size: int | None = None,
        count_key: RngKey | None = None,
        record_loss: bool = False,
    ) -> Any:
        """``named_chain(clip, psum, noise, opt)`` with the plan's clip norm, normalisation and noise.

        The clip stage follows :attr:`clipping_mode`: :func:`~opake_fx.dpsgd.clip`
        (``clipping_norm`` a float or a ``PerGroup``), :func:`~opake_fx.dpsgd.auto_clip`
        (AUTO-S, ``gamma`` from ``clipping_kwargs``) or
        :func:`~opake_fx.dpsgd.adaptive_clip` (``count_key`` required: the key of the
        count's noise, independent of the noise key; under a process group the stage
        ``sync``-s its state after every step, so the count is summed over ranks before
        the norm moves and every rank clips the next step at the same norm).

        With ``augmult=K > 1`` the clip stage is :func:`opake_fx.augmult.augmult`: each
        example's gradient is averaged over ``K`` copies ``augment(keys, x)`` before it is
        clipped (same sensitivity, same accounting); ``augment`` and ``augment_key`` (not
        the noise key) are then required.

        Args:
            loss_fn: ``loss_fn(params, *batch)``: one example for ``clip_backend="vmap"``,
                the whole batch with per-example losses ``[B]`` for ``"ghost"``/``"auto"``.
            optimizer: a ``Transform`` from :mod:`opake_fx.optimizers`.
            key: the noise key (the SAME on every rank; not the sampler key).
            model: the functional model, for ``"ghost"``/``"auto"``. The functional model
                of an FSDP2-sharded module (:func:`opake_fx.distributed.fsdp.make_functional_fsdp`)
                makes the pipeline the sharded DP step
                (:func:`~opake_fx.distributed.fsdp.fsdp_pipeline`: gather, clip, reduce-scatter,
                each rank noises its rows of the unsharded noise, updates its shards), for any
                backend; ``params`` are then the sharded ones.
            batch_argnums: the positions of the batch tensors in ``loss_fn``. With
                ``privacy_unit="user"``, ``loss_fn`` is written as for an example-level
                plan (one example for ``"vmap"``, per-example losses ``[N]`` for the fast
                backends) and the plan makes it a user's loss (:func:`opake_fx.users.user_loss`
                / :func:`~opake_fx.users.batched_user_loss`): the batch is then
                ``(*blocks, mask)`` from :func:`opake_fx.users.collate_users`, the mask one
                position after the last of ``batch_argnums``.
            augment: with ``augmult > 1``: ``augment(keys [B, 2], x [B, ...]) -> [B, ...]``,
                acting on each example alone (e.g. :func:`opake_fx.augmult.random_shift`).
            augment_key: with ``augmult > 1``: the augmentation key.
            count_key: with ``clipping_mode="adaptive"`` only: the count-noise key (the
                SAME on every rank; neither the noise key nor the sampler key).
            microbatch_size: memory only: the clip stage computes the per-example
                gradients this many examples at a time (``None``: the whole batch at
                once). The same examples are clipped to the same norm and summed, so the
                result and the privacy are those without it (up to float summation order).
            record_loss: the clip stage's state becomes a :class:`RecordedLossState` that
                also holds the sum and the count of the step's per-example losses (of the
                real examples: padding rows are left out), taken from the clipping pass
                itself: no extra forward pass. NOT private (a training loss); for logging.
                Not with ``augmult``.

        Privacy: clip to ``clipping_norm``, divide by ``batch_size``, sum over ranks, add
        ``noise_multiplier * sensitivity / batch_size`` Gaussian noise to every coordinate
        (per-group norms: isotropic noise at the total sensitivity ``sqrt(sum_g C_g**2)``;
        adaptive: ``noise_multiplier * C_t / batch_size`` at step ``t``, plus the count's
        noise; DP-FTRL: the strategy's correlated noise, its ``z`` scaled to the
        sensitivity under :attr:`participation`): the mechanism that :meth:`step_cost_at`
        accounts.
        """
        from opake_fx.distributed import psum
        from opake_fx.transforms import named_chain

        if not isinstance(key, RngKey):
            raise InputTypeError(f"DPPlan.pipeline needs key=opake_fx.random.key(seed) (the noise key); got {type(key).__name__}.")
        sharded = _is_sharded_model(model)  # every part shards: a noise stage that could not draw rows would refuse
        self._key_roles.claim(("noise", key), *[(r, k) for r, k in (("count", count_key), ("augmentation", augment_key))
                                           if isinstance(k, RngKey)])
        if self.user_sampling == "users":  # one unit = one user's block of examples and its mask
            from opake_fx.users import batched_user_loss, user_loss

            loss_fn = (user_loss if self.clip_backend == "vmap" else batched_user_loss)(loss_fn)
            batch_argnums = (*tuple(batch_argnums), max(batch_argnums) + 1)
        mode = self.parts.clip_mode
        noise_stage = self.parts.mechanism.noise_stage(self, key)
        clip_args: dict[str, Any] = dict(normalize_by=self.batch_size, batch_argnums=tuple(batch_argnums),
                                         clip_backend=self.clip_backend, model=model)
        if microbatch_size is not None:
            clip_args["microbatch_size"] = microbatch_size  # validated by clipped_grad
        if mode.takes_count_key and not isinstance(count_key, RngKey):
            raise InputValueError(
                f"DPPlan(clipping_mode={mode.name!r}).pipeline needs count_key=key(...): the key of the clipped "
                "count's noise (the same on every rank; not the noise key, not the sampler key)."
            )
        if not mode.takes_count_key and count_key is not None:
            takes = " or ".join(repr(m.name) for m in CLIP_MODES.parts() if m.takes_count_key)
            raise InputValueError(
                f"DPPlan.pipeline(count_key=...) applies to clipping_mode={takes} only; this plan's clipping_mode is "
                f"{self.clipping_mode!r}. Leave count_key out."
            )
        factory = mode.stage_factory(count_key)
        clip_args.update(mode.clip_args(self))
        if record_loss and self.augmult > 1:
            raise InputValueError(
                f"DPPlan(augmult={self.augmult}).pipeline(record_loss=True) is not supported: each example's loss is "
                "that of K augmented copies. Leave record_loss out, or use augmult=1."
            )
        if self.augmult > 1:
            from opake_fx.augmult import augmult

            if augment is None or augment_key is None:
                raise InputValueError(
                    f"DPPlan(augmult={self.augmult}).pipeline needs augment=fn(keys, x) and augment_key=key(...) "
                    "(the augmentation and its own key, not the noise key)."
                )
            clip_stage = augmult(loss_fn, augment=augment, multiplicity=self.augmult, key=augment_key,
                                 clip_fn=factory, **clip_args)
        elif augment is not None:
            raise InputValueError("DPPlan.pipeline(augment=...) needs a plan with augmult=K >= 2 (the copies per example).")
        elif record_loss:
            clip_stage = loss_recording(factory, mode.grad_maker(count_key), loss_fn, clip_args)
        else:
            clip_stage = factory(loss_fn, **clip_args)
        clip_stage = mode.finish(clip_stage)
        if sharded:  # FSDP2: gather, clip, reduce-scatter, noise this rank's rows
            from opake_fx.distributed.fsdp import fsdp_pipeline

            return self._ranks_agree(fsdp_pipeline(clip_stage, noise_stage, optimizer, model=model))
        return self._ranks_agree(named_chain(
            ("clip", clip_stage),
            ("psum", psum()),
            ("noise", noise_stage),
            ("opt", optimizer),
        ))

    def _ranks_agree(self, pipeline: Any) -> Any:
        """``pipeline`` whose first step checks that all ranks run this plan (a no-op in one process).

        The noise stage already compares the key, step, multiplier and sensitivity at every
        step; what it cannot see (the sample rate the accountant charges, the steps, delta, a
        plan whose batch size and dataset size differ in proportion) is in the plan. Every
        field is compared by name at the pipeline's first step, once: the plan is frozen and
        the pipeline closes over it, so the ranks cannot drift apart later (a new pipeline
        checks again at its own first step).
        """
        import hashlib

        from opake_fx.distributed import is_distributed
        from opake_fx.distributed.agreement import agree
        from opake_fx.serialization import plan_identity

        def comparable(value: Any) -> Any:  # numbers as they are, anything else (names, lists) by a hash
            if value is None or isinstance(value, (bool, int, float)):
                return value
            return int(hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:13], 16)

        fields = [(name, comparable(value)) for name, value in sorted(json.loads(plan_identity(self)).items())]
        fields.append(("sample_rate", float(self.sample_rate)))
        fix = ("Build the plan with the same arguments on every rank (the same dataset_size, batch_size or "
               "sample_rate, steps, noise, delta and clipping): the accountant of each rank charges its own plan.")
        inner, checked = pipeline.update, [False]

        def update(x: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
            if not checked[0] and is_distributed():
                agree("DPPlan.pipeline", fields, full=True, fix=fix)
                checked[0] = True
            return inner(x, state, params, **extra)

        return pipeline._replace(update=update)

    def padding_buckets(self, growth: float = 1.25) -> tuple[int, ...]:
        """Padded batch sizes for this plan's sampler (:func:`opake_fx.padding.geometric_buckets`).

        From half the expected batch size up to the largest batch the sampler can draw
        (the dataset, or ``max_batch_size`` for ``"truncated_poisson"``), ``growth``
        apart: a compiled step meets a few shapes instead of one per batch size.

        Privacy: none (sizes only); padding rows are masked out of the clip stage.
        """
        from opake_fx.padding import geometric_buckets

        return geometric_buckets(float(self.batch_size), up_to=int(self.parts.sampling.largest_batch(self)),
                                 growth=growth)

    def compiled_step(self, loss_fn: Callable[..., Any], optimizer: Any, *, key: RngKey, mode: str | None = None,
                      buckets: Sequence[int] | None | str = "auto", **pipeline_kwargs: Any) -> Any:
        """:meth:`pipeline` compiled as one step: ``params, state = step(params, state, batch)``.

        The same arguments as :meth:`pipeline` (``model``, ``batch_argnums``, ...), plus
        ``mode`` (``torch.compile``'s) and ``buckets`` (``"auto"``: :meth:`padding_buckets`;
        ``None``: no padding). See :func:`opake_fx.compiled.compile_step`: the clip,
        aggregation, noise addition and optimizer update are compiled, the noise draw is
        the pipeline's own (bit-identical), and the accountant's step stays with the caller.

        Privacy: that of :meth:`pipeline` (the same mechanism, the same accounting).
        """
        from opake_fx.compiled import compile_step

        pipeline = self.pipeline(loss_fn, optimizer, key=key, **pipeline_kwargs)
        return compile_step(pipeline, buckets=self.padding_buckets() if buckets == "auto" else buckets, mode=mode)

    @property
    def key_roles(self) -> KeyRoles:
        """The plan's :class:`KeyRoles` ledger (which role each key it was used with plays)."""
        return self._key_roles

    @property
    def step_cost(self) -> Any:
        """The :class:`~opake_fx.accounting.DpProcess` of one step (the sampler's and the noise's).

        For DP-FTRL plans the cost differs from step to step: use :meth:`step_cost_at`.
        """
        if not self.parts.mechanism.independent_steps:
            raise InputValueError(
                f"DPPlan.step_cost: a {self.mechanism} plan's cost differs from step to step; use "
                "plan.step_cost_at(step) (what the accountant charges at that step)."
            )
        return self.step_cost_at(0)

    def step_cost_at(self, step: int) -> Any:
        """What step ``step`` (from 0) costs: charge it to the accountant before releasing the step.

        Gaussian: ``step_cost`` at every step. Cyclic Poisson: one Poisson-subsampled
        Gaussian opportunity at steps ``0, bands, 2 * bands, ...`` (the worst-placed
        example's group), nothing in between. ``b_min_sep`` / ``balls_in_bins``: the
        Gaussian increment of the first ``step + 1`` releases over the first ``step``
        (:func:`opake_fx.dpftrl.accounting.mf_gaussian_steps` under :attr:`participation`).
        In every case the increments compose to the whole run.
        """
        t = check.integer(step, "step", "DPPlan", minimum=0)
        if t >= self.steps:
            raise InputValueError(f"DPPlan.step_cost_at: step must be < steps={self.steps}; got {t}.")
        if self.noise_multiplier == 0:
            from opake_fx.accounting import nonprivate

            return nonprivate()
        if not self.participation.amplified:
            return self._step_increments[t]
        if not self.parts.sampling.has_opportunity(self, t):
            from opake_fx.accounting import identity

            return identity()
        return self._opportunity(self.noise_multiplier)

    @property
    def sensitivity(self) -> float:
        """One example's L2 bound on the clipped gradient: ``clipping_norm``, or ``sqrt(sum_g C_g**2)``
        for per-group norms (adaptive: the initial norm; the step's own ``C_t`` later).

        Example:
            >>> pg = PerGroup({(0,): "a", (1,): "b"}, {"a": 3.0, "b": 4.0})
            >>> DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0, clipping_norm=pg).sensitivity
            5.0
        """
        c = self.clipping_norm
        return c.effective if isinstance(c, PerGroup) else float(c)

    @property
    def group_rate(self) -> float:
        """The Poisson rate within the active group (``batch_size * bands / dataset_size``; ``sample_rate`` for one group)."""
        return self.sample_rate * (self.bands or 1)

    @property
    def participation_rate(self) -> float:
        """The b-min-sep sampler's join probability ``p`` of an available example.

        Its stationary mean batch is ``N p / (1 + (min_sep - 1) p)``; ``p`` is solved so
        that this is ``batch_size``.
        """
        return self.parts.sampling.join_rate(self)

    @property
    def participation(self) -> Participation:
        """The participation pattern that the noise stage is scaled to and the accountant charges.

        Gaussian: one participation per step, amplified. Cyclic Poisson: one participation
        per opportunity (``min_sep = bands``), amplified. ``b_min_sep`` / ``balls_in_bins``:
        participations at least ``min_sep`` apart, at most ``ceil(steps / min_sep)``.

        Example:
            >>> DPPlan(dataset_size=400, batch_size=20, steps=60, noise_multiplier=1.0, mechanism="blt",
            ...        sampling="b_min_sep", min_sep=10).participation
            Participation(steps=60, min_sep=10, max_participations=6, amplified=False)
        """
        return self.parts.sampling.participation(self)

    @functools.cached_property
    def strategy(self) -> Any:
        """The DP-FTRL strategy of the plan, built once over ``steps``.

        ``band_mf``: ``band_mf_strategy(steps, bands)``; ``bsr``: ``bsr_strategy(steps,
        bands)``; ``blt``: ``blt_strategy(steps, min_sep=..., max_participations=...)``
        optimised for the plan's :attr:`participation`. Computed on first use and kept (a
        cache of a function of the plan's fields: outside equality and ``to_dict``).
        """
        return self.parts.mechanism.strategy(self)

    def accountant(self) -> Any:
        """An :class:`~opake_fx.accounting.Accountant` with the plan's budget.

        The budget is ``(target_epsilon, delta)``, or, for a plan given a noise
        multiplier, the epsilon of the whole planned run at ``delta``. Charge
        :attr:`step_cost` per step (``accountant.step(plan.step_cost)``); it refuses a
        step that would exceed the budget. The budget carries the plan's ``delta``, so
        ``accountant.epsilon`` is the epsilon spent so far at it (``accountant.delta``).
        """
        import opake_fx.accounting as acc

        delta = self._need_delta("accountant")
        # A plan given a noise multiplier has no target: its budget is the whole run's epsilon, with
        # room for the accountant's step-by-step composition (up to ~1e-5 above the one-shot one).
        # An ELS plan's accountant counts examples: its budget is the planned run's epsilon per example
        # (the per-user guarantee is that run's, by group privacy: spent_epsilons).
        if self.user_sampling == "examples":
            eps = self._example_epsilon(self.steps) * (1.0 + _RUNNING_SLACK)
        else:
            eps = self.target_epsilon if self.target_epsilon is not None else self.epsilon() * (1.0 + _RUNNING_SLACK)
        if math.isinf(eps):
            if self.noise_multiplier == 0:
                raise InputValueError(
                    "DPPlan.accountant: this plan has noise_multiplier=0 (a non-private baseline, epsilon = inf); "
                    "there is no budget to account against."
                )
            raise InputValueError(
                f"DPPlan.accountant: with noise_multiplier={self.noise_multiplier:g} the planned run's epsilon at "
                f"delta={delta:g} is infinite (no finite epsilon bounds it), so there is no budget to account "
                "against. Give a noise multiplier that yields a finite epsilon (or target_epsilon to calibrate one), "
                "or noise_multiplier=0 for an explicit non-private baseline."
            )
        return acc.Accountant(acc.epsilon_budget(eps, delta, accountant=self.accountant_kind, unit=self._accounted_unit))

    def epsilon(self, steps: int | None = None) -> float:
        """Epsilon at ``delta`` after ``steps`` steps (default: the whole run), in the plan's unit.

        Per example for an example-level plan, per user for ``privacy_unit="user"``
        (:attr:`epsilon_unit` says which; :meth:`epsilons` gives every unit that applies);
        inf for ``noise_multiplier=0``.

        Example:
            >>> DPPlan(dataset_size=1000, batch_size=10, steps=100, noise_multiplier=0.0, delta=1e-5).epsilon()
            inf
        """
        if self.user_sampling == "examples":
            return self.epsilons(steps)["per_user"]
        return self._example_epsilon(self._steps_arg(steps, "epsilon"))

    @property
    def epsilon_unit(self) -> str:
        """``"per example"`` or ``"per user"``: the unit of :meth:`epsilon` and of ``target_epsilon``.

        Example:
            >>> DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5).epsilon_unit
            'per example'
        """
        return f"per {self.privacy_unit}"

    def epsilons(self, steps: int | None = None) -> dict[str, float]:
        """Epsilon at ``delta`` after ``steps`` steps in every unit the plan protects, keyed by unit.

        ``{"per_example": ...}`` for an example-level plan; ``{"per_user": ...}`` with
        user-level sampling (each user is one unit); ``{"per_example": ..., "per_user":
        ...}`` with ``user_sampling="examples"``, the per-user epsilon by group privacy for
        ``max_examples_per_user`` (:func:`~opake_fx.accounting.group_epsilon`: the smaller
        of the group privacy lemma and RDP's group property).

        Example:
            >>> plan = DPPlan(dataset_size=400, batch_size=40, steps=20, noise_multiplier=2.0, delta=1e-5,
            ...               privacy_unit="user", max_examples_per_user=4, user_sampling="examples")
            >>> e = plan.epsilons()
            >>> sorted(e), e["per_user"] > 4 * e["per_example"] > 0
            (['per_example', 'per_user'], True)
        """
        n = self._steps_arg(steps, "epsilons")
        if self.user_sampling != "examples":
            return {self.epsilon_unit.replace(" ", "_"): self._example_epsilon(n)}
        return {"per_example": self._example_epsilon(n), "per_user": self._group_epsilon(self.noise_multiplier, n)}

    def spent_epsilons(self, accountant: Any) -> dict[str, float]:
        """What ``accountant`` (this plan's :meth:`accountant`) has spent, at ``delta``, in every unit, as :meth:`epsilons`.

        Raises:
            InputValueError: ``accountant`` counts another unit than this plan's (e.g. an
                example-level accountant for a user-level plan): mixing units is refused.

        Example:
            >>> plan = DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5,
            ...               privacy_unit="user", max_examples_per_user=2)
            >>> acct = plan.accountant()
            >>> acct.step(plan.step_cost)
            >>> list(plan.spent_epsilons(acct)) == ["per_user"], plan.spent_epsilons(acct)["per_user"] == acct.epsilon
            (True, True)
        """
        delta = self._need_delta("spent_epsilons")
        unit = getattr(getattr(accountant, "budget", None), "unit", None)
        if unit != self._accounted_unit:
            raise InputValueError(
                f"DPPlan.spent_epsilons: the accountant counts {unit!r} units but this plan's accountant counts "
                f"{self._accounted_unit!r} units; epsilons of different units do not mix. Use plan.accountant()."
            )
        spent = float(accountant.spent_epsilon(delta))
        if self.user_sampling != "examples":
            return {self.epsilon_unit.replace(" ", "_"): spent}
        from opake_fx.accounting import group_epsilon

        k = self.max_examples_per_user
        return {"per_example": spent,
                "per_user": group_epsilon(accountant.spent, k, delta, accountant=self.accountant_kind)}

    @property
    def _accounted_unit(self) -> str:
        """The unit the plan's accountant counts: the user with user-level sampling, else the example."""
        return "user" if self.user_sampling == "users" else "example"

    def _steps_arg(self, steps: int | None, where: str) -> int:
        n = self.steps if steps is None else check.integer(steps, "steps", "DPPlan", minimum=0)
        if n > self.steps:
            raise InputValueError(f"DPPlan.{where}: the plan has {self.steps} steps; got steps={n}.")
        return n

    def _example_epsilon(self, n: int) -> float:
        """The run's first ``n`` steps' epsilon at ``delta``, per accounted unit (example, or user with ULS)."""
        delta = self._need_delta("epsilon")
        if self.noise_multiplier == 0:
            return math.inf if n > 0 else 0.0
        return self.run_cost(self.noise_multiplier, n).epsilon_at(delta, accountant=self.accountant_kind)

    def _group_epsilon(self, nm: float, n: int) -> float:
        """ELS: the per-user epsilon of the first ``n`` steps at ``nm``: group privacy for ``max_examples_per_user``."""
        from opake_fx.accounting import group_epsilon

        if nm == 0:
            return math.inf if n > 0 else 0.0
        return group_epsilon(self.run_cost(nm, n), self.max_examples_per_user, self._need_delta("epsilon"),
                             accountant=self.accountant_kind)

    def spent_after(self, steps: int) -> Any:
        """What an accountant charged ``step_cost_at(t)`` for ``t < steps`` has spent: a :class:`DpProcess`.

        The composition of the first ``steps`` step costs (``identity()`` for 0 steps,
        ``nonprivate()`` for a non-private baseline), normalised, so it compares equal to
        ``accountant.spent`` of such an accountant. A run checkpoint checks the one against
        the other (:meth:`load_checkpoint`).

        Example:
            >>> plan = DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5)
            >>> acct = plan.accountant()
            >>> for t in range(3):
            ...     acct.step(plan.step_cost_at(t))
            >>> acct.spent == plan.spent_after(3), acct.spent == plan.spent_after(2)
            (True, False)
        """
        from opake_fx.accounting import compose, identity, nonprivate

        n = check.integer(steps, "steps", "DPPlan.spent_after", minimum=0, maximum=self.steps)
        if n == 0:
            return identity()
        if self.noise_multiplier == 0:
            return nonprivate()
        if not self.participation.amplified:
            return compose(*self._step_increments[:n])
        return self.run_cost(self.noise_multiplier, n)

    def save_checkpoint(self, path: Any, *, params: Any, state: Any, sampler: Any = None, accountant: Any = None,
                        **extra: Any) -> int:
        """Saves one step of this plan's run (atomic, checksummed file), with the plan's identity inside it.

        Args:
            path: the file (on several ranks, one per rank: ``f"ckpt.rank{rank}.pt"``); for
                an FSDP2 run (``params`` sharded ``DTensor`` s), ONE directory that every
                rank sees, written through ``torch.distributed.checkpoint``
                (:mod:`opake_fx.distributed.fsdp_checkpoint`).
            params: the parameters.
            state: the state of :meth:`pipeline` after the last step; its noise and clip
                steps (which must agree) are the run's step.
            sampler: this rank's sampler from :meth:`sampler`; saved at the run's step
                (its next batch is the step's, whatever a ``DataLoader`` prefetched).
            accountant: the run's :meth:`accountant`, charged ``step_cost_at(t)`` for every
                step ``t`` taken (``None`` for a non-private baseline).
            **extra: more named trees to save (any state :mod:`opake_fx.serialization` handles).

        Returns:
            The run's step (the number of steps taken).

        Raises:
            InputValueError: the state's counters disagree, or the accountant's steps or
                spent process are not this plan's first ``step`` steps (nothing is written).

        Privacy: the file holds the noise keys (whoever reads it can recompute the noise):
        keep it as private as the training data. :meth:`load_checkpoint` refuses a file
        that is not one step of this run (see ``docs/checkpoints.md``).

        Example:
            >>> import tempfile, torch
            >>> from opake_fx.optimizers import sgd
            >>> from opake_fx.random import key
            >>> plan = DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5)
            >>> pipeline = plan.pipeline(lambda p, x: ((x - p) ** 2).sum(), sgd(0.1), key=key(0), batch_argnums=(1,))
            >>> params, sampler, acct = torch.zeros(2), plan.sampler(range(100), key(1)), plan.accountant()
            >>> state = pipeline.init(params)
            >>> acct.step(plan.step_cost_at(0))
            >>> updates, state = pipeline.update((torch.ones(3, 2),), state, params)
            >>> path = tempfile.mkdtemp() + "/run.pt"
            >>> plan.save_checkpoint(path, params=params, state=state, sampler=sampler, accountant=acct)
            1
            >>> ckpt = plan.load_checkpoint(path, params=params, state=pipeline.init(params), sampler=sampler,
            ...                             accountant=plan.accountant())
            >>> ckpt["step"], ckpt["sampler"].next_step, ckpt["accountant"].steps
            (1, 1, 1)
        """
        from opake_fx.distributed.fsdp_checkpoint import is_sharded, save_sharded_run
        from opake_fx.serialization.runs import save_run

        if is_sharded(params):
            return save_sharded_run(path, self, params=params, state=state, sampler=shard_sampler(sampler),
                                    accountant=accountant, **extra)
        return save_run(path, self, params=params, state=state, sampler=shard_sampler(sampler),
                        accountant=accountant, **extra)

    def load_checkpoint(self, path: Any, *, params: Any, state: Any, sampler: Any = None, accountant: Any = None,
                        check_ranks: bool = True, **extra: Any) -> dict[str, Any]:
        """Reads one step of this plan's run, refusing a file that is not one.

        The file must record this plan (its identity is a tree inside the checksummed
        file); every counter in it must be the run's step (noise step, clip step, the
        sampler's position, the accountant's step count) and the accountant's spent
        process this plan's cost of exactly those steps; the noise, count-noise and sampler
        keys must be the ones ``state`` and ``sampler`` were built with; and privacy
        parameters (clip norm, count-noise multiplier, rates, budget) are this plan's: the
        file's copies are compared, never used. A checksum alone cannot give this: whoever
        can write the file can recompute it.

        Args:
            path: the file :meth:`save_checkpoint` wrote (the directory, for an FSDP2 run:
                resumed on the same number of ranks, else refused; see
                :mod:`opake_fx.distributed.fsdp_checkpoint`).
            params: template parameters.
            state: the template state, ``pipeline.init(params)`` of this plan's pipeline
                (built with the run's keys).
            sampler: this rank's sampler from :meth:`sampler` (the run's sampler key).
            accountant: a fresh :meth:`accountant` (``None`` for a non-private baseline).
            check_ranks: under ``torch.distributed`` with 2+ ranks, all ranks call together
                and refuse together (one rank's bad file stops every rank), and the ranks
                must restore the same noise key and step.
            **extra: templates of the extra trees saved.

        Returns:
            ``{"params", "state", "sampler", "accountant", ..., "step"}``: the restored
            trees (a restored copy of the sampler, at the run's step) and the run's step.
            Nothing given is modified.

        Raises:
            CheckpointError: the file is missing, damaged or does not fit; it was made by
                another plan; or its counters, keys or privacy parameters disagree (each
                disagreement named). ``CheckpointRanksError`` when another rank refused.

        Privacy: the resumed run continues the noise sequence after the saved step (no key
        drawn twice), and its accountant holds every step taken, under this plan.

        Example:
            See :meth:`save_checkpoint`.
        """
        from opake_fx.distributed.fsdp_checkpoint import is_sharded, load_sharded_run
        from opake_fx.serialization.runs import load_run

        if is_sharded(params):
            if not check_ranks:
                raise InputValueError("DPPlan.load_checkpoint: a sharded (FSDP2) run always checks the ranks together "
                                      "(its tensors are read by every rank at once); leave check_ranks out.")
            out = load_sharded_run(path, self, params=params, state=state, sampler=shard_sampler(sampler),
                                   accountant=accountant, **extra)
        else:
            out = load_run(path, self, params=params, state=state, sampler=shard_sampler(sampler),
                           accountant=accountant, check_ranks=check_ranks, **extra)
        if isinstance(sampler, OffsetSampler):
            out["sampler"] = OffsetSampler(out["sampler"], sampler.start, indices=sampler.indices)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The plan's fields as plain (JSON) data (``DPPlan(**d)`` rebuilds it without recalibrating).

        A per-group ``clipping_norm`` is written ``{"groups": [[path, group], ...],
        "values": {group: C_g}}`` (paths as lists), ``clipping_kwargs`` as a dict.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        c = self.clipping_norm
        if isinstance(c, PerGroup):
            pairs = sorted(([list(path), group] for path, group in c.groups.items()), key=repr)
            d["clipping_norm"] = {"groups": pairs, "values": dict(sorted(c.values.items()))}
        d["clipping_kwargs"] = dict(self.clipping_kwargs or {})
        if self.privacy_unit == "example":  # an example-level plan's identity is what it was before the unit existed
            del d["privacy_unit"], d["max_examples_per_user"], d["user_sampling"]
        return d

    def run_cost(self, noise_multiplier: float, steps: int) -> Any:
        """The :class:`~opake_fx.accounting.DpProcess` of the first ``steps`` steps at ``noise_multiplier``.

        What calibration searches over and :meth:`epsilon` measures: for an amplified
        scheme, the sampling part's amplification of the mechanism's opportunity, once per
        opportunity; otherwise the mechanism's whole run (``steps == self.steps``) or the
        composition of its first ``steps`` increments (the plan's own multiplier only).

        Example:
            >>> plan = DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5)
            >>> plan.run_cost(1.0, 5) == plan.step_cost * 5
            True
        """
        nm, n = noise_multiplier, steps
        if self.participation.amplified:
            return self._opportunity(nm) * self.parts.sampling.opportunities(self, n)
        if n == self.steps:  # the whole run: one Gaussian mechanism over the pattern
            return self.parts.mechanism.whole_run(self, nm)
        from opake_fx.accounting import compose, identity

        if nm != self.noise_multiplier:
            raise InputValueError("DPPlan: prefix accounting is for the plan's own noise multiplier.")
        return compose(*self._step_increments[:n]) if n > 0 else identity()  # one call: linear, not quadratic

    # --- private -----------------------------------------------------------------------

    def _opportunity(self, nm: float) -> Any:
        """One amplified opportunity: the sampling part's subsampling of the mechanism's release."""
        parts = self.parts
        return parts.sampling.amplify(self, parts.mechanism.opportunity(self, nm))

    @functools.cached_property
    def _step_increments(self) -> list[Any]:
        """Per-step costs of a pattern-accounted (b-min-sep / balls-in-bins) plan, built once."""
        return self.parts.mechanism.step_increments(self)

    def _check_privacy_unit(self) -> None:
        unit = check.choice(self.privacy_unit, "privacy_unit", "DPPlan", PRIVACY_UNITS)
        if unit == "example":
            for name in ("max_examples_per_user", "user_sampling"):
                if getattr(self, name) is not None:
                    raise InputValueError(
                        f"DPPlan: {name} applies to privacy_unit='user' only; this plan's unit is the example."
                    )
            return
        how = "users" if self.user_sampling is None else check.choice(
            self.user_sampling, "user_sampling", "DPPlan", USER_SAMPLINGS)
        object.__setattr__(self, "user_sampling", how)
        if how == "examples" and self.clipping_mode == "adaptive":
            raise InputValueError(
                "DPPlan(user_sampling='examples') takes clipping_mode='fixed' or 'auto': the adaptive norm's count "
                "is accounted per example, and its group conversion is not built. Use user_sampling='users'."
            )
        if self.max_examples_per_user is None:
            raise InputValueError(
                "DPPlan(privacy_unit='user') needs max_examples_per_user: the most examples of one user in a step "
                "(e.g. 8); a user with more contributes a random subset of that many."
            )
        object.__setattr__(self, "max_examples_per_user",
                           check.integer(self.max_examples_per_user, "max_examples_per_user", "DPPlan", minimum=1))
        unsupported = [f"{name}={value!r}" for name, value, ok in (
            ("sampling", self.sampling, "poisson"), ("mechanism", self.mechanism, "gaussian"),
            ("augmult", self.augmult, 1)) if value != ok]
        if unsupported:
            raise InputValueError(
                f"DPPlan(privacy_unit='user') is built for sampling='poisson', mechanism='gaussian' and augmult=1 "
                f"(user-level Poisson sampling, accounted as DP-SGD over users); got {', '.join(unsupported)}. The "
                "other samplers' and mechanisms' analyses over users are not built yet."
            )

    def _need_delta(self, where: str) -> float:
        if self.delta is None:
            raise InputValueError(f"DPPlan.{where} needs delta: build the plan with delta=... (e.g. 1e-5).")
        return self.delta

    def _resolve_noise_multiplier(self, delta: float | None) -> float:
        import opake_fx.accounting as acc

        nm = self.noise_multiplier
        if nm is not None:
            nm = check.real(nm, "noise_multiplier", "DPPlan", "sigma >= 0 (0: a non-private baseline)")
            if not (nm >= 0 and math.isfinite(nm)):
                raise InputValueError(f"DPPlan: noise_multiplier must be finite and >= 0; got {nm}.")
        if self.target_epsilon is None:
            if nm is None:
                raise InputValueError(
                    "DPPlan needs a privacy target: target_epsilon and delta (the noise multiplier is calibrated), "
                    "or noise_multiplier (0 for an explicit non-private baseline)."
                )
            return nm
        eps = check.real(self.target_epsilon, "target_epsilon", "DPPlan", "the epsilon to spend, e.g. 3.0")
        if not (eps > 0 and math.isfinite(eps)):
            raise InputValueError(f"DPPlan: target_epsilon must be finite and > 0; got {eps}.")
        object.__setattr__(self, "target_epsilon", eps)
        if delta is None:
            raise InputValueError("DPPlan: target_epsilon needs delta (e.g. 1e-5, below 1 / dataset_size).")
        # Calibrated a hair below the target: the accountant composes step by step, which may
        # come out up to ~1e-5 (relative) above the one-shot composition calibration measures
        # (both are upper bounds), and must not refuse the plan's own last step.
        if self.user_sampling == "examples":  # the target is per user: group privacy of the example-level run
            return self._calibrate_per_user(eps, delta, nm)
        budget = acc.epsilon_budget(eps * (1.0 - _RUNNING_SLACK), delta, accountant=self.accountant_kind)
        self.parts.clip_mode.check_budget(self, budget)
        if nm is not None:  # e.g. rebuilt from to_dict(): check instead of recalibrating
            if nm == 0 or not budget.is_met_by(self.run_cost(nm, self.steps)):
                raise InputValueError(
                    f"DPPlan: noise_multiplier={nm} does not meet target_epsilon={eps} at delta={delta} over "
                    f"{self.steps} steps at sample rate {self.sample_rate}. Leave noise_multiplier out to calibrate it."
                )
            return nm
        return float(acc.calibrate(budget, lambda s: self.run_cost(s, self.steps)).param)

    def _calibrate_per_user(self, eps: float, delta: float, nm: float | None) -> float:
        """ELS: the smallest noise multiplier (to 1e-4 relative) whose run is ``eps``-DP per user by group privacy."""
        target = eps * (1.0 - _RUNNING_SLACK)

        def meets(sigma: float) -> bool:
            return sigma > 0 and self._group_epsilon(sigma, self.steps) <= target

        if nm is not None:
            if not meets(nm):
                raise InputValueError(
                    f"DPPlan: noise_multiplier={nm} does not meet target_epsilon={eps} per user (group privacy for "
                    f"max_examples_per_user={self.max_examples_per_user}) at delta={delta}. Leave noise_multiplier "
                    "out to calibrate it."
                )
            return nm
        low, high = 0.0, 0.5
        while not meets(high):
            low, high = high, 2.0 * high
            if high > _MAX_PER_USER_SIGMA:
                raise CalibrationError(
                    f"DPPlan: no noise multiplier up to {_MAX_PER_USER_SIGMA:g} meets target_epsilon={eps} per user "
                    f"with every user a group of max_examples_per_user={self.max_examples_per_user} examples over "
                    f"{self.steps} steps. Lower max_examples_per_user, raise the target, or sample users "
                    "(user_sampling='users')."
                )
        while high - low > 1e-4 * high:
            mid = 0.5 * (low + high)
            low, high = (low, mid) if meets(mid) else (mid, high)
        return high


def _is_sharded_model(model: Any) -> bool:
    """True for the functional model of an FSDP2-sharded module (``make_functional_fsdp``)."""
    from opake_fx.functional import FunctionalModel

    if not isinstance(model, FunctionalModel) or type(model) is FunctionalModel:
        return False
    from opake_fx.distributed.fsdp import FSDPFunctionalModel

    return isinstance(model, FSDPFunctionalModel)


# Relative room between the one-shot composition of a whole run and the accountant's running
# composition of its steps (2.4e-5 the largest found, 5e-5 tested: tests/accounting/test_incremental.py).
_RUNNING_SLACK = 1e-4

# The largest noise multiplier a per-user (group privacy) calibration tries before it gives up.
_MAX_PER_USER_SIGMA = 1e4


def _used_field(value: Any, name: str, kind: str, part: Any, parts: Sequence[Any], flag: str,
                needs: Callable[[], str], *, minimum: int) -> int | None:
    """A plan field that only some parts use (``min_sep``, ``bands``, ``max_batch_size``): required
    (and checked) when ``part`` uses it, refused when given to a part that does not."""
    if getattr(part, flag):
        if value is None:
            raise InputValueError(needs())
        return check.integer(value, name, "DPPlan", minimum=minimum)
    if value is not None:
        users = " or ".join(repr(p.name) for p in parts if getattr(p, flag))
        raise InputValueError(f"DPPlan: {name} applies to {kind}={users} only; {kind}={part.name!r}.")
    return None


def _sampling(n: int, batch_size: Any, sample_rate: Any) -> tuple[float, float]:
    if batch_size is None and sample_rate is None:
        raise InputValueError("DPPlan needs batch_size (the expected batch size) or sample_rate.")
    if sample_rate is not None:
        q = check.probability(sample_rate, "sample_rate", "DPPlan")
        given = None if batch_size is None else check.real(batch_size, "batch_size", "DPPlan")
        if given is not None and not math.isclose(given, q * n, rel_tol=1e-9):
            raise InputValueError(
                f"DPPlan: batch_size={batch_size} and sample_rate={q} disagree (sample_rate * dataset_size = {q * n}); "
                "give one of them."
            )
        return q, q * n
    b = check.real(batch_size, "batch_size", "DPPlan", "the expected number of examples per batch")
    if not 0 < b <= n:
        raise InputValueError(f"DPPlan: batch_size must be in (0, dataset_size={n}]; got {b}.")
    return b / n, b


def _length(q: float, steps: Any, epochs: Any) -> tuple[int, float]:
    if steps is None and epochs is None:
        raise InputValueError("DPPlan needs steps or epochs (expected passes over the data).")
    if steps is not None:
        t = check.integer(steps, "steps", "DPPlan", minimum=1)
        if epochs is not None and not math.isclose(check.real(epochs, "epochs", "DPPlan"), t * q, rel_tol=1e-9):
            raise InputValueError(
                f"DPPlan: steps={t} and epochs={epochs} disagree (steps * sample_rate = {t * q}); give one of them."
            )
        return t, t * q
    e = check.real(epochs, "epochs", "DPPlan", "expected passes over the data")
    if not (e > 0 and math.isfinite(e)):
        raise InputValueError(f"DPPlan: epochs must be finite and > 0; got {e}.")
    t = max(1, int(round(e / q)))
    return t, t * q


def _pairs() -> str:
    return "; ".join(f"{m}: {', '.join(s)}" for m, s in compatible_pairs().items())

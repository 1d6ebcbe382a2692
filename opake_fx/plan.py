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
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.random import RngKey, fold_in
from opake_fx.types import PerGroup

__all__ = ["DPPlan", "KeyRoles", "Participation", "RecordedLossState", "SAMPLERS", "MECHANISMS", "COMPATIBLE", "CLIPPING_MODES", "CLIPPING_KWARGS",
           "check_clipping_kwargs", "per_group_by_regex", "regex_norms"]

SAMPLERS = ("poisson", "truncated_poisson", "cyclic_poisson", "b_min_sep", "balls_in_bins")
"""The samplers a plan can use; each comes with its own accounting."""

MECHANISMS = ("gaussian", "band_mf", "bsr", "blt")
"""The noise mechanisms: DP-SGD's Gaussian, or DP-FTRL with a BandMF, BSR or BLT strategy."""

COMPATIBLE: dict[str, tuple[str, ...]] = {
    "gaussian": ("poisson", "truncated_poisson"),
    "band_mf": ("cyclic_poisson", "b_min_sep", "balls_in_bins"),
    "bsr": ("cyclic_poisson", "b_min_sep", "balls_in_bins"),
    "blt": ("b_min_sep", "balls_in_bins"),
}
"""The samplers each mechanism goes with (the pairs whose accounting the plan knows).

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


CLIPPING_MODES = ("fixed", "auto", "adaptive")
"""How the plan clips: ``fixed`` (to ``clipping_norm``, one norm or per group), ``auto``
(AUTO-S, Bu et al. 2023: every gradient scaled to norm just under ``clipping_norm``) or
``adaptive`` (the norm tracks a quantile of the gradient norms through a noised count,
Andrew et al. 2021; ``clipping_norm`` is the initial norm)."""

CLIPPING_KWARGS: dict[str, dict[str, float | None]] = {
    "fixed": {},
    "auto": {"gamma": 0.01},
    "adaptive": {"target_quantile": 0.5, "learning_rate": 0.2, "count_noise_multiplier": None},
}
"""The ``clipping_kwargs`` each clipping mode takes, with their defaults (``None``: derived;
``count_noise_multiplier`` defaults to ``batch_size / 20``, Andrew et al.'s suggestion)."""


@dataclass(frozen=True)
class Participation:
    """How one example can take part in a plan's run: the ONE value the noise and the accounting read.

    The DP-FTRL noise stage scales its noise to ``strategy.sensitivity(min_sep,
    max_participations)`` over ``steps`` steps, and the plan's accounting charges the
    same pattern, so the two cannot disagree.

    Attributes:
        steps: the run's length (the strategy's horizon).
        min_sep: the fewest steps between two participations of one example.
        max_participations: the most participations of one example that the noise is
            scaled to (1 for the amplified samplers: one opportunity at a time).
        amplified: True when the accounting composes per-opportunity sampling
            amplification (``poisson``, ``truncated_poisson``, ``cyclic_poisson``); False
            when the whole run is one Gaussian mechanism over this pattern.

    Example:
        >>> Participation(steps=100, min_sep=10, max_participations=10, amplified=False).max_participations
        10
    """

    steps: int
    min_sep: int
    max_participations: int
    amplified: bool


class KeyRoles:
    """The ledger of which role each of a plan's keys plays (sampler, noise, adaptive count,
    augmentation): one key, one role.

    Every plan holds one, created with it (:attr:`DPPlan.key_roles`); the samplers and
    pipelines built from the plan record their keys in it, so that the plan itself is never
    changed after construction. It is outside the plan's equality, hash and ``to_dict``
    (a plan is the same plan whichever keys it was used with).

    Privacy: the noise, the sampling, the count noise and the augmentation must draw from
    independent keys; one key in two roles makes, e.g., the noise a function of the same
    random bits as the choice of the batch. :meth:`claim` refuses it.

    Example:
        >>> from opake_fx.random import key
        >>> roles = KeyRoles()
        >>> roles.claim(("sampler", key(1)), ("noise", key(2)))
        >>> roles.role_of(key(2))
        'noise'
        >>> roles.claim(("noise", key(1)))
        Traceback (most recent call last):
          ...
        opake_fx.errors.InputValueError: DPPlan: RngKey(...) is already this plan's sampler key; ...
        >>> roles.claim(("count", key(3)), ("augmentation", key(3)))  # within one call too
        Traceback (most recent call last):
          ...
        opake_fx.errors.InputValueError: DPPlan: RngKey(...) is already this plan's count key; ...
        >>> roles.role_of(key(3)) is None  # a refused call records nothing
        True
    """

    def __init__(self) -> None:
        self._roles: dict[RngKey, str] = {}

    def claim(self, *roles: tuple[str, RngKey]) -> None:
        """Records each ``(role, key)``; refuses a key that already has another role. All are
        checked before any is recorded, so a refused call changes nothing."""
        claimed = dict(self._roles)
        for role, k in roles:
            other = claimed.setdefault(k, role)
            if other != role:
                raise InputValueError(
                    f"DPPlan: {k!r} is already this plan's {other} key; the {role} key must be another one. One key "
                    "in two roles ties the two random draws together (e.g. the noise to the choice of the batch). "
                    "Derive independent keys, e.g. sampler_key, noise_key, count_key = split(key(seed), 3) (for "
                    "several runs from one plan, one split per run: keys distinct across runs too)."
                )
        self._roles = claimed

    def role_of(self, k: RngKey) -> str | None:
        """The role ``k`` was claimed for, or None."""
        return self._roles.get(k)


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

    def __hash__(self) -> int:  # clipping_kwargs is a mapping: hash the canonical plain data
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key_roles", KeyRoles())  # (not a field: outside equality, hashing and to_dict)
        n = check.integer(self.dataset_size, "dataset_size", "DPPlan", minimum=1)
        check.integer(self.augmult, "augmult", "DPPlan", minimum=1)
        check.choice(self.sampling, "sampling", "DPPlan", SAMPLERS)
        check.choice(self.mechanism, "mechanism", "DPPlan", MECHANISMS)
        if self.sampling not in COMPATIBLE[self.mechanism]:
            raise InputValueError(
                f"DPPlan: sampling={self.sampling!r} does not go with mechanism={self.mechanism!r} (the plan has no "
                f"sound accounting for that pair). mechanism={self.mechanism!r} takes sampling in "
                f"{COMPATIBLE[self.mechanism]}; the valid pairs are {_pairs()}."
            )
        min_sep = self._resolve_min_sep(n)
        batch_size = self.batch_size
        if self.sampling == "balls_in_bins" and batch_size is None and self.sample_rate is None:
            batch_size = n / min_sep  # every example once per cycle of min_sep bins
        q, b = _sampling(n, batch_size, self.sample_rate)
        steps, epochs = _length(q, self.steps, self.epochs)
        c = _clipping_norm(self.clipping_norm)
        mode = check.choice(self.clipping_mode, "clipping_mode", "DPPlan", CLIPPING_MODES)
        object.__setattr__(self, "clipping_kwargs", MappingProxyType(_clipping_kwargs(mode, self.clipping_kwargs, b)))
        self._check_clipping_mode(c)
        if min_sep is not None:
            self._check_min_sep(n, b, steps, min_sep)
        if self.mechanism in ("band_mf", "bsr"):
            bands = check.integer(self.bands, "bands", "DPPlan", minimum=1) if self.bands is not None else None
            if bands is None:
                raise InputValueError(
                    f"DPPlan(mechanism={self.mechanism!r}) needs bands (e.g. 4): the strategy's band count."
                )
            if self.sampling == "cyclic_poisson" and b * bands > n:
                raise InputValueError(
                    f"DPPlan: batch_size * bands = {b * bands} exceeds dataset_size={n}: each of the {bands} groups "
                    "cannot supply the expected batch. Use fewer bands or a smaller batch."
                )
            object.__setattr__(self, "bands", bands)
        elif self.bands is not None:
            raise InputValueError(
                f"DPPlan: bands applies to mechanism='band_mf' or 'bsr' only; mechanism={self.mechanism!r}."
            )
        object.__setattr__(self, "min_sep", min_sep)
        check.choice(self.clip_backend, "clip_backend", "DPPlan", ("vmap", "ghost", "auto"))
        check.choice(self.accountant_kind, "accountant_kind", "DPPlan", ("pld", "rdp"))
        cap = None
        if self.sampling == "truncated_poisson":
            if self.max_batch_size is None:
                raise InputValueError("DPPlan(sampling='truncated_poisson') needs max_batch_size (the batch cap).")
            cap = check.integer(self.max_batch_size, "max_batch_size", "DPPlan", minimum=1)
        elif self.max_batch_size is not None:
            raise InputValueError("DPPlan: max_batch_size applies to sampling='truncated_poisson' only.")
        for name, value in (("dataset_size", n), ("batch_size", b), ("sample_rate", q), ("steps", steps),
                            ("epochs", epochs), ("clipping_norm", c), ("max_batch_size", cap)):
            object.__setattr__(self, name, value)
        delta = None
        if self.delta is not None:
            delta = check.real(self.delta, "delta", "DPPlan", "e.g. 1e-5, below 1 / dataset_size")
        if delta is not None and not 0 < delta < 1:
            raise InputValueError(f"DPPlan: delta must be in (0, 1); got {delta}.")
        object.__setattr__(self, "delta", delta)
        nm = self._resolve_noise_multiplier(delta)
        object.__setattr__(self, "noise_multiplier", nm)

    # --- what the plan builds ----------------------------------------------------------

    def sampler(self, dataset: Any, key: RngKey, *, rank: int | None = None, world_size: int | None = None) -> Any:
        """The batch sampler of this rank: Poisson batches of its shard, ``sample_rate``, ``steps``.

        Args:
            dataset: the whole training set (its length must be ``dataset_size``).
            key: the sampler key (NOT the noise key); each rank uses ``fold_in(key, rank)``.
            rank, world_size: default: the current process group's (1 process: 0, 1); under a
                process group, values other than the group's are refused.

        Returns:
            A ``DataLoader`` batch sampler yielding indices into ``dataset``:
            ``PoissonSampler`` / ``TruncatedPoissonSampler`` (Gaussian), or
            ``CyclicPoissonSampler`` / ``MinSepSampler`` (warm-started) /
            ``BallsInBinsSampler`` from :mod:`opake_fx.dpftrl.sampling`.

        Privacy: each example's participation depends only on its own keyed draws, so the
        union of the ranks' batches (disjoint shards, independent keys) is the plan's
        sampler over the whole dataset, with the pattern the accountant charges.
        """
        from opake_fx.distributed import get_rank, get_world_size, is_distributed, shard_bounds
        from opake_fx.dpsgd.sampling import PoissonSampler, TruncatedPoissonSampler

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
        shard = range(start, stop)
        if self.sampling == "cyclic_poisson":
            from opake_fx.dpftrl.sampling import CyclicPoissonSampler

            inner: Any = CyclicPoissonSampler(
                shard, sample_rate=self.group_rate, partitions=self.bands, n_steps=self.steps, key=local_key
            )
        elif self.sampling == "b_min_sep":
            from opake_fx.dpftrl.sampling import MinSepSampler

            inner = MinSepSampler(shard, sample_rate=self.participation_rate, min_sep=self.min_sep,
                                  n_steps=self.steps, key=local_key, warm_start=True)
        elif self.sampling == "balls_in_bins":
            from opake_fx.dpftrl.sampling import BallsInBinsSampler

            inner = BallsInBinsSampler(shard, cycle_length=self.min_sep, n_steps=self.steps, key=local_key)
        elif self.sampling == "truncated_poisson":
            if world_size > 1:
                raise InputValueError(
                    "DPPlan: sampling='truncated_poisson' caps the whole batch, which ranks sampling their shards "
                    "independently cannot do; use sampling='poisson' under a process group."
                )
            inner = TruncatedPoissonSampler(
                shard, sample_rate=self.sample_rate, n_steps=self.steps, key=local_key, max_batch_size=self.max_batch_size
            )
        else:
            inner = PoissonSampler(shard, sample_rate=self.sample_rate, n_steps=self.steps, key=local_key)
        return _Offset(inner, start) if start else inner

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
            model: the functional model, for ``"ghost"``/``"auto"``.
            batch_argnums: the positions of the batch tensors in ``loss_fn``.
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
        from opake_fx.dpsgd import adaptive_clip, auto_clip, clip, noise
        from opake_fx.transforms import named_chain

        if not isinstance(key, RngKey):
            raise InputTypeError(f"DPPlan.pipeline needs key=opake_fx.random.key(seed) (the noise key); got {type(key).__name__}.")
        self._key_roles.claim(("noise", key), *[(r, k) for r, k in (("count", count_key), ("augmentation", augment_key))
                                           if isinstance(k, RngKey)])

        if self.mechanism != "gaussian":
            from opake_fx.dpftrl import noise as mf_noise

            p = self.participation  # the same value the accounting reads
            noise_stage = mf_noise(self.strategy, noise_multiplier=self.noise_multiplier, key=key, min_sep=p.min_sep,
                                   max_participations=p.max_participations, n_steps=p.steps)
        else:  # isotropic: every coordinate at the total sensitivity (a scalar max_norm ignores it)
            noise_stage = noise(noise_multiplier=self.noise_multiplier, key=key, allocation="isotropic")
        clip_args: dict[str, Any] = dict(normalize_by=self.batch_size, batch_argnums=tuple(batch_argnums),
                                         clip_backend=self.clip_backend, model=model)
        if microbatch_size is not None:
            clip_args["microbatch_size"] = microbatch_size  # validated by clipped_grad
        kw = self.clipping_kwargs
        if self.clipping_mode == "adaptive":
            if not isinstance(count_key, RngKey):
                raise InputValueError(
                    "DPPlan(clipping_mode='adaptive').pipeline needs count_key=key(...): the key of the clipped "
                    "count's noise (the same on every rank; not the noise key, not the sampler key)."
                )
            # the count key is bound here: augmult's own keyword `key` is the augmentation key
            factory: Callable[..., Any] = functools.partial(adaptive_clip, key=count_key)
            clip_args.update(initial_clipping_norm=self.clipping_norm,
                             count_noise_multiplier=kw["count_noise_multiplier"],
                             target_quantile=kw["target_quantile"], learning_rate=kw["learning_rate"],
                             expected_batch_size=self.batch_size)
        elif count_key is not None:
            raise InputValueError(
                f"DPPlan.pipeline(count_key=...) applies to clipping_mode='adaptive' only; this plan's clipping_mode is "
                f"{self.clipping_mode!r}. Leave count_key out."
            )
        elif self.clipping_mode == "auto":
            factory = auto_clip
            clip_args.update(clipping_norm=self.clipping_norm, gamma=kw["gamma"])
        else:
            factory = clip
            clip_args["clipping_norm"] = self.clipping_norm
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
            clip_stage = _loss_recording(factory, loss_fn, clip_args, count_key)
        else:
            clip_stage = factory(loss_fn, **clip_args)
        if self.clipping_mode == "adaptive":
            clip_stage = _synced_counts(clip_stage)
        return named_chain(
            ("clip", clip_stage),
            ("psum", psum()),
            ("noise", noise_stage),
            ("opt", optimizer),
        )

    def padding_buckets(self, growth: float = 1.25) -> tuple[int, ...]:
        """Padded batch sizes for this plan's sampler (:func:`opake_fx.padding.geometric_buckets`).

        From half the expected batch size up to the largest batch the sampler can draw
        (the dataset, or ``max_batch_size`` for ``"truncated_poisson"``), ``growth``
        apart: a compiled step meets a few shapes instead of one per batch size.

        Privacy: none (sizes only); padding rows are masked out of the clip stage.
        """
        from opake_fx.padding import geometric_buckets

        top = self.max_batch_size if self.sampling == "truncated_poisson" and self.max_batch_size else self.dataset_size
        return geometric_buckets(float(self.batch_size), up_to=int(top), growth=growth)

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
        if self.mechanism != "gaussian":
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
        if self.sampling == "cyclic_poisson":
            from opake_fx.accounting import identity

            return self._opportunity(self.noise_multiplier) if t % self.bands == 0 else identity()
        if not self.participation.amplified:
            return self._step_increments[t]
        return self._step(self.noise_multiplier)

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
        if self.sampling != "b_min_sep":
            raise InputValueError("DPPlan.participation_rate: only a sampling='b_min_sep' plan has one.")
        b = self.batch_size
        return min(1.0, b / (self.dataset_size - (self.min_sep - 1) * b))

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
        if self.sampling in ("b_min_sep", "balls_in_bins"):
            return Participation(self.steps, self.min_sep, -(-self.steps // self.min_sep), amplified=False)
        return Participation(self.steps, self.bands or 1, 1, amplified=True)

    @functools.cached_property
    def strategy(self) -> Any:
        """The DP-FTRL strategy of the plan, built once over ``steps``.

        ``band_mf``: ``band_mf_strategy(steps, bands)``; ``bsr``: ``bsr_strategy(steps,
        bands)``; ``blt``: ``blt_strategy(steps, min_sep=..., max_participations=...)``
        optimised for the plan's :attr:`participation`. Computed on first use and kept (a
        cache of a function of the plan's fields: outside equality and ``to_dict``).
        """
        if self.mechanism == "gaussian":
            raise InputValueError("DPPlan.strategy: a mechanism='gaussian' plan has no DP-FTRL strategy.")
        import opake_fx.dpftrl as mf

        p = self.participation
        if self.mechanism == "band_mf":
            return mf.band_mf_strategy(self.steps, self.bands)
        if self.mechanism == "bsr":
            return mf.bsr_strategy(self.steps, self.bands)
        return mf.blt_strategy(self.steps, min_sep=p.min_sep, max_participations=p.max_participations)

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
        return acc.Accountant(acc.epsilon_budget(eps, delta, accountant=self.accountant_kind))

    def epsilon(self, steps: int | None = None) -> float:
        """Epsilon at ``delta`` after ``steps`` steps (default: the whole run); inf for ``noise_multiplier=0``.

        Example:
            >>> DPPlan(dataset_size=1000, batch_size=10, steps=100, noise_multiplier=0.0, delta=1e-5).epsilon()
            inf
        """
        delta = self._need_delta("epsilon")
        n = self.steps if steps is None else check.integer(steps, "steps", "DPPlan", minimum=0)
        if n > self.steps:
            raise InputValueError(f"DPPlan.epsilon: the plan has {self.steps} steps; got steps={n}.")
        if self.noise_multiplier == 0:
            return math.inf if n > 0 else 0.0
        return self._run(self.noise_multiplier, n).epsilon_at(delta, accountant=self.accountant_kind)

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
        return self._run(self.noise_multiplier, n)

    def save_checkpoint(self, path: Any, *, params: Any, state: Any, sampler: Any = None, accountant: Any = None,
                        **extra: Any) -> int:
        """Saves one step of this plan's run (atomic, checksummed file), with the plan's identity inside it.

        Args:
            path: the file (on several ranks, one per rank: ``f"ckpt.rank{rank}.pt"``).
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
        from opake_fx.serialization.runs import save_run

        return save_run(path, self, params=params, state=state, sampler=_shard_sampler(sampler),
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
            path: the file :meth:`save_checkpoint` wrote.
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
        from opake_fx.serialization.runs import load_run

        out = load_run(path, self, params=params, state=state, sampler=_shard_sampler(sampler), accountant=accountant,
                       check_ranks=check_ranks, **extra)
        if isinstance(sampler, _Offset):
            out["sampler"] = _Offset(out["sampler"], sampler.start)
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
        return d

    # --- private -----------------------------------------------------------------------

    def _run(self, nm: float, n: int) -> Any:
        """The DpProcess of the first ``n`` steps at noise multiplier ``nm``."""
        if self.sampling == "cyclic_poisson":
            return self._opportunity(nm) * -(-n // self.bands)  # ceil(n / bands) opportunities
        if not self.participation.amplified:
            import opake_fx.dpftrl.accounting as mf_acc

            if n == self.steps:  # the whole run: one Gaussian mechanism over the pattern
                p = self.participation
                return mf_acc.mf_gaussian(nm, self.strategy, p.min_sep, p.max_participations, n_steps=p.steps)
            from opake_fx.accounting import compose, identity

            if nm != self.noise_multiplier:
                raise InputValueError("DPPlan: prefix accounting is for the plan's own noise multiplier.")
            return compose(*self._step_increments[:n]) if n > 0 else identity()  # one call: linear, not quadratic
        return self._step(nm) * n

    def _opportunity(self, nm: float) -> Any:
        import opake_fx.dpftrl.accounting as mf_acc

        # one Poisson-subsampled Gaussian per opportunity; the run is ceil(steps / bands) of them; the
        # noise is scaled to the sensitivity under the plan's participation, which the accounting reads too
        p = self.participation
        sens = self.strategy.sensitivity(p.min_sep, p.max_participations, n=p.steps)
        steps = mf_acc.poisson_steps(nm, self.strategy, self.group_rate, partitions=self.bands, noise_sensitivity=sens)
        return steps[0]

    @functools.cached_property
    def _step_increments(self) -> list[Any]:
        """Per-step costs of a pattern-accounted (b-min-sep / balls-in-bins) plan, built once."""
        import opake_fx.dpftrl.accounting as mf_acc

        p = self.participation
        return mf_acc.mf_gaussian_steps(self.noise_multiplier, self.strategy, p.min_sep, p.max_participations,
                                        n_steps=p.steps)

    def _resolve_min_sep(self, n: int) -> int | None:
        if self.sampling in ("b_min_sep", "balls_in_bins"):
            if self.min_sep is None:
                raise InputValueError(
                    f"DPPlan(sampling={self.sampling!r}) needs min_sep: the fewest steps between two participations "
                    "of one example (for balls_in_bins: the number of bins, dataset_size / batch_size)."
                )
            return check.integer(self.min_sep, "min_sep", "DPPlan", minimum=1)
        if self.min_sep is not None:
            raise InputValueError(
                f"DPPlan: min_sep applies to sampling='b_min_sep' or 'balls_in_bins' only; sampling={self.sampling!r}."
            )
        return None

    def _check_min_sep(self, n: int, b: float, steps: int, min_sep: int) -> None:
        if self.sampling == "balls_in_bins":
            if min_sep > steps:
                raise InputValueError(
                    f"DPPlan: min_sep={min_sep} bins exceed steps={steps}: the examples of the unused bins would never "
                    "be seen. Use at most `steps` bins."
                )
            if not math.isclose(b, n / min_sep, rel_tol=1e-9):
                raise InputValueError(
                    f"DPPlan: balls_in_bins with min_sep={min_sep} bins has expected batch size dataset_size / min_sep "
                    f"= {n / min_sep}, not batch_size={b}; leave batch_size out (it is derived) or change min_sep."
                )
        elif b * min_sep > n:
            raise InputValueError(
                f"DPPlan: batch_size * min_sep = {b * min_sep} exceeds dataset_size={n}: with each example resting "
                f"min_sep - 1 = {min_sep - 1} steps after it joins, the expected batch cannot reach {b}. Use a smaller "
                "min_sep or batch."
            )

    def _check_clipping_mode(self, c: float | PerGroup) -> None:
        mode = self.clipping_mode
        if mode != "fixed" and isinstance(c, PerGroup):
            raise InputValueError(
                f"DPPlan: clipping_mode={mode!r} takes one clipping_norm, not per-group norms ("
                + ("AUTO-S scales every gradient to one norm" if mode == "auto" else
                   "adaptive clipping tracks one norm") + "). Use clipping_mode='fixed' for per-group clipping, or one "
                "float clipping_norm."
            )
        if mode != "adaptive":
            return
        if self.mechanism != "gaussian":
            raise InputValueError(
                f"DPPlan: clipping_mode='adaptive' needs mechanism='gaussian'; with mechanism={self.mechanism!r} the "
                "correlated DP-FTRL noise is scaled to one fixed sensitivity for the whole run, and the plan has no "
                "accounting for a noised count released next to it. Use clipping_mode='fixed' or 'auto' with DP-FTRL, "
                "or mechanism='gaussian' with adaptive clipping."
            )
        if self.clipping_kwargs["count_noise_multiplier"] == 0 and not (
            self.target_epsilon is None and self.noise_multiplier is not None and self.noise_multiplier == 0
        ):
            raise InputValueError(
                "DPPlan: clipping_mode='adaptive' with clipping_kwargs['count_noise_multiplier']=0 releases the exact "
                "clipped count, which is not private. Give count_noise_multiplier > 0 (Andrew et al. suggest "
                "batch_size / 20, the default), or noise_multiplier=0 for a non-private baseline."
            )

    def _step(self, nm: float) -> Any:
        import opake_fx.dpsgd.accounting as dpsgd_acc

        if self.clipping_mode == "adaptive":  # the gradient and the noised clipped count: one Gaussian (Andrew et al.)
            g = dpsgd_acc.adaptive_clipping_gaussian(nm, self.clipping_kwargs["count_noise_multiplier"])
        else:
            g = dpsgd_acc.gaussian(nm)
        if self.sampling == "truncated_poisson":
            return dpsgd_acc.truncated_poisson(g, self.sample_rate, self.dataset_size, self.max_batch_size)
        return dpsgd_acc.poisson(g, self.sample_rate)

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
        budget = acc.epsilon_budget(eps * (1.0 - _RUNNING_SLACK), delta, accountant=self.accountant_kind)
        if self.clipping_mode == "adaptive":
            # However much gradient noise, the count alone costs a Gaussian of multiplier 2 * count_noise_multiplier.
            sb = self.clipping_kwargs["count_noise_multiplier"]
            count_only = dataclasses.replace(self, clipping_mode="fixed", clipping_kwargs=None,
                                             noise_multiplier=2.0 * sb, target_epsilon=None)
            if not budget.is_met_by(count_only._run(2.0 * sb, self.steps)):
                raise InputValueError(
                    f"DPPlan: clipping_kwargs['count_noise_multiplier']={sb:g} is too small for target_epsilon={eps} "
                    f"at delta={delta}: the noised clipped count alone spends more than the budget over {self.steps} "
                    "steps, whatever the gradient noise. Give a larger count_noise_multiplier (Andrew et al. suggest "
                    "batch_size / 20) or a larger target_epsilon."
                )
        if nm is not None:  # e.g. rebuilt from to_dict(): check instead of recalibrating
            if nm == 0 or not budget.is_met_by(self._run(nm, self.steps)):
                raise InputValueError(
                    f"DPPlan: noise_multiplier={nm} does not meet target_epsilon={eps} at delta={delta} over "
                    f"{self.steps} steps at sample rate {self.sample_rate}. Leave noise_multiplier out to calibrate it."
                )
            return nm
        return float(acc.calibrate(budget, lambda s: self._run(s, self.steps)).param)


# Relative room between the one-shot composition of a whole run and the accountant's running
# composition of its steps (measured within 1e-5: tests/accounting/test_incremental.py).
_RUNNING_SLACK = 1e-4


def regex_norms(norms: Any, where: str, hint: str = "") -> tuple[dict[str, re.Pattern[str]], dict[str, float]]:
    """Validates per-group clip norms given as ``{regex: C_g, ..., "fallback": C}``.

    Returns the compiled regexes (``"fallback"`` excluded) and the norms, in the dict's
    order. The one check of this form, for :func:`per_group_by_regex` and the trainer's
    ``TrainingArguments(clipping_norm={...})``.

    Raises:
        InputTypeError: ``norms`` is not a dict, or a key is not a string.
        InputValueError: an empty dict, a norm that is not finite and > 0 (``hint`` is
            appended), a key that is not a valid regular expression.

    Example:
        >>> rx, values = regex_norms({"attn": 1.0, "fallback": 2.0}, "example")
        >>> list(rx), values
        (['attn'], {'attn': 1.0, 'fallback': 2.0})
    """
    if not isinstance(norms, Mapping):
        raise InputTypeError(f"{where}: per-group norms must be a dict of regex -> norm (with 'fallback'); got "
                             f"{type(norms).__name__}.")
    if not norms:
        raise InputValueError(f"{where}: clipping_norm={{}} has no group; give {{regex: norm, ..., 'fallback': norm}} or one float.")
    compiled: dict[str, re.Pattern[str]] = {}
    values: dict[str, float] = {}
    for pattern, norm in norms.items():
        if not isinstance(pattern, str):
            raise InputTypeError(f"{where}: clipping_norm's keys are parameter-name regexes (strings); got {pattern!r}.")
        values[pattern] = check.positive(norm, f"clipping_norm[{pattern!r}]", where, hint)
        if pattern != "fallback":
            try:
                compiled[pattern] = re.compile(pattern)
            except re.error as err:
                raise InputValueError(f"{where}: clipping_norm key {pattern!r} is not a valid regular expression ({err}).") from None
    return compiled, values


def per_group_by_regex(params: Any, names: Sequence[str], norms: Mapping[str, float]) -> PerGroup:
    """Per-group clip norms from parameter-name regexes: ``{regex: C_g, ..., "fallback": C}``.

    Each parameter (leaf ``i`` of ``params``, named ``names[i]``, e.g. ``fmodel.param_names``
    of :func:`~opake_fx.functional.make_functional`) goes to the FIRST regex, in the
    dict's order, that ``re.search``-es its name, else to ``"fallback"``. The groups are
    named by their regex (and ``"fallback"``); the result is the
    :class:`~opake_fx.types.PerGroup` of :func:`opake_fx.dpsgd.clipping.per_group`.

    Args:
        params: the parameter pytree the clip stage is given (its leaves in ``names`` order).
        names: one name per leaf.
        norms: regex -> clip norm (finite, > 0), and optionally ``"fallback"`` -> norm.

    Raises:
        InputValueError: an invalid regex or norm; a regex that takes no parameter (it
            matches none, or only parameters an earlier regex took); a parameter that no
            regex matches when there is no ``"fallback"``.

    Privacy: none by itself; a plan clipping to these groups has total sensitivity
    ``sqrt(sum_g C_g**2)`` over the groups that have parameters (an unused ``"fallback"``
    does not count).

    Example:
        >>> import torch
        >>> pg = per_group_by_regex((torch.ones(2), torch.ones(1)), ["attn.weight", "head.bias"],
        ...                         {"attn": 3.0, "fallback": 4.0})
        >>> pg.for_path((0,)), pg.for_path((1,)), pg.effective
        (3.0, 4.0, 5.0)
    """
    from opake_fx.dpsgd.clipping import per_group

    where = "clipping_norm"
    compiled, values = regex_norms(norms, "per-group clipping", "Each group's clip norm is a finite number > 0.")
    names = [str(n) for n in names]
    owner: dict[str, str] = {}
    for name in names:
        hit = next((p for p, rx in compiled.items() if rx.search(name)), None)
        if hit is None and "fallback" in values:
            hit = "fallback"
        if hit is not None:
            owner[name] = hit
    unmatched = [n for n in names if n not in owner]
    if unmatched:
        raise InputValueError(
            f"{where}: trainable parameter(s) {unmatched[:5]}{' ...' if len(unmatched) > 5 else ''} match no regex "
            f"of {sorted(compiled)} and there is no 'fallback' entry. Add \"fallback\": <norm>, or a regex that "
            "matches them."
        )
    taken = set(owner.values())
    for pattern, rx in compiled.items():
        if pattern in taken:
            continue
        matched = [n for n in names if rx.search(n)]
        why = (f"matches no trainable parameter (they are {names[:6]}{' ...' if len(names) > 6 else ''})"
               if not matched else f"matches only parameters an earlier regex took ({matched[:3]})")
        raise InputValueError(
            f"{where}: the regex {pattern!r} {why}. Fix or remove it (regexes are re.search-ed against the trainable "
            "parameter names, first match in the dict's order wins)."
        )
    group_of = {p: (p if p not in ("params", "names") else f"re:{p}") for p in values}  # per_group's own keywords
    groups = {group_of[p]: (values[p], (lambda q: lambda name, leaf: owner.get(name) == q)(p))
              for p in values if p in taken}
    return per_group(params, names=names, **groups)


def _clipping_norm(c: Any) -> float | PerGroup:
    """The plan's clipping_norm: a finite float > 0, or a PerGroup (also from its ``to_dict`` data)."""
    if isinstance(c, Mapping):
        if set(c) != {"groups", "values"}:
            raise InputValueError(
                "DPPlan: clipping_norm as a dict must be the plain data of per-group norms, {'groups': [[path, "
                f"group], ...], 'values': {{group: norm}}}} (what to_dict writes); got keys {sorted(map(str, c))}. For "
                "parameter-name regex -> norm, build the PerGroup with opake_fx.plan.per_group_by_regex(params, "
                "names, norms) (DPTrainer does it from TrainingArguments.clipping_norm)."
            )
        try:
            c = PerGroup({tuple(path): group for path, group in c["groups"]}, dict(c["values"]))
        except (TypeError, ValueError) as err:
            raise InputValueError(f"DPPlan: clipping_norm's per-group data is malformed ({err}).") from None
    if isinstance(c, PerGroup):
        if not c.groups:
            raise InputValueError("DPPlan: a per-group clipping_norm must assign at least one parameter leaf.")
        bad = {g: v for g, v in c.values.items() if not (v > 0 and math.isfinite(v))}
        if bad:
            raise InputValueError(f"DPPlan: per-group clip norms must be finite and > 0; got {bad}.")
        return c
    v = check.real(c, "clipping_norm", "DPPlan", "the per-example clip norm, e.g. 1.0, or a PerGroup")
    if not (v > 0 and math.isfinite(v)):
        raise InputValueError(f"DPPlan: clipping_norm must be finite and > 0; got {v}.")
    return v


def check_clipping_kwargs(mode: str, given: Any, where: str) -> Mapping[str, Any]:
    """``clipping_kwargs`` for ``mode`` (``None`` is ``{}``): a dict whose keys the mode takes
    (:data:`CLIPPING_KWARGS`); the values are checked where the plan fills in the defaults.

    Raises:
        InputTypeError: not a dict.
        InputValueError: a key ``mode`` does not take.

    Example:
        >>> check_clipping_kwargs("auto", {"gamma": 0.1}, "example")
        {'gamma': 0.1}
    """
    given = {} if given is None else given
    if not isinstance(given, Mapping):
        raise InputTypeError(f"{where}: clipping_kwargs must be a dict (or None); got {type(given).__name__}.")
    allowed = CLIPPING_KWARGS[mode]
    unknown = sorted(str(k) for k in set(given) - set(allowed))
    if unknown:
        takes = sorted(allowed) if allowed else "none"
        raise InputValueError(f"{where}: clipping_kwargs {unknown} do not apply to clipping_mode={mode!r}, which takes {takes}.")
    return given


def _clipping_kwargs(mode: str, given: Any, batch_size: float) -> dict[str, float]:
    """The clipping mode's options, checked and filled in with their defaults (sorted by name)."""
    given = check_clipping_kwargs(mode, given, "DPPlan")
    out = {**CLIPPING_KWARGS[mode], **given}
    where = f"DPPlan(clipping_mode={mode!r})"
    if mode == "auto":
        out["gamma"] = check.non_negative(out["gamma"], "clipping_kwargs['gamma']", where,
                                          "AUTO-S's stability constant (Bu et al. use 0.01).")
    elif mode == "adaptive":
        if out["count_noise_multiplier"] is None:
            out["count_noise_multiplier"] = batch_size / 20.0
        out["target_quantile"] = check.interval(out["target_quantile"], "clipping_kwargs['target_quantile']", where,
                                                0.0, 1.0, low_open=True, high_open=True,
                                                hint="A fraction, e.g. 0.5 for the median gradient norm.")
        out["learning_rate"] = check.positive(out["learning_rate"], "clipping_kwargs['learning_rate']", where,
                                              "The step of the geometric norm update; Andrew et al. use 0.2.")
        out["count_noise_multiplier"] = check.non_negative(
            out["count_noise_multiplier"], "clipping_kwargs['count_noise_multiplier']", where,
            "The std of the clipped count's noise, in counts (default batch_size / 20).")
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class RecordedLossState:
    """The state of a clip stage built by ``DPPlan.pipeline(..., record_loss=True)``.

    Attributes:
        clip_state: the clipping function's own state (``FixedClipState``,
            ``AdaptiveClipState``), as the plain stage keeps it.
        loss_sum: 0-d float64 tensor, the sum of the last step's per-example losses over
            its real examples (padding rows of a compiled step left out), from the forward
            pass the clipping itself ran: at the parameters the step was computed at.
        loss_count: 0-d float64 tensor, the number of those examples (0 for an empty batch).

    **Not private**: a training loss of the batch's examples, on this rank only (sum the
    pairs over ranks for the global mean). Read on the host (``float``) only when logging:
    the step itself never reads it.
    """

    clip_state: Any
    loss_sum: Any
    loss_count: Any


def _loss_recording(factory: Callable[..., Any], loss_fn: Callable[..., Any], clip_args: dict[str, Any],
                    count_key: RngKey | None) -> Any:
    """The clip stage of ``factory`` whose state also records the step's per-example losses.

    The clipping function is built with ``has_aux=True`` and a loss returning its own values
    (detached) as the per-example aux, which the clipping concatenates over microbatches
    without reading anything on the host; the stage strips the aux from its output.
    """
    import optree
    import torch

    from opake_fx.dpsgd.clipping import (adaptive_clip, adaptive_clipped_grad, as_stage, auto_clip, auto_clipped_grad,
                                         clip, clipped_grad)
    from opake_fx.pytree import NAMESPACE
    from opake_fx.transforms import Transform

    makers = {clip: clipped_grad, adaptive_clip: adaptive_clipped_grad, auto_clip: auto_clipped_grad}
    inner_factory = factory.func if isinstance(factory, functools.partial) else factory
    maker = makers[inner_factory]  # (a stage kind without a recording form is a KeyError, never another mode)
    if inner_factory is adaptive_clip:
        maker = functools.partial(maker, key=count_key)
    # the privacy statement of the stage this one stands for (built, not run: it draws nothing)
    privacy = factory(loss_fn, **clip_args).privacy

    def with_values(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        losses = loss_fn(*args, **kwargs)
        return losses, losses.detach()

    grad_fn, clip_state = maker(with_values, argnums=0, has_aux=True, **clip_args)

    def recording(params: Any, *batch: Any, state: RecordedLossState, example_mask: Any = None) -> tuple[Any, Any]:
        masked = {} if example_mask is None else {"example_mask": example_mask}
        (out, values), inner = grad_fn(params, *batch, state=state.clip_state, **masked)
        if values is None:  # an empty batch
            total, count = torch.zeros_like(state.loss_sum), torch.zeros_like(state.loss_count)
        else:
            values = values.detach().to(torch.float64)
            if example_mask is None:
                total, count = values.sum(), torch.tensor(float(values.shape[0]), dtype=torch.float64, device=values.device)
            else:
                real = example_mask.to(values.device)
                total = torch.where(real, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
                count = real.to(torch.float64).sum()
        return out, RecordedLossState(inner, total, count)

    stage = as_stage(recording, None, batch_argnums=clip_args["batch_argnums"], privacy=privacy)

    def init(params: Any) -> RecordedLossState:
        leaves = optree.tree_leaves(params, namespace=NAMESPACE) if params is not None else []
        device = leaves[0].device if leaves and isinstance(leaves[0], torch.Tensor) else None
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return RecordedLossState(clip_state, zero, zero.clone())

    return Transform(init, stage.update, stage.privacy)


def _synced_counts(stage: Any) -> Any:
    """An adaptive clip stage that ``sync``-s its state after each step (the count summed over ranks).

    In one process ``sync`` is the identity. The state may be wrapped (``augmult``'s
    ``AugmultState``, ``ClipStageState``): the adaptive state inside is synced.
    """
    from opake_fx.distributed import sync
    from opake_fx.transforms import Transform

    def synced(state: Any) -> Any:
        inner = getattr(state, "clip_state", None)
        if inner is not None and dataclasses.is_dataclass(state):
            return dataclasses.replace(state, clip_state=synced(inner))
        return sync(state)

    def update(x: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        out, new_state = stage.update(x, state, params, **extra)
        return out, synced(new_state)

    return Transform(stage.init, update, stage.privacy)


class _Offset:
    """A batch sampler over a shard ``range(start, stop)``, yielding indices of the whole dataset."""

    def __init__(self, inner: Any, start: int) -> None:
        self.inner, self.start = inner, start

    def __iter__(self) -> Any:
        for batch in self.inner:
            yield [self.start + i for i in batch]

    def __len__(self) -> int:
        return len(self.inner)

    def batch(self, step: int) -> list[int]:
        """Step ``step``'s batch, as indices of the whole dataset."""
        return [self.start + i for i in self.inner.batch(step)]

    def __getattr__(self, name: str) -> Any:  # state_dict, key, n_steps, ... of the shard's sampler
        return getattr(self.inner, name)


def _shard_sampler(sampler: Any) -> Any:
    """The shard's own sampler of one :meth:`DPPlan.sampler` (which offsets it on ranks > 0)."""
    return sampler.inner if isinstance(sampler, _Offset) else sampler


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
    return "; ".join(f"{m}: {', '.join(s)}" for m, s in COMPATIBLE.items())

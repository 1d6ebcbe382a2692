"""The Gaussian mechanism for clipped gradients: :func:`gaussian_noise` and the ``noise`` stage.

Step ``t`` draws its noise from ``fold_in(key, t)``: the same key on every rank gives
bit-identical noise after the all-reduce, and a checkpointed state resumes the exact
noise sequence. The global torch RNG is never touched.

The mechanism draws from the library's one Gaussian home, :mod:`opake_fx._gaussian`
(the keyed draw and add, prefetched, exact or secure, and the joint split of a
second-moment pair), after the checks of :mod:`opake_fx._noise_input`; DP-FTRL's
:func:`~opake_fx.dpftrl.noise.mf_gaussian_noise` draws from the same home, so with the
identity strategy its output is bit-identical to :func:`gaussian_noise` with the same key.
:func:`add_gaussian_noise`, :func:`second_moment_stddevs`, :func:`joint_noise_multiplier`,
:func:`squared_stream_key` and :data:`DEFAULT_SECOND_MOMENT_SHARE` are re-exported here
from that home.

The private second moment: given a :class:`~opake_fx.types.SecondMomentClippingOutput`
(``clipped_grad(..., second_moment=True)``), the noise stage releases both streams as ONE
Gaussian mechanism with noise multiplier ``noise_multiplier`` (the split is explained in
:mod:`opake_fx._gaussian`): the pair costs what the gradient alone costs (account for it
with ``gaussian(z)``), and the gradient stream pays for the squares with
``1 / sqrt(1 - a)`` times more noise (``a = 1/3`` by default: ``sqrt(3/2)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any

from opake_fx._noise_input import (
    check_noise_call,
    check_noise_multiplier,
    check_noise_state,
    check_pair_step,
    check_second_moment_share,
    row_shards,
)
from opake_fx._noise_prefetch import NoisePrefetcher
from opake_fx.distributed.state_sync import register_sync_type
from opake_fx.distributed.builtin_sync import sync_gaussian_noise_state
from opake_fx.distributed.agreement import AgreementCheck
from opake_fx._gaussian import (
    DEFAULT_SECOND_MOMENT_SHARE,
    add_gaussian_noise,
    joint_noise_multiplier,
    noised_tree,
    second_moment_stddevs,
    squared_stream_key,
)
from opake_fx.typing import typechecked
from opake_fx.errors import InputValueError
from opake_fx.random import RngKey
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.signatures import signature_of
from opake_fx.transforms import Transform
from opake_fx.types import (ClippedPytree, NoisedPytree, PerGroup, SecondMomentClippingOutput,
                            SecondMomentNoiseOutput)

__all__ = [
    "GaussianNoiseState",
    "gaussian_noise",
    "noise",
    "noise_stddev_for",
    "add_gaussian_noise",
    "second_moment_stddevs",
    "joint_noise_multiplier",
    "squared_stream_key",
    "DEFAULT_SECOND_MOMENT_SHARE",
]

# The per-group allocations. Hinted ``str`` rather than a Literal, so that another string is
# reported as a wrong value (InputValueError naming the options), as elsewhere in the library.
_ALLOCATIONS = ("optimal", "isotropic")
_AGREEMENT_FIX = (
    "Build the noise stage with the same key and noise_multiplier on every rank, resume every rank from the "
    "same checkpoint (the same step), and clip with the same clipping_norm and normalize_by: otherwise some rank "
    "adds different or less noise than the accountant assumes."
)


@dataclass(frozen=True)
class GaussianNoiseState:
    """State of :func:`gaussian_noise`: the key and the number of steps taken.

    Both must be identical on every rank (``opake_fx.distributed.sync`` checks it).
    Step ``t`` draws from ``fold_in(key, t)``, a distinct key for every ``t`` in
    ``[0, 2**64)``; a negative step is refused (it would alias another step's noise).

    Example:
        >>> from opake_fx.random import key
        >>> GaussianNoiseState(key(0), step=-1)
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputValueError: GaussianNoiseState.step must be in [0, 2**64); got -1. Step t draws its noise from fold_in(key, t): a negative step would reuse another step's noise. Resume from the state the noise stage returned.
    """

    key: RngKey
    step: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "step", check_noise_state(self.key, self.step, "GaussianNoiseState"))


register_sync_type(GaussianNoiseState, sync_gaussian_noise_state)  # the state's own sync (checks key and step)


@typechecked
def gaussian_noise(
    *,
    noise_multiplier: float,
    key: RngKey,
    allocation: str = "optimal",
    exact: bool = False,
    secure: bool = False,
    second_moment_share: float = DEFAULT_SECOND_MOMENT_SHARE,
    prefetch: bool | None = None,
) -> tuple[Callable[[Any, GaussianNoiseState], tuple[Any, GaussianNoiseState]], GaussianNoiseState]:
    """Makes the Gaussian mechanism for :class:`~opake_fx.types.ClippedPytree` inputs.

    ``noise_fn(clipped, state)`` adds ``N(0, std^2)`` to every coordinate with
    ``std = noise_multiplier * clipped.max_norm`` and returns a
    :class:`~opake_fx.types.NoisedPytree` (``noise_stddev = std``). For a per-group
    ``max_norm`` (clip norms ``C_g``) the stddev is allocated per group:
    ``"optimal"`` gives group g ``noise_multiplier * sqrt(C_g * sum_j C_j)`` (the
    MSE-optimal split at the same privacy), ``"isotropic"`` gives every coordinate
    ``noise_multiplier * sqrt(sum_j C_j**2)``.

    Args:
        noise_multiplier: sigma, the noise stddev in units of the sensitivity (>= 0;
            0 adds nothing).
        key: the noise key; pass the SAME key on every rank under DDP.
        allocation: per-group stddev allocation (ignored for a scalar ``max_norm``).
        exact: draw JAX-identical Threefry normals (slow; for tests).
        secure: draw from the OS's cryptographically strong source with a sampler whose
            low-order bits do not reveal the unnoised value (see
            :mod:`opake_fx.secure_random`): for releases an attacker may see bit for bit.
            Not reproducible: ``key`` then only counts steps, and under DDP rank 0's
            draw is broadcast. Slower (``benchmarks/secure_noise.py``).
        second_moment_share: for a :class:`~opake_fx.types.SecondMomentClippingOutput`
            input, the share ``a`` in ``(0, 1)`` of the budget given to the squared
            stream (see the module docstring); the output is then a
            :class:`~opake_fx.types.SecondMomentNoiseOutput`.
        prefetch: draw step ``t + 1``'s noise while the caller computes step ``t + 1``'s
            gradient (a background thread on the CPU, a side stream on CUDA): the same
            numbers as the draw in place, at most one step ahead. ``None`` (default) does
            so for CPU draws of at least 2**18 values on 2+ cores, where it measurably
            helps; ``True`` always (CUDA included), ``False`` never. Not with ``exact``
            or ``secure``, nor for a second-moment pair (drawn in place).

    Privacy:
        Each call is the Gaussian mechanism with noise multiplier ``noise_multiplier``
        on a query of sensitivity ``max_norm``: account for it as
        ``opake_fx.dpsgd.accounting.gaussian(noise_multiplier)`` (inside ``poisson`` for
        Poisson-sampled batches). Both per-group allocations cost exactly that, and so
        does a ``SecondMomentClippingOutput``: its two streams are one Gaussian mechanism
        with noise multiplier ``noise_multiplier`` on the concatenated vector (the joint
        split above); charge it ONCE, never once per stream. Refuses
        anything that is not a ``ClippedPytree`` (unclipped gradients have unbounded
        sensitivity) and a ``NoisedPytree`` (noise is added once, after aggregation).
        A :class:`~opake_fx.types.RowShardedClippedPytree` (this rank's rows of an
        FSDP2-sharded gradient) gets exactly its rows of the unsharded noise, so the ranks'
        shards together are the unsharded release, bit for bit.
        Under a process group every call checks that all ranks hold the same key, step,
        ``noise_multiplier``, ``max_norm`` and allocation (in full on the first call, then
        by one all-reduce of a digest) and raises ``DistributedMismatchError`` on every
        rank otherwise, before any noise is drawn.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> from opake_fx.types import SecondMomentClippingOutput
        >>> noise_fn, s = gaussian_noise(noise_multiplier=1.0, key=key(42))
        >>> pair = SecondMomentClippingOutput(ClippedPytree((torch.zeros(3),), max_norm=0.5),
        ...                                   ClippedPytree((torch.zeros(3),), max_norm=0.25))
        >>> out, _ = noise_fn(pair, s)
        >>> round(out.noisy_grads.noise_stddev, 4), round(out.noisy_squared_grads.noise_stddev, 4)
        (0.6124, 0.433)
        >>> out, s = noise_fn(ClippedPytree((torch.zeros(3),), max_norm=0.5), s)
        >>> out.noise_stddev, s.step
        (0.5, 1)
    """
    check_noise_multiplier(noise_multiplier)
    _check_allocation(allocation)
    if secure and exact:
        raise InputValueError("gaussian_noise: secure=True draws unpredictable noise; it cannot go with exact=True (keyed replay).")
    share = check_second_moment_share(second_moment_share)
    if prefetch and (secure or exact):
        raise InputValueError("gaussian_noise: prefetch=True draws keyed noise ahead; it cannot go with exact=True or secure=True.")
    prefetcher = NoisePrefetcher(prefetch) if not (secure or exact) else None
    ranks_agree = AgreementCheck("gaussian_noise", fix=_AGREEMENT_FIX)

    def noise_fn(clipped: Any, state: GaussianNoiseState) -> tuple[Any, GaussianNoiseState]:
        # an FSDP2 rank's rows: it draws its rows of the one unsharded noise
        clipped, rows = row_shards(clipped, mechanism="gaussian_noise", keyed=not (exact or secure))
        pair = check_noise_call(clipped, state, GaussianNoiseState, noise_multiplier, mechanism="gaussian_noise")
        facts = [
            ("key", state.key),
            ("step", state.step),
            ("noise_multiplier", float(noise_multiplier)),
            ("max_norm", clipped.grads.max_norm if pair else clipped.max_norm),
            ("allocation", _ALLOCATIONS.index(allocation)),
        ]
        if pair:
            facts += [("squared_max_norm", clipped.squared_grads.max_norm), ("second_moment_share", share)]
        ranks_agree(facts)
        new_state = (GaussianNoiseState(state.key, state.step + 1) if type(state) is GaussianNoiseState
                     else replace(state, step=state.step + 1))  # (the constructor: dataclasses.replace is slow)
        if pair:
            check_pair_step(state.step)
            first, second = clipped.grads, clipped.squared_grads
            std1, std2 = second_moment_stddevs(noise_multiplier, first.sensitivity, second.sensitivity, share)
            out1 = NoisedPytree(
                noised_tree(first.pytree, state.key, state.step, std1, exact=exact, secure=secure),
                first.max_norm,
                noise_stddev=std1,
            )
            out2 = NoisedPytree(
                noised_tree(second.pytree, squared_stream_key(state.key), state.step, std2, exact=exact, secure=secure),
                second.max_norm,
                noise_stddev=std2,
            )
            return SecondMomentNoiseOutput(out1, out2), new_state
        std = noise_stddev_for(clipped.max_norm, noise_multiplier, allocation)
        if rows is not None:
            noised = noised_tree(clipped.pytree, state.key, state.step, std, rows=rows)
            return NoisedPytree(noised, clipped.max_norm, noise_stddev=std), new_state
        noised = noised_tree(clipped.pytree, state.key, state.step, std, exact=exact, secure=secure, prefetcher=prefetcher)
        return NoisedPytree(noised, clipped.max_norm, noise_stddev=std), new_state

    return noise_fn, GaussianNoiseState(key=key)


@signature_of(gaussian_noise, drop=("exact",))
def noise(**arguments: Any) -> Transform:
    """:func:`gaussian_noise` as a chain stage (``ClippedPytree`` in, ``NoisedPytree`` out).

    Takes :func:`gaussian_noise`'s keywords but ``exact`` (its signature is derived from
    the function's, so the two cannot drift apart).

    After a clip stage with ``second_moment=True``: ``SecondMomentClippingOutput`` in,
    ``SecondMomentNoiseOutput`` out, both streams noised under one budget (the share
    ``second_moment_share`` for the squares).

    Privacy: as :func:`gaussian_noise` (``secure=True`` and ``prefetch`` as there); the
    paired release costs ``gaussian(noise_multiplier)``, charged once.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> stage = noise(noise_multiplier=1.0, key=key(0))
        >>> out, state = stage.update(ClippedPytree((torch.zeros(2),), max_norm=0.5), stage.init(None))
        >>> out.noise_stddev, state.step
        (0.5, 1)
    """
    noise_fn, state0 = gaussian_noise(**arguments)
    noise_multiplier = arguments["noise_multiplier"]

    def update(x: Any, state: GaussianNoiseState, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return noise_fn(x, state)

    described = StagePrivacy(
        "noise", f"gaussian, noise_multiplier={noise_multiplier:g}", noise_multiplier=float(noise_multiplier),
        mechanism="gaussian",
    )
    return Transform(lambda params: state0, update, described)


@typechecked
def noise_stddev_for(max_norm: float | PerGroup, noise_multiplier: float, allocation: str = "optimal") -> float | PerGroup:
    """The stddev the Gaussian mechanism adds for a given ``max_norm``.

    Scalar: ``noise_multiplier * max_norm``. Per group with norms ``C_g``: optimal
    ``noise_multiplier * sqrt(C_g * sum_j C_j)`` per group, isotropic
    ``noise_multiplier * sqrt(sum_j C_j**2)``. Both satisfy
    ``sum_g C_g**2 / std_g**2 = noise_multiplier**-2``, i.e. the privacy of
    ``gaussian(noise_multiplier)``.
    """
    _check_allocation(allocation)
    if isinstance(max_norm, PerGroup):
        if allocation == "isotropic" or noise_multiplier == 0.0:
            return noise_multiplier * max_norm.effective
        total = sum(max_norm.values.values())
        return max_norm.map(lambda c: noise_multiplier * math.sqrt(c * total))
    if noise_multiplier == 0.0:
        return 0.0
    return noise_multiplier * float(max_norm)


def _check_allocation(allocation: str) -> None:
    if allocation not in _ALLOCATIONS:
        raise InputValueError(f"allocation must be 'optimal' or 'isotropic'; got {allocation!r}.")

"""The Gaussian mechanism for clipped gradients: :func:`gaussian_noise` and the ``noise`` stage.

Step ``t`` draws its noise from ``fold_in(key, t)``: the same key on every rank gives
bit-identical noise after the all-reduce, and a checkpointed state resumes the exact
noise sequence. The global torch RNG is never touched.

This module holds the library's one Gaussian mechanism: :func:`add_gaussian_noise`
(one release: ``leaves + std * z`` from a key) and :func:`second_moment_stddevs` (the
joint split of one budget over a gradient and its squared-gradient stream). DP-FTRL's
:func:`~opake_fx.dpftrl.noise.mf_gaussian_noise` is the same mechanism with correlated
draws; with the identity strategy it calls :func:`add_gaussian_noise` itself, so its
output is bit-identical to :func:`gaussian_noise` with the same key.

The private second moment: given a
:class:`~opake_fx.types.SecondMomentClippingOutput` (``clipped_grad(...,
second_moment=True)``), the noise stage releases both streams as ONE Gaussian mechanism.
Stream ``k`` has sensitivity ``D_k`` (``C / n`` and ``C**2 / n``) and gets stddev
``s_k``; stacking the whitened streams ``(x_1 / s_1, x_2 / s_2)`` gives a vector with
identity-covariance noise and L2 sensitivity ``sqrt((D_1 / s_1)**2 + (D_2 / s_2)**2)``
(one example changes both streams at once), i.e. a Gaussian mechanism with noise
multiplier ``z_joint = ((D_1 / s_1)**2 + (D_2 / s_2)**2) ** -0.5``. Giving the squared
stream the share ``a`` of the budget, ``s_1 = z D_1 / sqrt(1 - a)`` and
``s_2 = z D_2 / sqrt(a)``, makes ``z_joint = z`` exactly: the pair costs what the
gradient alone costs at ``noise_multiplier=z`` (account for it with ``gaussian(z)``),
and the gradient stream pays for the squares with ``1 / sqrt(1 - a)`` times more noise
(``a = 1/3``, the default, is the ``sqrt(3/2)`` overhead of Kalinin, Upadhyay and
Lampert, "Continual Release Moment Estimation with Differential Privacy", 2025).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any

import optree
import torch

from opake_fx._noise_input import MAX_STEPS, check_clipped_input, check_noise_multiplier, check_noise_state
from opake_fx._noise_prefetch import NoisePrefetcher
from opake_fx.distributed.agreement import AgreementCheck
from opake_fx.typing import typechecked
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths
from opake_fx.random import RngKey, flat_tree_normal, fold_in, tree_normal
from opake_fx.secure_random import add_secure_gaussian
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.transforms import Transform
from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup, SecondMomentClippingOutput, SecondMomentNoiseOutput

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

DEFAULT_SECOND_MOMENT_SHARE = 1.0 / 3.0
"""The share of the budget the squared-gradient stream gets by default (first-stream overhead ``sqrt(3/2)``)."""

_SQUARED_STREAM = 2**64 - 1  # fold_in(key, this) roots the squared stream's keys; no step may reach it

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
        pair = isinstance(clipped, SecondMomentClippingOutput)
        if pair:
            check_pair_input(clipped, noise_multiplier, mechanism="gaussian_noise")
        else:
            check_clipped_input(clipped, noise_multiplier, mechanism="gaussian_noise")
        if not isinstance(state, GaussianNoiseState):
            raise InputTypeError(
                f"noise_fn needs the GaussianNoiseState it returned; got {type(state).__name__}."
            )
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
            out1 = NoisedPytree(_noised(first.pytree, state.key, state.step, std1, exact, secure), first.max_norm, noise_stddev=std1)
            out2 = NoisedPytree(
                _noised(second.pytree, squared_stream_key(state.key), state.step, std2, exact, secure),
                second.max_norm,
                noise_stddev=std2,
            )
            return SecondMomentNoiseOutput(out1, out2), new_state
        std = noise_stddev_for(clipped.max_norm, noise_multiplier, allocation)
        noised = _noised(clipped.pytree, state.key, state.step, std, exact, secure, prefetcher)
        return NoisedPytree(noised, clipped.max_norm, noise_stddev=std), new_state

    return noise_fn, GaussianNoiseState(key=key)


def add_gaussian_noise(
    leaves: list[torch.Tensor],
    step_key: RngKey,
    std: float | list[float],
    *,
    exact: bool = False,
    secure: bool = False,
    draw: Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]] = flat_tree_normal,
) -> list[torch.Tensor]:
    """One release of the Gaussian mechanism: ``leaf + std * z`` for every leaf.

    The library's one implementation of the draw and the add, used by
    :func:`gaussian_noise` and by DP-FTRL's identity strategy. ``z`` is drawn from
    ``step_key`` (never from the global RNG): one flat draw per device and dtype scaled
    inside the generator's kernel (``exact=True``: JAX-identical Threefry normals, one
    subkey per leaf; ``secure=True``: the OS's cryptographic source, see
    :mod:`opake_fx.secure_random`). ``std`` is one stddev, or one per leaf. The inputs
    are not modified. ``draw`` makes the fast path's normals (``(step_key, leaves, *,
    stddev)``, as :func:`~opake_fx.random.flat_tree_normal`); the noise stage passes its
    prefetcher's, which returns the same numbers.

    Privacy: adds ``N(0, std**2)`` to every coordinate; the guarantee is that of the
    caller's calibration (``std = noise_multiplier * sensitivity``).

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> out = add_gaussian_noise([torch.zeros(2), torch.ones(3)], key(0), 0.0)
        >>> [t.tolist() for t in out]
        [[0.0, 0.0], [1.0, 1.0, 1.0]]
    """
    per_leaf = isinstance(std, (list, tuple))
    if secure:
        return add_secure_gaussian(leaves, list(std) if per_leaf else [float(std)] * len(leaves))
    if exact:
        draws = tree_normal(step_key, leaves, exact=True)
        return [torch.add(leaf, z, alpha=std[i] if per_leaf else std) for i, (leaf, z) in enumerate(zip(leaves, draws))]
    # One draw per device and dtype, scaled by the generator's kernel, then one fused add
    # per leaf: the outputs are views into the draw buffers (no parameter-sized temporaries).
    noised, _ = draw(step_key, leaves, stddev=1.0 if per_leaf else float(std))
    if per_leaf and noised:
        torch._foreach_mul_(noised, list(std))
    if noised:
        torch._foreach_add_(noised, leaves)
    return noised


def second_moment_stddevs(
    noise_multiplier: float, sensitivity: float, squared_sensitivity: float, share: float = DEFAULT_SECOND_MOMENT_SHARE
) -> tuple[float, float]:
    """The stddevs ``(s_1, s_2)`` of the gradient and squared-gradient streams under one budget.

    ``s_1 = z * D_1 / sqrt(1 - share)`` and ``s_2 = z * D_2 / sqrt(share)``, so that
    ``(D_1 / s_1)**2 + (D_2 / s_2)**2 = z**-2``: the pair is one Gaussian mechanism with
    noise multiplier ``z`` (see the module docstring; :func:`joint_noise_multiplier`).

    Privacy: exactly the cost of ``gaussian(noise_multiplier)``.

    Example:
        >>> s1, s2 = second_moment_stddevs(2.0, 0.5, 0.25, share=0.5)
        >>> round(s1, 6), round(s2, 6), round(joint_noise_multiplier(0.5, s1, 0.25, s2), 12)
        (1.414214, 0.707107, 2.0)
    """
    share = check_second_moment_share(share)
    if noise_multiplier == 0.0:
        return 0.0, 0.0
    return noise_multiplier * sensitivity / math.sqrt(1.0 - share), noise_multiplier * squared_sensitivity / math.sqrt(share)


def joint_noise_multiplier(sensitivity: float, stddev: float, squared_sensitivity: float, squared_stddev: float) -> float:
    """The noise multiplier of two streams released together: ``((D_1/s_1)**2 + (D_2/s_2)**2) ** -0.5``.

    The whitened concatenation ``(x_1 / s_1, x_2 / s_2)`` has unit-variance noise and
    L2 sensitivity ``sqrt((D_1/s_1)**2 + (D_2/s_2)**2)``; its Gaussian-mechanism cost is
    that of ``gaussian(joint_noise_multiplier(...))``. For the per-step stddevs of a
    matrix-factorisation stream, pass the strategy's sensitivity times ``max_norm`` as
    ``D`` and ``noise_multiplier * D`` of the split as ``s``.

    Example:
        >>> round(joint_noise_multiplier(1.0, 3.0, 1.0, 4.0), 6)
        2.4
    """
    if stddev <= 0 or squared_stddev <= 0:
        return 0.0
    return ((sensitivity / stddev) ** 2 + (squared_sensitivity / squared_stddev) ** 2) ** -0.5


def squared_stream_key(key: RngKey) -> RngKey:
    """The root key of the squared-gradient stream: ``fold_in(key, 2**64 - 1)``.

    The gradient stream's step ``t`` draws from ``fold_in(key, t)``; the counter
    ``2**64 - 1`` is reserved for this root (a paired release refuses that step), so the
    two streams never share a key. Step ``t`` of the squared stream draws from
    ``fold_in(squared_stream_key(key), t)``.
    """
    return fold_in(key, _SQUARED_STREAM)


def check_second_moment_share(share: Any) -> float:
    """Validates the squared stream's share of the budget: a real number in ``(0, 1)``."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < float(share) < 1.0:
        raise InputValueError(
            f"second_moment_share must be a number in (0, 1), the share of the budget given to the squared-gradient "
            f"stream; got {share!r}. The default 1/3 costs the gradient stream sqrt(3/2) times more noise."
        )
    return float(share)


def check_pair_input(pair: SecondMomentClippingOutput, noise_multiplier: float, *, mechanism: str) -> None:
    """Both streams must be un-noised, finite-sensitivity ``ClippedPytree`` with a scalar ``max_norm``."""
    for name, stream in (("grads", pair.grads), ("squared_grads", pair.squared_grads)):
        check_clipped_input(stream, noise_multiplier, mechanism=f"{mechanism} ({name} stream)")
        if isinstance(stream.max_norm, PerGroup):
            raise InputValueError(
                f"{mechanism}: the second-moment pair needs a scalar max_norm on both streams; {name} has per-group "
                "norms. Clip with one global clipping_norm for second_moment=True."
            )


def check_pair_step(step: int) -> None:
    """A paired release may not reach the counter that roots the squared stream's keys."""
    if step >= _SQUARED_STREAM:
        raise InputValueError(
            f"step {step} is the counter reserved for the squared-gradient stream's key (2**64 - 1): a paired "
            "release there would reuse a key. Start a new key."
        )


@torch.compiler.disable
def _noised(
    pytree: Any, key: RngKey, step: int, std: float | PerGroup, exact: bool, secure: bool,
    prefetcher: NoisePrefetcher | None = None,
) -> Any:
    """``pytree`` plus the Gaussian noise of step ``step`` under ``key`` (the tree itself for std 0).

    With a ``prefetcher``, the draw is the one it started last step when that matches, and
    step ``step + 1``'s draw is started before returning.
    """
    if not isinstance(std, PerGroup) and std == 0.0:
        return pytree
    if isinstance(std, PerGroup):
        paths, leaves, spec = tree_flatten_with_paths(pytree)
        stds: Any = [std.for_path(p) for p in paths]
    else:
        leaves, spec = optree.tree_flatten(pytree, namespace=NAMESPACE)
        stds = float(std)
    if prefetcher is None:
        return spec.unflatten(add_gaussian_noise(leaves, fold_in(key, step), stds, exact=exact, secure=secure))
    noised = add_gaussian_noise(leaves, fold_in(key, step), stds, draw=prefetcher.draw)
    if step + 1 < MAX_STEPS:
        prefetcher.prefetch_next(key, step + 1)
    return spec.unflatten(noised)


@typechecked
def noise(
    *,
    noise_multiplier: float,
    key: RngKey,
    allocation: str = "optimal",
    secure: bool = False,
    second_moment_share: float = DEFAULT_SECOND_MOMENT_SHARE,
    prefetch: bool | None = None,
) -> Transform:
    """:func:`gaussian_noise` as a chain stage (``ClippedPytree`` in, ``NoisedPytree`` out).

    After a clip stage with ``second_moment=True``: ``SecondMomentClippingOutput`` in,
    ``SecondMomentNoiseOutput`` out, both streams noised under one budget (the share
    ``second_moment_share`` for the squares).

    Privacy: as :func:`gaussian_noise` (``secure=True`` and ``prefetch`` as there); the
    paired release costs ``gaussian(noise_multiplier)``, charged once.
    """
    noise_fn, state0 = gaussian_noise(
        noise_multiplier=noise_multiplier,
        key=key,
        allocation=allocation,
        secure=secure,
        second_moment_share=second_moment_share,
        prefetch=prefetch,
    )

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

"""The Gaussian mechanism for clipped gradients: :func:`gaussian_noise` and the ``noise`` stage.

Step ``t`` draws its noise from ``fold_in(key, t)``: the same key on every rank gives
bit-identical noise after the all-reduce, and a checkpointed state resumes the exact
noise sequence. The global torch RNG is never touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any

import torch

from opake_fx._noise_input import check_clipped_input, check_noise_multiplier, check_noise_state
from opake_fx.distributed.agreement import AgreementCheck
from opake_fx.typing import typechecked
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pytree import tree_flatten_with_paths
from opake_fx.random import RngKey, flat_tree_normal, fold_in, tree_normal
from opake_fx.secure_random import add_secure_gaussian
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.transforms import Transform
from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup

__all__ = ["GaussianNoiseState", "gaussian_noise", "noise", "noise_stddev_for"]

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
) -> tuple[Callable[[ClippedPytree, GaussianNoiseState], tuple[NoisedPytree, GaussianNoiseState]], GaussianNoiseState]:
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

    Privacy:
        Each call is the Gaussian mechanism with noise multiplier ``noise_multiplier``
        on a query of sensitivity ``max_norm``: account for it as
        ``opake_fx.dpsgd.accounting.gaussian(noise_multiplier)`` (inside ``poisson`` for
        Poisson-sampled batches). Both per-group allocations cost exactly that. Refuses
        anything that is not a ``ClippedPytree`` (unclipped gradients have unbounded
        sensitivity) and a ``NoisedPytree`` (noise is added once, after aggregation).
        Under a process group every call checks that all ranks hold the same key, step,
        ``noise_multiplier``, ``max_norm`` and allocation (in full on the first call, then
        by one all-reduce of a digest) and raises ``DistributedMismatchError`` on every
        rank otherwise, before any noise is drawn.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> noise_fn, s = gaussian_noise(noise_multiplier=1.0, key=key(42))
        >>> out, s = noise_fn(ClippedPytree((torch.zeros(3),), max_norm=0.5), s)
        >>> out.noise_stddev, s.step
        (0.5, 1)
    """
    check_noise_multiplier(noise_multiplier)
    _check_allocation(allocation)
    if secure and exact:
        raise InputValueError("gaussian_noise: secure=True draws unpredictable noise; it cannot go with exact=True (keyed replay).")
    ranks_agree = AgreementCheck("gaussian_noise", fix=_AGREEMENT_FIX)

    def noise_fn(clipped: ClippedPytree, state: GaussianNoiseState) -> tuple[NoisedPytree, GaussianNoiseState]:
        check_clipped_input(clipped, noise_multiplier, mechanism="gaussian_noise")
        if not isinstance(state, GaussianNoiseState):
            raise InputTypeError(
                f"noise_fn needs the GaussianNoiseState it returned; got {type(state).__name__}."
            )
        ranks_agree(
            [
                ("key", state.key),
                ("step", state.step),
                ("noise_multiplier", float(noise_multiplier)),
                ("max_norm", clipped.max_norm),
                ("allocation", _ALLOCATIONS.index(allocation)),
            ]
        )
        new_state = replace(state, step=state.step + 1)
        std = noise_stddev_for(clipped.max_norm, noise_multiplier, allocation)
        if noise_multiplier == 0.0:
            return NoisedPytree(clipped.pytree, clipped.max_norm, noise_stddev=std), new_state
        paths, leaves, spec = tree_flatten_with_paths(clipped.pytree)
        step_key = fold_in(state.key, state.step)
        stds = [std.for_path(p) for p in paths] if isinstance(std, PerGroup) else None
        if secure:
            noised_leaves = add_secure_gaussian(leaves, stds if stds is not None else [float(std)] * len(leaves))
        elif exact:
            draws = tree_normal(step_key, leaves, exact=True)
            noised_leaves = [
                torch.add(leaf, z, alpha=std if stds is None else stds[i]) for i, (leaf, z) in enumerate(zip(leaves, draws))
            ]
        else:
            # One draw per device and dtype, scaled by the generator's kernel, then one fused add
            # per leaf: the outputs are views into the draw buffers (no parameter-sized temporaries).
            noised_leaves, _ = flat_tree_normal(step_key, leaves, stddev=1.0 if stds is not None else float(std))
            if stds is not None and noised_leaves:
                torch._foreach_mul_(noised_leaves, stds)
            if noised_leaves:
                torch._foreach_add_(noised_leaves, leaves)
        noised = spec.unflatten(noised_leaves)
        return NoisedPytree(noised, clipped.max_norm, noise_stddev=std), new_state

    return noise_fn, GaussianNoiseState(key=key)


@typechecked
def noise(*, noise_multiplier: float, key: RngKey, allocation: str = "optimal", secure: bool = False) -> Transform:
    """:func:`gaussian_noise` as a chain stage (``ClippedPytree`` in, ``NoisedPytree`` out).

    Privacy: as :func:`gaussian_noise` (``secure=True`` as there).
    """
    noise_fn, state0 = gaussian_noise(noise_multiplier=noise_multiplier, key=key, allocation=allocation, secure=secure)

    def update(x: Any, state: GaussianNoiseState, params: Any = None, **extra: Any) -> tuple[NoisedPytree, Any]:
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

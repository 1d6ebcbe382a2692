"""Correlated Gaussian noise for DP-FTRL: :func:`mf_gaussian_noise` and the ``noise`` stage.

Step ``t`` adds ``std * (C^{-1} Z)_t`` to the clipped gradient, where the rows ``z_s``
of ``Z`` are standard normals drawn from ``fold_in(key, s)`` (one subkey per leaf, as
the DP-SGD noise draws them) and ``std = noise_multiplier * sensitivity * max_norm``.
Row ``t`` of ``C^{-1} Z`` comes from the strategy's streaming inverse
(:mod:`opake_fx.dpftrl.streaming`): O(bands or buffers) parameter-sized tensors in the
state, never the whole ``Z``. With the same key every rank adds bit-identical noise,
and a checkpointed state resumes the exact noise sequence.

One Gaussian mechanism: the draws come from the library's one Gaussian home,
:mod:`opake_fx._gaussian` (the checks from :mod:`opake_fx._noise_input`). With the identity
strategy each step IS :func:`opake_fx._gaussian.noised_tree` (the draw and add that
:func:`~opake_fx.dpsgd.noise.gaussian_noise` uses), so the output is bit-identical to
DP-SGD's noise with the same key, step for step; other strategies correlate the same
keyed rows (:func:`opake_fx._gaussian.step_normals`) and add ``leaf + std * x``.

The private second moment: a :class:`~opake_fx.types.SecondMomentClippingOutput` input
is released as one Gaussian mechanism over both streams, as in DP-SGD (see
:mod:`opake_fx._gaussian`): the squared stream gets its own correlated noise through
the same strategy, from the key :func:`~opake_fx._gaussian.squared_stream_key`, and the
stddevs are split so that the whitened pair has noise multiplier ``noise_multiplier``
over the strategy's sensitivity: ``s_k = z * sens * D_k / sqrt(share_k)``. The
accounting is that of the gradient alone (``mf_gaussian``), charged once.

Momentum and learning-rate schedules: this stage only noises gradients. Run any
optimizer after it; to make the strategy *aware* of the optimizer, optimise it for
:func:`~opake_fx.dpftrl.workloads.momentum_workload` (folded in), otherwise for prefix
sums (applied after). Privacy is the same either way: post-processing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from opake_fx._noise_input import (
    check_noise_call,
    check_noise_key,
    check_noise_multiplier,
    check_noise_state,
    check_pair_step,
    check_second_moment_share,
    row_shards,
)
from opake_fx.dpftrl.strategies._base import Strategy
from opake_fx.dpftrl.strategies.banded import IdentityStrategy
from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError, OperationError
from opake_fx._gaussian import (
    DEFAULT_SECOND_MOMENT_SHARE,
    noised_tree,
    second_moment_stddevs,
    squared_stream_key,
    step_normals,
)
from opake_fx.pytree import tree_flatten_with_paths
from opake_fx.random import RngKey
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.transforms import Transform
from opake_fx.types import ClippedPytree, NoisedPytree, SecondMomentNoiseOutput
from opake_fx.distributed.agreement import AgreementCheck
from opake_fx.signatures import signature_of
from opake_fx.typing import typechecked

__all__ = ["MfNoiseState", "mf_gaussian_noise", "noise"]


@dataclass(frozen=True)
class MfNoiseState:
    """State of :func:`mf_gaussian_noise`.

    Attributes:
        key: the noise key (identical on every rank).
        step: the number of steps noised so far.
        buffers: the streaming inverse's parameter-sized buffers, one stacked tensor
            ``(memory, *leaf.shape)`` per gradient leaf (empty before the first step and
            for memory-free strategies).
        max_norm: the sensitivity of the clipped gradients seen at step 0; every later
            step must have the same (correlated noise is calibrated once for the run).
        squared_buffers: the squared-gradient stream's buffers (private second moment).
        squared_max_norm: the squared stream's sensitivity seen at step 0 (``None`` for a
            run without the second moment; a run cannot switch between the two).
    """

    key: RngKey
    step: int = 0
    buffers: tuple[torch.Tensor, ...] = ()
    max_norm: float | None = None
    squared_buffers: tuple[torch.Tensor, ...] = ()
    squared_max_norm: float | None = None

    def __post_init__(self) -> None:
        # Step s draws z_s from fold_in(key, s); a negative step would alias another step's draw.
        object.__setattr__(self, "step", check_noise_state(self.key, self.step, "MfNoiseState"))

    @property
    def memory_bytes(self) -> int:
        """Bytes held in the streaming buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers + self.squared_buffers)


@typechecked
def mf_gaussian_noise(
    strategy: Strategy,
    *,
    noise_multiplier: float,
    key: RngKey,
    min_sep: int = 1,
    max_participations: int | None = 1,
    epochs: int | None = None,
    n_steps: int | None = None,
    buffer_dtype: torch.dtype | None = None,
    inplace: bool = False,
    exact: bool = False,
    second_moment_share: float = DEFAULT_SECOND_MOMENT_SHARE,
) -> tuple[Callable[[Any, MfNoiseState], tuple[Any, MfNoiseState]], MfNoiseState]:
    """Makes the DP-FTRL (matrix-factorisation) Gaussian mechanism for clipped gradients.

    ``noise_fn(clipped, state)`` returns ``clipped + std * (C^{-1} Z)_t`` as a
    :class:`~opake_fx.types.NoisedPytree` whose ``noise_stddev`` is the per-coordinate std
    of that step's noise (``std * ||C^{-1}[t, :]||``). A per-group ``max_norm`` is noised
    isotropically with its overall sensitivity ``max_norm.effective``.

    Args:
        strategy: the factorisation (e.g. ``band_mf_strategy(...)``).
        noise_multiplier: ``sigma``: the std of ``z`` is ``sigma * sensitivity * max_norm``
            (>= 0; 0 adds nothing).
        key: the noise key; pass the SAME key on every rank.
        min_sep, max_participations: the b-min-sep participation the sampler
            guarantees; the sensitivity is ``strategy.sensitivity(min_sep, max_participations)``.
            The default (1, 1) is the per-participation sensitivity, which is what the
            amplified BandMF accounting (``accounting.poisson``) assumes.
        epochs: use the fixed-epoch-order sensitivity ``strategy.epoch_sensitivity(epochs)``
            instead (for :class:`~opake_fx.dpftrl.sampling.FixedEpochSampler`).
        n_steps: the horizon, for strategies built without one (lambda-CGD).
        buffer_dtype: dtype of the draws and buffers (default: each leaf's dtype);
            float64 makes long streams exact to ~1e-15.
        inplace: update the buffers in place (halves peak memory; the previous state
            becomes invalid).
        exact: draw JAX-identical Threefry normals (slow; tests).
        second_moment_share: for a ``SecondMomentClippingOutput`` input, the share in
            ``(0, 1)`` of the budget given to the squared stream (module docstring).

    Privacy:
        The whole run releases ``C x + z`` with ``z ~ N(0, std^2)``: the Gaussian
        mechanism with noise multiplier ``noise_multiplier`` on a query of sensitivity
        ``sensitivity * max_norm`` under the stated participation (with the second
        moment: on the concatenated pair, whose whitened sensitivity the split makes
        exactly that; charge it once). Account for it with
        :func:`opake_fx.dpftrl.accounting.mf_gaussian` (same ``min_sep``,
        ``max_participations``, ``epochs``), or with ``accounting.poisson`` for banded
        strategies under cyclic Poisson sampling. A
        :class:`~opake_fx.types.RowShardedClippedPytree` (an FSDP2 rank's rows) gets
        exactly its rows of the unsharded correlated noise (its buffers hold those rows),
        so the ranks' shards together are the unsharded release. Refuses anything else that
        is not a ``ClippedPytree``, a changing ``max_norm``, and steps beyond ``n_steps``. Under a
        process group every call checks that all ranks hold the same key, step,
        ``noise_multiplier``, strategy sensitivity, horizon and ``max_norm`` (in full on
        the first call, then by one all-reduce of a digest); ``DistributedMismatchError``
        on every rank otherwise.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> from opake_fx.dpftrl import band_mf_strategy
        >>> fn, s = mf_gaussian_noise(band_mf_strategy(8, 2, max_iterations=5), noise_multiplier=1.0, key=key(0))
        >>> out, s = fn(ClippedPytree((torch.zeros(3),), max_norm=0.5), s)
        >>> s.step, len(s.buffers), tuple(s.buffers[0].shape)
        (1, 1, (1, 3))
    """
    if not isinstance(strategy, Strategy):
        raise InputTypeError(
            f"mf_gaussian_noise needs a Strategy (e.g. opake_fx.dpftrl.band_mf_strategy(...)); got {type(strategy).__name__}."
        )
    check_noise_multiplier(noise_multiplier, calibrate_with="opake_fx.accounting.calibrate and opake_fx.dpftrl.accounting")
    check_noise_key(key, "mf_gaussian_noise's key")
    horizon, sens = _horizon_and_sensitivity(strategy, min_sep, max_participations, epochs, n_steps)
    share = check_second_moment_share(second_moment_share)
    inverse = strategy.inverse_noise()
    independent = isinstance(strategy, IdentityStrategy)  # C = I: DP-SGD's Gaussian mechanism, step by step
    row_norms: list[torch.Tensor] = []
    ranks_agree = AgreementCheck(
        "mf_gaussian_noise",
        fix=(
            "Build the noise stage with the same strategy, key, noise_multiplier and participation (min_sep, "
            "max_participations, epochs) on every rank, resume every rank from the same checkpoint, and clip with "
            "the same clipping_norm and normalize_by: otherwise some rank adds different or less noise than the "
            "accountant assumes."
        ),
    )

    def noise_fn(clipped: Any, state: MfNoiseState) -> tuple[Any, MfNoiseState]:
        # an FSDP2 rank's rows: its rows of the one unsharded correlated noise
        clipped, rows = row_shards(clipped, mechanism="mf_gaussian_noise", keyed=not exact)
        pair = check_noise_call(clipped, state, MfNoiseState, noise_multiplier, mechanism="mf_gaussian_noise")
        first = clipped.grads if pair else clipped
        facts = [
            ("key", state.key),
            ("step", state.step),
            ("noise_multiplier", float(noise_multiplier)),
            ("sensitivity", float(sens)),
            ("n_steps", int(horizon)),
            ("max_norm", first.max_norm),
        ]
        if pair:
            facts += [("squared_max_norm", clipped.squared_grads.max_norm), ("second_moment_share", share)]
        ranks_agree(facts)
        t = state.step
        if t >= horizon:
            raise OperationError(
                f"mf_gaussian_noise: step {t} is beyond the strategy's n_steps={horizon}. The sensitivity and the "
                "accounting cover n_steps steps only; build a strategy for the longer run."
            )
        mn = _same_as_before(first.sensitivity, state.max_norm, t, "max_norm")
        mn2 = None
        if state.max_norm is not None and (state.squared_max_norm is not None) != pair:
            raise NoiseInputError(
                f"mf_gaussian_noise: step {t} {'adds' if pair else 'drops'} the squared-gradient stream, but step 0 "
                f"{'did not have' if pair else 'had'} it. Correlated noise is calibrated once for the whole run: "
                "clip with second_moment=True at every step or at none."
            )
        if pair:
            check_pair_step(t)
            mn2 = _same_as_before(clipped.squared_grads.sensitivity, state.squared_max_norm, t, "squared max_norm")
            std, std2 = second_moment_stddevs(noise_multiplier, sens * mn, sens * mn2, share)
        else:
            std, std2 = (noise_multiplier * sens * mn if noise_multiplier > 0 else 0.0), 0.0  # 0 * inf (unclipped) is 0
        if std > 0 and not row_norms:  # a noise_multiplier=0 baseline never needs them
            row_norms.append(strategy.inverse_row_norms(horizon))
        row = float(row_norms[0][t]) if std > 0 else 0.0
        noised, buffers = _stream(first.pytree, state.key, state.buffers, t, std, rows)
        out = NoisedPytree(noised, first.max_norm, noise_stddev=std * row)
        squared_buffers = state.squared_buffers
        if pair:
            second = clipped.squared_grads
            noised2, squared_buffers = _stream(second.pytree, squared_stream_key(state.key), state.squared_buffers, t, std2)
            out = SecondMomentNoiseOutput(out, NoisedPytree(noised2, second.max_norm, noise_stddev=std2 * row))
        return out, MfNoiseState(state.key, t + 1, buffers, mn, squared_buffers, mn2)

    def _stream(pytree: Any, key: RngKey, buffers: tuple[torch.Tensor, ...], t: int, std: float,
                rows: tuple[Any, Any] | None = None) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """One stream's step ``t``: ``pytree + std * (C^{-1} Z)_t`` with ``Z``'s rows drawn from ``fold_in(key, s)``.

        With ``rows`` (an FSDP2 shard): the leaves' rows of the unsharded ``Z`` (the streaming
        inverse combines each coordinate's own draws over time, so a shard's buffers hold its rows).
        """
        if std == 0.0:
            return pytree, buffers
        if independent:
            return noised_tree(pytree, key, t, std, exact=exact, rows=rows), buffers
        _, leaves, spec = tree_flatten_with_paths(pytree)
        like = _shapes_like(leaves, buffer_dtype)
        if inverse.memory > 0 and not buffers:
            if t > 0:
                raise OperationError(
                    "mf_gaussian_noise: the state has no buffers after step 0; pass the state returned by the previous call."
                )
            buffers = inverse.init(like)

        def draw(s: int) -> list[torch.Tensor]:  # row s of Z: step s's keyed normals
            return step_normals(key, s, like, exact=exact, rows=rows)

        x, new_buffers = inverse.next(t, draw, buffers, inplace=inplace)
        return spec.unflatten([leaf + (std * xi).to(leaf.dtype) for leaf, xi in zip(leaves, x)]), new_buffers

    noise_fn.sensitivity = sens  # type: ignore[attr-defined]  # read by the chain stage's privacy description
    return noise_fn, MfNoiseState(key=key)


@signature_of(mf_gaussian_noise, drop=("inplace", "exact"))
def noise(**arguments: Any) -> Transform:
    """:func:`mf_gaussian_noise` as a chain stage (``ClippedPytree`` in, ``NoisedPytree`` out).

    Takes :func:`mf_gaussian_noise`'s arguments but ``inplace`` and ``exact`` (its
    signature is derived from the function's, so the two cannot drift apart).

    ``init(params)`` allocates the streaming buffers shaped like ``params`` (those of the
    squared stream, after a clip stage with ``second_moment=True``, on the first step).

    Privacy: as :func:`mf_gaussian_noise`.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> from opake_fx.dpftrl import bsr_strategy
        >>> stage = noise(bsr_strategy(10, 3), noise_multiplier=1.0, key=key(1))
        >>> state = stage.init([torch.zeros(4)])
        >>> state.memory_bytes
        32
    """
    noise_fn, state0 = mf_gaussian_noise(**arguments)
    strategy, noise_multiplier = arguments["strategy"], arguments["noise_multiplier"]
    buffer_dtype = arguments["buffer_dtype"]
    inverse = strategy.inverse_noise()

    def init(params: Any) -> MfNoiseState:
        if params is None or inverse.memory == 0 or noise_multiplier == 0.0:
            return state0
        _, leaves, _ = tree_flatten_with_paths(params)
        return replace(state0, buffers=inverse.init(_shapes_like(leaves, buffer_dtype)))

    def update(x: Any, state: MfNoiseState, params: Any = None, **extra: Any) -> tuple[Any, MfNoiseState]:
        return noise_fn(x, state)

    sens = noise_fn.sensitivity  # type: ignore[attr-defined]
    described = StagePrivacy(
        "noise",
        f"matrix-factorisation gaussian ({type(strategy).__name__}), noise_multiplier={noise_multiplier:g}",
        noise_multiplier=float(noise_multiplier),
        mechanism="mf_gaussian",
        noise_sensitivity=sens,
    )
    return Transform(init, update, described)


def _same_as_before(value: float, before: float | None, t: int, what: str) -> float:
    """``value``, unless it differs from the one seen at step 0 (correlated noise is calibrated once)."""
    if before is not None and not math.isclose(value, before, rel_tol=1e-12, abs_tol=0.0):
        raise NoiseInputError(
            f"mf_gaussian_noise: {what} changed from {before} (step 0) to {value} at step {t}. Correlated "
            "noise is calibrated once for the whole run: keep clipping_norm and normalize_by constant."
        )
    return value


def _horizon_and_sensitivity(
    strategy: Strategy, min_sep: int, max_participations: int | None, epochs: int | None, n_steps: int | None
) -> tuple[int, float]:
    """The run's length and the strategy's sensitivity under the stated participation."""
    horizon = strategy.n_steps if strategy.n_steps is not None else n_steps
    if horizon is None:
        raise InputValueError(
            f"mf_gaussian_noise: {strategy!r} has no n_steps; pass n_steps= (the length of the run) so the "
            "sensitivity covers the whole run."
        )
    if strategy.n_steps is not None and n_steps is not None and n_steps != strategy.n_steps:
        raise InputValueError(f"mf_gaussian_noise: n_steps={n_steps} differs from the strategy's n_steps={strategy.n_steps}.")
    if epochs is not None:
        return horizon, float(strategy.epoch_sensitivity(epochs, n=horizon))
    return horizon, float(strategy.sensitivity(min_sep, max_participations, n=horizon))


def _shapes_like(leaves: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Storage-free stand-ins with each leaf's shape, (buffer) dtype and device (for drawing noise)."""
    return [torch.zeros((), dtype=dtype or leaf.dtype, device=leaf.device).expand(leaf.shape) for leaf in leaves]

"""What a pipeline does to privacy: stage descriptions, the build-time order check, the report.

Every DP stage describes itself with a :class:`StagePrivacy` (``Transform.privacy``):
``clip`` (the sensitivity of its output), ``aggregate`` (``psum``), ``noise`` (the
mechanism and its multiplier), ``postprocess`` (any map of the noised value:
:func:`~opake_fx.transforms.postprocess`) and ``optimizer`` (post-processing of its
input). A :func:`~opake_fx.transforms.chain` reads them when it is built:

* a chain with a ``clip`` stage that reaches an ``optimizer`` with no ``noise`` stage in
  between is refused: it would train on clipped but un-noised gradients and release them.
  A non-private baseline says so explicitly with ``noise(noise_multiplier=0, ...)``,
  reported as epsilon = inf;
* a ``noise``, ``aggregate``, ``postprocess`` or ``optimizer`` stage placed before ``clip``
  is refused: it would receive (and silently transform) the data batch instead of gradients;
* a ``postprocess`` stage between ``clip`` and ``noise`` is refused: only a noised value
  may be mapped without a bound (before noise, map with ``.map(fn, lipschitz=L)`` or
  ``.map_with_path(fn, lipschitz=L)``, which keep the sensitivity).

(At run time the same rule holds by types: optimizers refuse a ``ClippedPytree`` that was
never noised, and noise stages refuse anything but a ``ClippedPytree``.)

:func:`privacy_report` (also ``pipeline.privacy_report()``) lists each stage with the
sensitivity of what it outputs and the stddev of the noise in it, tracked through the
stages that describe what they do (a ``postprocess`` stage with a ``scale``), and
``"unknown"`` (:data:`UNKNOWN`) after a stage that does not: never a number it cannot
vouch for. It says whether the pipeline is private.

Example:
    >>> import torch
    >>> from opake_fx.dpsgd import clip, noise
    >>> from opake_fx.optimizers import sgd
    >>> from opake_fx.random import key
    >>> from opake_fx.transforms import named_chain
    >>> f = lambda p, x: ((x - p) ** 2).sum()
    >>> pipe = named_chain(("clip", clip(f, clipping_norm=1.0, batch_argnums=(1,), normalize_by=4)),
    ...                    ("noise", noise(noise_multiplier=1.1, key=key(0))), ("opt", sgd(0.1)))
    >>> report = pipe.privacy_report(sample_rate=0.01, steps=1000, delta=1e-5)
    >>> report.private, report.noise_multiplier, report.sensitivity
    (True, 1.1, 0.25)
    >>> round(report.epsilon, 2)
    1.52
    >>> report.noise_stddev    # after sgd: the optimizer's effect on the noise is not tracked
    'unknown'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opake_fx.errors import InputValueError, OperationError
from opake_fx.types import PerGroup

__all__ = [
    "StagePrivacy",
    "StageReport",
    "PrivacyReport",
    "check_stage_order",
    "privacy_report",
    "STAGE_KINDS",
    "UNKNOWN",
]

STAGE_KINDS = ("clip", "aggregate", "noise", "postprocess", "optimizer", "chain")
"""The kinds of stages a :class:`StagePrivacy` can describe."""

UNKNOWN = "unknown"
"""What a :class:`StageReport` holds for a sensitivity or noise stddev it cannot know."""

CLIP_UNITS = ("example", "user")
"""What a clip stage clips as one unit: one example, or one user's examples together
(a loss from :func:`opake_fx.users.user_loss` / :func:`~opake_fx.users.batched_user_loss`)."""


@dataclass(frozen=True)
class StagePrivacy:
    """What one stage does to privacy (attached to a ``Transform`` as ``.privacy``).

    Attributes:
        kind: ``"clip"``, ``"aggregate"``, ``"noise"``, ``"postprocess"``, ``"optimizer"``
            or ``"chain"``.
        description: one line for the report (e.g. ``"clip to 1.0, / 64"``).
        max_norm: for ``clip``, the L2 sensitivity of its output (``C / normalize_by``);
            ``None`` when it is only known per step (adaptive clipping).
        noise_multiplier: for ``noise``, sigma (0 is an explicit non-private baseline).
        mechanism: for ``noise``, ``"gaussian"`` (DP-SGD) or ``"mf_gaussian"`` (DP-FTRL).
        noise_sensitivity: for ``mf_gaussian``, the strategy's sensitivity factor (the
            noise stddev is ``noise_multiplier * noise_sensitivity * max_norm``).
        stages: for ``chain``, the ``(name, StagePrivacy or None)`` of its stages.
        scale: for ``postprocess``, the public factor by which the stage multiplies the
            noise's stddev and the sensitivity (``a`` for ``g -> a * g``); ``None`` for any
            other map (the report then says ``"unknown"`` after it).
        paired: for ``clip``, the stage releases a gradient and its squares together
            (``second_moment=True``): the noise stage splits its budget between the two
            streams, so neither stream's stddev is ``noise_multiplier * sensitivity`` (the
            report says :data:`UNKNOWN` for it).
        takes_example_mask: for ``clip``, the stage's ``update`` honours the keyword
            ``example_mask`` (padding rows contribute exactly zero), so a padded batch
            (:func:`opake_fx.padding.pad_batch`) may be given to it.
        unit: for ``clip``, what one clipped unit is (:data:`CLIP_UNITS`): ``"example"``,
            or ``"user"`` when the loss is a user's (the report's epsilon is then per user).
    """

    kind: str
    description: str = ""
    max_norm: float | PerGroup | None = None
    noise_multiplier: float | None = None
    mechanism: str | None = None
    noise_sensitivity: float | None = None
    stages: tuple[tuple[str, Any], ...] = field(default=())
    scale: float | None = None
    takes_example_mask: bool = False
    paired: bool = False
    unit: str = "example"

    def __post_init__(self) -> None:
        if self.kind not in STAGE_KINDS:
            raise InputValueError(f"StagePrivacy.kind must be one of {STAGE_KINDS}; got {self.kind!r}.")
        if self.unit not in CLIP_UNITS:
            raise InputValueError(f"StagePrivacy.unit must be one of {CLIP_UNITS}; got {self.unit!r}.")
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))
                                       or not math.isfinite(self.scale)):
            raise InputValueError(f"StagePrivacy.scale must be a finite real number or None; got {self.scale!r}.")


@dataclass(frozen=True)
class StageReport:
    """One row of a :class:`PrivacyReport`.

    Attributes:
        name: the stage's name (``"2"`` for the third stage of an unnamed chain; nested
            chains give ``"outer/inner"``).
        kind: the stage kind, or ``"unknown"`` for a stage that does not describe itself.
        description: what the stage does.
        sensitivity: the L2 sensitivity of the stage's output under add-or-remove-one
            (``None`` for the data batch before clipping; :data:`UNKNOWN` where the report
            cannot know it).
        noise_stddev: the per-coordinate stddev of the noise in the stage's output
            (``None`` before any noise; :data:`UNKNOWN` after a stage whose effect on the
            noise is not described, e.g. an optimizer or a ``postprocess`` without
            ``scale``).
        note: what the stage means for privacy.
    """

    name: str
    kind: str
    description: str
    sensitivity: float | str | None
    noise_stddev: float | str | None
    note: str


@dataclass(frozen=True)
class PrivacyReport:
    """The privacy of a pipeline, stage by stage.

    Attributes:
        stages: one :class:`StageReport` per stage, in order.
        private: True when a clip stage is followed by a noise stage with
            ``noise_multiplier > 0`` before anything else is released.
        sensitivity: the clipped gradient's L2 sensitivity (``None`` if unknown).
        noise_multiplier: the noise stage's sigma (``None`` without one).
        mechanism: ``"gaussian"`` or ``"mf_gaussian"`` (``None`` without noise).
        epsilon: ``inf`` for a pipeline that is not private (a ``noise_multiplier=0``
            baseline included); for a Gaussian one with ``sample_rate``, ``steps`` and
            ``delta`` given, epsilon of Poisson-sampled DP-SGD over ``steps``; else ``None``.
        delta: the delta ``epsilon`` is measured at.
        noise_stddev: the stddev of the noise in the pipeline's output (its last stage's
            ``noise_stddev``): a number, :data:`UNKNOWN`, or ``None`` without noise.
        unit: what ``epsilon`` protects: ``"example"``, or ``"user"`` when the clip stage
            clips users (the sample rate is then the users').
    """

    stages: tuple[StageReport, ...]
    private: bool
    sensitivity: float | None
    noise_multiplier: float | None
    mechanism: str | None
    epsilon: float | None
    delta: float | None
    noise_stddev: float | str | None = None
    unit: str = "example"

    def __str__(self) -> str:
        rows = [f"{'stage':<14}{'kind':<12}{'sensitivity':<13}{'noise std':<11}note"]
        for s in self.stages:
            rows.append(f"{s.name:<14}{s.kind:<12}{_cell(s.sensitivity):<13}{_cell(s.noise_stddev):<11}{s.note}")
        eps = "unknown (pass sample_rate, steps, delta)" if self.epsilon is None else f"{self.epsilon:.4g}"
        rows.append(f"private: {self.private}; epsilon per {self.unit}: {eps}"
                    + (f" at delta={self.delta:g}" if self.delta else ""))
        return "\n".join(rows)


def check_stage_order(stages: Sequence[tuple[str, StagePrivacy | None]], where: str) -> None:
    """Refuses a chain whose stage order breaks the clip -> (aggregate) -> noise -> optimizer contract.

    Raises:
        OperationError: a clip stage reaches an optimizer without a noise stage in
            between, a gradient stage (noise, aggregate, postprocess, optimizer) comes
            before clip, or a postprocess stage comes between clip and noise.
    """
    flat = _flatten(stages, "")
    clip_at = next((i for i, (_, info) in enumerate(flat) if info is not None and info.kind == "clip"), None)
    if clip_at is None:
        return
    for name, info in flat[:clip_at]:
        if info is not None and info.kind in ("noise", "aggregate", "postprocess", "optimizer"):
            raise OperationError(
                f"{where}: stage {name!r} ({info.kind}) comes before the clip stage {flat[clip_at][0]!r}, so it would "
                "receive the data batch, not gradients. Order the stages clip -> psum -> noise -> postprocess -> "
                "optimizer."
            )
    noised = False
    for name, info in flat[clip_at + 1 :]:
        if info is None:
            continue
        if info.kind == "noise":
            noised = True
        elif info.kind == "postprocess" and not noised:
            raise OperationError(
                f"{where}: the postprocess stage {name!r} comes after the clip stage {flat[clip_at][0]!r} but before "
                "any noise stage: post-processing (a map with no bound) is free only on a noised value, and the noise "
                "stage would then refuse its output. Move it after the noise stage, or, to transform the clipped "
                "gradient before noise, keep its sensitivity bound with a stage that maps it with a declared Lipschitz "
                "constant: stateless(lambda g, params=None: g.map(fn, lipschitz=L)) (or g.map_with_path(fn, "
                "lipschitz=L) for a per-leaf map)."
            )
        elif info.kind == "optimizer" and not noised:
            raise OperationError(
                f"{where}: the clip stage {flat[clip_at][0]!r} reaches the optimizer {name!r} without a noise stage: "
                "the clipped gradients would be trained on and released without noise, which is not private. "
                "Add noise(noise_multiplier=sigma, key=key) after the aggregation (calibrate sigma with "
                "opake_fx.accounting.calibrate), or noise(noise_multiplier=0, key=key) for an explicit "
                "non-private baseline (reported as epsilon = inf)."
            )


def privacy_report(
    stages: Sequence[tuple[str, StagePrivacy | None]],
    *,
    sample_rate: float | None = None,
    steps: int | None = None,
    delta: float | None = None,
) -> PrivacyReport:
    """The stage-by-stage privacy of a pipeline (see ``Transform.privacy_report``).

    The sensitivity and the noise stddev are tracked from stage to stage: a clip stage
    sets the sensitivity, a noise stage adds noise of stddev ``sigma * sensitivity``
    (per coordinate; times the strategy's sensitivity for DP-FTRL), a ``postprocess``
    stage with a ``scale`` multiplies both by ``|scale|``. After a stage that does not
    describe its effect (a stage without a description, a ``postprocess`` without
    ``scale``, an optimizer) both are :data:`UNKNOWN`, and so is a noise stddev that
    depends on what the report cannot see (per-group stddevs of uneven groups, whose
    allocation the noise stage chooses). A reported number is the stddev the pipeline
    adds, or it is not reported.

    Args:
        stages: ``(name, StagePrivacy or None)`` of each stage, in order.
        sample_rate, steps, delta: Poisson sample rate, number of steps and delta; with
            all three, a Gaussian pipeline's epsilon is computed (PLD accountant).

    Returns:
        A :class:`PrivacyReport`.

    Privacy: reading only; the epsilon is that of Poisson-sampled DP-SGD with the
    pipeline's noise multiplier and the stated sampling (the accountant's assumptions),
    amplified by the same sampling part as a ``DPPlan(sampling="poisson")``
    (:class:`~opake_fx.planning.samplers.poisson.PoissonSampling`), so a report and a
    plan of the same run agree.
    It does not depend on the tracked sensitivity: the noise stage reads the sensitivity
    from the value it is given.

    Example:
        >>> from opake_fx.dpsgd import clip, noise
        >>> from opake_fx.random import key
        >>> from opake_fx.transforms import named_chain, postprocess
        >>> f = lambda p, x: ((x - p) ** 2).sum()
        >>> pipe = named_chain(("clip", clip(f, clipping_norm=1.0, batch_argnums=(1,), normalize_by=64)),
        ...                    ("noise", noise(noise_multiplier=1.0, key=key(0))),
        ...                    ("double", postprocess(lambda g: 2 * g, scale=2.0)))
        >>> pipe.privacy_report().noise_stddev   # 2 * (1.0 * 1 / 64)
        0.03125
    """
    flat = _flatten(stages, "")
    rows: list[StageReport] = []
    sens: float | str | None = None  # of the value flowing between stages; None: the data batch
    std: float | str | None = None  # of the noise in it; None: no noise yet
    clipped = False
    released_unnoised = False
    nm: float | None = None
    mechanism: str | None = None
    clip_sens: float | None = None
    unit = "example"
    uneven_groups = False
    paired = False
    has_clip = any(info is not None and info.kind == "clip" for _, info in flat)
    for name, info in flat:
        if info is None:
            if not clipped:
                note = "undescribed stage before clip: it receives the data batch" if has_clip else "undescribed stage"
            elif nm is None:
                sens = UNKNOWN
                note = (
                    "undescribed stage between clip and noise: a map of the ClippedPytree keeps its guarantee only "
                    "as g.map(fn, lipschitz=L), g.map_with_path(fn, lipschitz=L) or g * a (else noise refuses it)"
                )
            else:
                sens, std = UNKNOWN, UNKNOWN
                note = (
                    "undescribed stage after noise: post-processing if it reads only its input and public data; its "
                    "effect on the noise is unknown (describe it with postprocess(fn, scale=...))"
                )
            rows.append(StageReport(name, "unknown", "", sens, std, note))
            continue
        if info.kind == "clip":
            clipped = True
            clip_sens = _effective(info.max_norm)
            sens = UNKNOWN if clip_sens is None else clip_sens
            uneven_groups = isinstance(info.max_norm, PerGroup) and len(set(info.max_norm.values.values())) > 1
            paired, unit = info.paired, info.unit
            note = f"per-{unit} clipping: sensitivity max_norm (add-or-remove-one {unit})" + (
                "; known per step (adaptive; its noised count also costs privacy: no epsilon is reported, account "
                "with adaptive_clipping_gaussian or DPPlan)" if clip_sens is None else ""
            )
        elif info.kind == "aggregate":
            note = f"sum over ranks: each {unit} lives on one rank, sensitivity unchanged"
        elif info.kind == "noise":
            nm, mechanism = info.noise_multiplier, info.mechanism
            factor = info.noise_sensitivity if info.noise_sensitivity is not None else 1.0
            if nm == 0:
                std = 0.0
            elif nm is None or not isinstance(sens, float) or (uneven_groups and mechanism == "gaussian") or paired:
                # per-group stddevs of uneven groups depend on the noise stage's allocation; a paired
                # (second-moment) release splits the budget between its two streams by the stage's share
                std = UNKNOWN
            else:
                std = nm * factor * sens
            note = (
                "noise_multiplier=0: explicit non-private baseline (epsilon = inf)"
                if nm == 0
                else f"{mechanism} mechanism, sigma={nm:g}" + (f" x strategy sensitivity {factor:.4g}" if factor != 1 else "")
                + ("; per-group stddevs (allocated by the noise stage)" if std == UNKNOWN and uneven_groups else "")
                + ("; gradient and squares noised jointly (the stddevs follow second_moment_share)" if paired else "")
            )
        elif info.kind == "postprocess":
            if info.scale is None:
                sens = UNKNOWN if sens is not None else None
                std = UNKNOWN if std is not None else None
                effect = "its effect on the noise is not described (pass scale= if it multiplies it by a constant)"
            else:
                a = abs(float(info.scale))
                sens = a * sens if isinstance(sens, float) else sens
                std = a * std if isinstance(std, float) else std
                effect = f"scales the noise stddev by {a:g}"
            note = (
                "post-processing of the noised value: no guarantee needed, privacy unchanged; " if nm is not None
                else "post-processing; "
            ) + effect
        elif info.kind == "optimizer":
            if clipped and nm is None:
                released_unnoised = True
                note = "releases clipped, un-noised gradients: not private"
            else:
                note = "post-processing of the noised gradient" if nm is not None else "post-processing"
            sens = UNKNOWN if sens is not None else None
            std = UNKNOWN if std is not None else None
        else:
            note = ""
        rows.append(StageReport(name, info.kind, info.description, sens, std, note))
    private = clipped and nm is not None and nm > 0 and not released_unnoised
    epsilon: float | None
    if not private:
        epsilon = math.inf
    elif mechanism == "gaussian" and _sensitivity_known(flat) and None not in (sample_rate, steps, delta):
        from opake_fx.dpsgd.accounting import gaussian  # lazily: accounting is optional for a report
        from opake_fx.planning.samplers.poisson import PoissonSampling

        # the Gaussian mechanism amplified by the part behind DPPlan(sampling="poisson")
        step = PoissonSampling().amplify_at(gaussian(nm), sample_rate)
        epsilon = (step * steps).epsilon_at(delta)
    else:
        epsilon = None
    return PrivacyReport(tuple(rows), private, clip_sens, nm, mechanism, epsilon, delta, std, unit)


def _cell(value: float | str | None) -> str:
    """A report cell: ``-`` for nothing to report, ``unknown``, or the number."""
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.4g}"


def _sensitivity_known(flat: Sequence[tuple[str, StagePrivacy | None]]) -> bool:
    """False when a clip stage's sensitivity is only known per step (adaptive clipping, whose count the
    Gaussian epsilon would leave out)."""
    return all(info.max_norm is not None for _, info in flat if info is not None and info.kind == "clip")


def _effective(max_norm: Any) -> float | None:
    if max_norm is None:
        return None
    return float(max_norm.effective) if isinstance(max_norm, PerGroup) else float(max_norm)


def _flatten(stages: Sequence[tuple[str, StagePrivacy | None]], prefix: str) -> list[tuple[str, StagePrivacy | None]]:
    out: list[tuple[str, StagePrivacy | None]] = []
    for name, info in stages:
        full = f"{prefix}{name}"
        if info is not None and info.kind == "chain":
            out.extend(_flatten(info.stages, f"{full}/"))
        else:
            out.append((full, info))
    return out

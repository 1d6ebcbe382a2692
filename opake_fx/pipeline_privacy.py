"""What a pipeline does to privacy: stage descriptions, the build-time order check, the report.

Every DP stage describes itself with a :class:`StagePrivacy` (``Transform.privacy``):
``clip`` (the sensitivity of its output), ``aggregate`` (``psum``), ``noise`` (the
mechanism and its multiplier) and ``optimizer`` (post-processing of its input). A
:func:`~opake_fx.transforms.chain` reads them when it is built:

* a chain with a ``clip`` stage that reaches an ``optimizer`` with no ``noise`` stage in
  between is refused: it would train on clipped but un-noised gradients and release them.
  A non-private baseline says so explicitly with ``noise(noise_multiplier=0, ...)``,
  reported as epsilon = inf;
* a ``noise``, ``aggregate`` or ``optimizer`` stage placed before ``clip`` is refused: it
  would receive (and silently transform) the data batch instead of gradients.

(At run time the same rule holds by types: optimizers refuse a ``ClippedPytree`` that was
never noised, and noise stages refuse anything but a ``ClippedPytree``.)

:func:`privacy_report` (also ``pipeline.privacy_report()``) lists each stage with the
sensitivity of what it outputs, and says whether the pipeline is private.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opake_fx.errors import InputValueError, OperationError
from opake_fx.types import PerGroup

__all__ = ["StagePrivacy", "StageReport", "PrivacyReport", "check_stage_order", "privacy_report", "STAGE_KINDS"]

STAGE_KINDS = ("clip", "aggregate", "noise", "optimizer", "chain")
"""The kinds of stages a :class:`StagePrivacy` can describe."""


@dataclass(frozen=True)
class StagePrivacy:
    """What one stage does to privacy (attached to a ``Transform`` as ``.privacy``).

    Attributes:
        kind: ``"clip"``, ``"aggregate"``, ``"noise"``, ``"optimizer"`` or ``"chain"``.
        description: one line for the report (e.g. ``"clip to 1.0, / 64"``).
        max_norm: for ``clip``, the L2 sensitivity of its output (``C / normalize_by``);
            ``None`` when it is only known per step (adaptive clipping).
        noise_multiplier: for ``noise``, sigma (0 is an explicit non-private baseline).
        mechanism: for ``noise``, ``"gaussian"`` (DP-SGD) or ``"mf_gaussian"`` (DP-FTRL).
        noise_sensitivity: for ``mf_gaussian``, the strategy's sensitivity factor (the
            noise stddev is ``noise_multiplier * noise_sensitivity * max_norm``).
        stages: for ``chain``, the ``(name, StagePrivacy or None)`` of its stages.
    """

    kind: str
    description: str = ""
    max_norm: float | PerGroup | None = None
    noise_multiplier: float | None = None
    mechanism: str | None = None
    noise_sensitivity: float | None = None
    stages: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kind not in STAGE_KINDS:
            raise InputValueError(f"StagePrivacy.kind must be one of {STAGE_KINDS}; got {self.kind!r}.")


@dataclass(frozen=True)
class StageReport:
    """One row of a :class:`PrivacyReport`.

    Attributes:
        name: the stage's name (``"2"`` for the third stage of an unnamed chain; nested
            chains give ``"outer/inner"``).
        kind: the stage kind, or ``"unknown"`` for a stage that does not describe itself.
        description: what the stage does.
        sensitivity: the L2 sensitivity of the stage's output under add-or-remove-one
            (``None`` for the data batch before clipping or where unknown; ``inf`` for
            values released without a bound).
        noise_stddev: for a noise stage, the stddev it adds (per coordinate).
        note: what the stage means for privacy.
    """

    name: str
    kind: str
    description: str
    sensitivity: float | None
    noise_stddev: float | None
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
    """

    stages: tuple[StageReport, ...]
    private: bool
    sensitivity: float | None
    noise_multiplier: float | None
    mechanism: str | None
    epsilon: float | None
    delta: float | None

    def __str__(self) -> str:
        rows = [f"{'stage':<14}{'kind':<11}{'sensitivity':<13}{'noise std':<11}note"]
        for s in self.stages:
            sens = "-" if s.sensitivity is None else f"{s.sensitivity:.4g}"
            std = "-" if s.noise_stddev is None else f"{s.noise_stddev:.4g}"
            rows.append(f"{s.name:<14}{s.kind:<11}{sens:<13}{std:<11}{s.note}")
        eps = "unknown (pass sample_rate, steps, delta)" if self.epsilon is None else f"{self.epsilon:.4g}"
        rows.append(f"private: {self.private}; epsilon: {eps}" + (f" at delta={self.delta:g}" if self.delta else ""))
        return "\n".join(rows)


def check_stage_order(stages: Sequence[tuple[str, StagePrivacy | None]], where: str) -> None:
    """Refuses a chain whose stage order breaks the clip -> (aggregate) -> noise -> optimizer contract.

    Raises:
        OperationError: a clip stage reaches an optimizer without a noise stage in
            between, or a gradient stage (noise, aggregate, optimizer) comes before clip.
    """
    flat = _flatten(stages, "")
    clip_at = next((i for i, (_, info) in enumerate(flat) if info is not None and info.kind == "clip"), None)
    if clip_at is None:
        return
    for name, info in flat[:clip_at]:
        if info is not None and info.kind in ("noise", "aggregate", "optimizer"):
            raise OperationError(
                f"{where}: stage {name!r} ({info.kind}) comes before the clip stage {flat[clip_at][0]!r}, so it would "
                "receive the data batch, not gradients. Order the stages clip -> psum -> noise -> optimizer."
            )
    noised = False
    for name, info in flat[clip_at + 1 :]:
        if info is None:
            continue
        if info.kind == "noise":
            noised = True
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

    Args:
        stages: ``(name, StagePrivacy or None)`` of each stage, in order.
        sample_rate, steps, delta: Poisson sample rate, number of steps and delta; with
            all three, a Gaussian pipeline's epsilon is computed (PLD accountant).

    Returns:
        A :class:`PrivacyReport`.

    Privacy: reading only; the epsilon is that of Poisson-sampled DP-SGD with the
    pipeline's noise multiplier and the stated sampling (the accountant's assumptions).
    """
    flat = _flatten(stages, "")
    rows: list[StageReport] = []
    sens: float | None = None
    clipped = False
    released_unnoised = False
    nm: float | None = None
    mechanism: str | None = None
    clip_sens: float | None = None
    for name, info in flat:
        if info is None:
            note = "undescribed stage: a map of a ClippedPytree drops its guarantee (noise then refuses it)"
            rows.append(StageReport(name, "unknown", "", sens, None, note))
            continue
        std = None
        if info.kind == "clip":
            clipped = True
            sens = _effective(info.max_norm)
            clip_sens = sens
            note = "per-example clipping: sensitivity max_norm (add-or-remove-one)" + (
                "; known per step (adaptive; its noised count also costs privacy: no epsilon is reported, account "
                "with adaptive_clipping_gaussian or DPPlan)" if sens is None else ""
            )
        elif info.kind == "aggregate":
            note = "sum over ranks: each example lives on one rank, sensitivity unchanged"
        elif info.kind == "noise":
            nm, mechanism = info.noise_multiplier, info.mechanism
            factor = info.noise_sensitivity if info.noise_sensitivity is not None else 1.0
            std = None if sens is None or nm is None else nm * factor * sens
            note = (
                "noise_multiplier=0: explicit non-private baseline (epsilon = inf)"
                if nm == 0
                else f"{mechanism} mechanism, sigma={nm:g}" + (f" x strategy sensitivity {factor:.4g}" if factor != 1 else "")
            )
        elif info.kind == "optimizer":
            if clipped and nm is None:
                released_unnoised = True
                note = "releases clipped, un-noised gradients: not private"
            else:
                note = "post-processing of the noised gradient" if nm is not None else "post-processing"
        else:
            note = ""
        rows.append(StageReport(name, info.kind, info.description, sens, std, note))
    private = clipped and nm is not None and nm > 0 and not released_unnoised
    epsilon: float | None
    if not private:
        epsilon = math.inf
    elif mechanism == "gaussian" and _sensitivity_known(flat) and None not in (sample_rate, steps, delta):
        import opake_fx.dpsgd.accounting as dpsgd_acc  # lazily: accounting is optional for a report

        epsilon = (dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), sample_rate) * steps).epsilon_at(delta)
    else:
        epsilon = None
    return PrivacyReport(tuple(rows), private, clip_sens, nm, mechanism, epsilon, delta)


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

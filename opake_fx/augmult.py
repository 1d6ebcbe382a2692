"""Augmentation multiplicity: each example's gradient averaged over K augmented copies before clipping.

De et al. (2022, "Unlocking high-accuracy differentially private image classification
through scale", section 3.1) average the gradient of each example over ``K`` augmented
copies of it *before* the per-example clip. The average is still a function of that one
example, so its clipped contribution is still at most ``C``: the sensitivity, the noise
and the accounting are those of plain DP-SGD, while the per-example gradient has less
augmentation variance and the model sees ``K`` times more augmented views per step.

The gradient of a mean is the mean of the gradients, so the average is taken on the
*loss*: :func:`augmult_loss` turns ``loss_fn`` into one that takes ``K`` copies of each
example (``x`` of shape ``[B, K, ...]``) and returns each example's loss averaged over its
copies. The model is called ``K`` times, each on a batch of ``B`` rows (copy ``k`` of every
example), so every clipping backend (``vmap``, ``ghost``, ``auto``) sees the batch it
expects and treats the ``K`` calls as repeated uses of the same layers (exact per-example
norms; ``tests/utility/test_augmult.py`` checks them against a per-example loop).
:func:`augmult` is the clip stage that augments the batch with a keyed augmentation and
clips the averaged gradients; ``microbatch_size`` bounds the memory to ``microbatch_size * K``
rows.

Privacy contract: the augmentation must act on each example alone — row ``i`` of
``augment(keys, x)`` may depend only on ``x[i]`` and ``keys[i]`` (a shift, a crop, a flip;
never mixup or batch statistics). :func:`augmult` checks this on the first batch it sees
(:func:`check_per_example`: an example augmented alone must come out as in the batch, and
the reversed batch must give the reversed output) and refuses an augmentation that mixes
rows. The keys come from the stage's own key, never from the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.random import RngKey, fold_in, key_data, normal, split, uniform
from opake_fx.transforms import Transform
from opake_fx.typing import typechecked

__all__ = ["AugmultState", "augment_copies", "augmult", "augmult_loss", "check_per_example", "gaussian_noise", "random_shift"]

Augment = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_multiplicity(multiplicity: Any) -> int:
    if isinstance(multiplicity, bool) or not isinstance(multiplicity, int) or multiplicity < 1:
        raise InputValueError(
            f"augmentation multiplicity must be an int >= 1 (the number of augmented copies per example); "
            f"got {multiplicity!r}."
        )
    return multiplicity


@typechecked
def augment_copies(augment: Augment, x: torch.Tensor, multiplicity: int, key: RngKey) -> torch.Tensor:
    """``multiplicity`` augmented copies of every example: ``[B, ...] -> [B, K, ...]``.

    Copy ``k`` of example ``i`` is row ``i`` of ``augment(keys_k, x)``, where ``keys_k`` is a
    ``[B, 2]`` key tensor with a distinct key per example and copy, all split from ``key``.

    Args:
        augment: ``augment(keys [B, 2], x [B, ...]) -> [B, ...]``, acting on each row alone
            with that row's key (see :func:`random_shift`).
        x: the batch, examples along dimension 0.
        multiplicity: ``K >= 1``.
        key: this step's augmentation key (fold the step in: ``fold_in(key, step)``).

    Privacy: none by itself; the copies of example ``i`` depend only on ``x[i]`` (when
    ``augment`` keeps its contract) and on keys independent of the data.

    Example:
        >>> from opake_fx.random import key
        >>> x = torch.arange(2.0).reshape(2, 1)
        >>> augment_copies(lambda keys, x: x + 1, x, 3, key(0)).shape
        torch.Size([2, 3, 1])
    """
    k = _check_multiplicity(multiplicity)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise InputTypeError(f"augment_copies needs a tensor batch with the examples along dimension 0; got {type(x).__name__}.")
    if not isinstance(key, RngKey):
        raise InputTypeError(f"augment_copies needs an RngKey (opake_fx.random.key); got {type(key).__name__}.")
    b = x.shape[0]
    if b == 0:  # an empty Poisson batch: no copies to draw
        return x.unsqueeze(1).expand(0, k, *x.shape[1:]).clone()
    keys = split(key_data(key), b * k).reshape(b, k, 2)
    copies = []
    for j in range(k):
        out = augment(keys[:, j], x)
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            raise InputValueError(
                f"augment(keys, x) must return a tensor of x's shape {tuple(x.shape)}; got "
                f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}."
            )
        copies.append(out)
    return torch.stack(copies, dim=1)


def check_per_example(augment: Augment, x: torch.Tensor, key: RngKey) -> None:
    """Refuses an augmentation whose output rows depend on other rows (mixup, batch statistics).

    Two checks on this batch: the first and the last example augmented *alone* (with
    their keys) must come out exactly as they do in the batch (this catches batch
    statistics such as a batch mean, which a permutation leaves unchanged); and the batch
    reversed, keys reversed too, must give the output reversed (this catches an
    augmentation that pairs rows by position, such as mixing each row with the next). A
    row-wise augmentation passes both exactly. A check on one batch is evidence, not
    proof: keep the contract by construction.

    Raises:
        InputValueError: the augmentation is not row-wise on this batch.

    Example:
        >>> from opake_fx.random import key
        >>> x = torch.arange(12.0).reshape(4, 3)
        >>> check_per_example(lambda keys, x: x * 2, x, key(0))       # row-wise: passes
        >>> check_per_example(lambda keys, x: x - x.mean(0), x, key(0))
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputValueError: augment(keys, x) mixes examples ...
    """
    b = x.shape[0]
    if b < 2:
        return
    keys = split(key_data(key), b)
    flip = torch.arange(b - 1, -1, -1)
    direct = augment(keys, x)
    alone_ok = all(torch.equal(augment(keys[i:i + 1], x[i:i + 1])[0], direct[i]) for i in (0, b - 1))
    if not alone_ok or not torch.equal(direct[flip], augment(keys[flip], x[flip])):
        raise InputValueError(
            "augment(keys, x) mixes examples (...): an example augmented alone differs from the same example "
            "augmented in the batch, or reversing the batch and its keys did not reverse the output, so row i "
            "depends on other rows (mixup, batch statistics, a key shared across rows). Per-example clipping bounds "
            "one example's contribution only if its augmented copies depend on it alone; use a row-wise "
            "augmentation that draws its randomness from keys[i]."
        )


def augmult_loss(loss_fn: Callable[..., Any], *, per_example: bool) -> Callable[..., Any]:
    """``loss_fn`` averaged over the ``K`` augmented copies of each example.

    The first batch argument (position 1) carries the copies: ``[B, K, ...]`` for a batch
    loss (``clip_backend="ghost"``/``"auto"``; ``loss_fn`` returns per-example losses
    ``[B]``), ``[K, ...]`` for a per-example loss (``per_example=True``, ``clip_backend=
    "vmap"``). The wrapped loss calls ``loss_fn`` once per copy with the copy in place of
    the example and returns the mean over the copies; the other arguments (labels) are
    passed unchanged. Its gradient is therefore the mean of the copies' gradients.

    Privacy: example ``i``'s averaged loss depends only on its own copies, so per-example
    clipping of its gradient bounds its contribution by ``C`` as for one copy.

    Example:
        >>> f = lambda p, x, y: ((x * p).sum(-1) - y) ** 2           # per-example losses [B]
        >>> g = augmult_loss(f, per_example=False)
        >>> x = torch.ones(2, 3, 4)                                    # B=2, K=3 copies
        >>> g(torch.ones(4), x, torch.zeros(2)).tolist()
        [16.0, 16.0]
    """
    if not callable(loss_fn):
        raise InputTypeError(f"augmult_loss needs a callable loss_fn; got {type(loss_fn).__name__}.")
    axis = 0 if per_example else 1

    def averaged(params: Any, x: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        if x.dim() <= axis:
            raise InputValueError(
                f"the augmult loss expects its first batch argument with the copies along dimension {axis} "
                f"({'[K, ...] per example' if per_example else '[B, K, ...]'}); got shape {tuple(x.shape)}."
            )
        k = x.shape[axis]
        total = None
        for j in range(k):
            loss = loss_fn(params, x.select(axis, j), *rest, **kwargs)
            total = loss if total is None else total + loss
        return total / k

    return averaged


@dataclass(frozen=True)
class AugmultState:
    """The state of an :func:`augmult` stage: the clip stage's state, the augmentation key and the step.

    A frozen dataclass: it checkpoints through :mod:`opake_fx.serialization` as it is.
    """

    clip_state: Any
    key: RngKey
    step: int = 0


@typechecked
def augmult(
    loss_fn: Callable[..., Any],
    *,
    augment: Augment,
    multiplicity: int,
    key: RngKey,
    clip_fn: Callable[..., Transform] | None = None,
    clip_backend: str = "vmap",
    batch_argnums: int | Sequence[int] = 1,
    **clip_kwargs: Any,
) -> Transform:
    """A clip stage whose per-example gradients are averaged over ``multiplicity`` augmented copies.

    ``update(batch, state, params)`` draws the step's key ``fold_in(key, step)``, replaces
    the batch's first tensor ``x [B, ...]`` by :func:`augment_copies` ``[B, K, ...]`` and
    runs the clip stage ``clip_fn(augmult_loss(loss_fn), ...)`` on it. ``loss_fn`` is
    written as for the plain clip stage (one example for ``"vmap"``, the whole batch with
    per-example losses for ``"ghost"``/``"auto"``); everything else (``clipping_norm``,
    ``normalize_by``, ``model``, ``microbatch_size`` ...) goes to ``clip_fn``
    (default :func:`opake_fx.dpsgd.clip`; :func:`~opake_fx.dpsgd.auto_clip` and
    :func:`~opake_fx.dpsgd.adaptive_clip` work the same way). On the first batch the
    stage checks that ``augment`` acts row by row (:func:`check_per_example`).

    Args:
        loss_fn: the loss of one (un-augmented) example or batch.
        augment: ``augment(keys [B, 2], x [B, ...]) -> [B, ...]``, row ``i`` from ``x[i]``
            and ``keys[i]`` alone (e.g. :func:`random_shift`).
        multiplicity: ``K >= 1`` copies per example (``K = 1``: one augmented copy).
        key: the augmentation key (independent of the noise key).
        clip_fn: the clip stage factory.
        clip_backend: as for the clip stage.
        batch_argnums: as for the clip stage (``1..k``; the copies go in position 1).
        **clip_kwargs: the clip stage's other arguments.

    Privacy: the output sensitivity of the wrapped clip stage (``clipping_norm /
    normalize_by``): each example's averaged gradient is clipped as one gradient. The
    augmentation keys are not secret and carry nothing about the data.

    Example:
        >>> from opake_fx.dpsgd import clip
        >>> from opake_fx.random import key
        >>> f = lambda p, x, y: ((x * p).sum() - y) ** 2               # one example (vmap)
        >>> stage = augmult(f, augment=lambda keys, x: x + 0.1 * uniform(keys, (x.shape[1],)),
        ...                 multiplicity=4, key=key(0), clipping_norm=1.0, batch_argnums=(1, 2))
        >>> p = torch.zeros(3)
        >>> out, state = stage.update((torch.ones(5, 3), torch.ones(5)), stage.init(p), p)
        >>> out.max_norm, state.step
        (1.0, 1)
    """
    from opake_fx.dpsgd import clip as default_clip

    k = _check_multiplicity(multiplicity)
    if not callable(augment):
        raise InputTypeError(f"augmult needs augment(keys, x) to be callable; got {type(augment).__name__}.")
    if not isinstance(key, RngKey):
        raise InputTypeError(f"augmult needs an RngKey for the augmentation (opake_fx.random.key); got {type(key).__name__}.")
    factory = default_clip if clip_fn is None else clip_fn
    inner = factory(augmult_loss(loss_fn, per_example=clip_backend == "vmap"), clip_backend=clip_backend,
                    batch_argnums=batch_argnums, **clip_kwargs)
    checked = [False]

    def init(params: Any) -> AugmultState:
        return AugmultState(inner.init(params), key, 0)

    def update(batch: Any, state: AugmultState, params: Any = None, **extra: Any) -> tuple[Any, AugmultState]:
        if not isinstance(state, AugmultState):
            raise InputTypeError(f"the augmult stage needs its own AugmultState (from init); got {type(state).__name__}.")
        batch_t = batch if isinstance(batch, tuple) else (batch,)
        step_key = fold_in(state.key, state.step)
        x = batch_t[0]
        if not checked[0] and x.shape[0] >= 2:
            check_per_example(augment, x, fold_in(step_key, 2**32))
            checked[0] = True
        copies = augment_copies(augment, x, k, step_key)
        out, clip_state = inner.update((copies, *batch_t[1:]), state.clip_state, params, **extra)
        return out, AugmultState(clip_state, state.key, state.step + 1)

    return Transform(init, update, inner.privacy)


def random_shift(keys: torch.Tensor, x: torch.Tensor, max_shift: int = 1, fill: float = 0.0) -> torch.Tensor:
    """Shifts each image ``[B, C, H, W]`` by its own random offset in ``[-max_shift, max_shift]^2``.

    Row ``i`` uses ``keys[i]`` only: an augmentation fit for :func:`augmult`. The pixels
    shifted in take the value ``fill`` (the background: ``-mean / std`` for standardised
    images whose background was 0).

    Example:
        >>> from opake_fx.random import key, key_data, split
        >>> x = torch.arange(9.0).reshape(1, 1, 3, 3)
        >>> y = random_shift(split(key_data(key(0)), 1), x)
        >>> y.shape, sorted(set(y.flatten().tolist()) - set(x.flatten().tolist()))
        (torch.Size([1, 1, 3, 3]), [])
    """
    if x.dim() != 4:
        raise InputValueError(f"random_shift needs images [B, C, H, W]; got shape {tuple(x.shape)}.")
    if isinstance(max_shift, bool) or not isinstance(max_shift, int) or max_shift < 0:
        raise InputValueError(f"random_shift needs an int max_shift >= 0; got {max_shift!r}.")
    m = max_shift
    if m == 0 or x.shape[0] == 0:
        return x.clone()
    span = 2 * m + 1
    u = uniform(keys, (2,))  # [B, 2]
    off = torch.clamp((u * span).long(), max=span - 1)  # [B, 2] in 0..2m
    h, w = x.shape[-2:]
    padded = torch.nn.functional.pad(x, (m, m, m, m), value=fill)
    out = torch.empty_like(x)
    for dy in range(span):
        for dx in range(span):
            rows = ((off[:, 0] == dy) & (off[:, 1] == dx)).nonzero().flatten()
            if rows.numel():
                out[rows] = padded[rows, :, dy:dy + h, dx:dx + w]
    return out


def gaussian_noise(keys: torch.Tensor, x: torch.Tensor, std: float = 0.3) -> torch.Tensor:
    """Adds ``N(0, std^2)`` noise to each input, row ``i`` drawn from ``keys[i]`` alone.

    On scikit-learn's digits (whose 8x8 images fill their frame, so pixel shifts lose
    strokes) this is the augmentation with which augmult helped: docs/utility.md.

    Example:
        >>> from opake_fx.random import key, key_data, split
        >>> x = torch.zeros(3, 1, 2, 2)
        >>> check_per_example(gaussian_noise, x, key(0))
        >>> gaussian_noise(split(key_data(key(0)), 3), x).shape
        torch.Size([3, 1, 2, 2])
    """
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std >= 0:
        raise InputValueError(f"gaussian_noise needs std >= 0; got {std!r}.")
    if x.shape[0] == 0:
        return x.clone()
    return x + float(std) * normal(keys, tuple(x.shape[1:]), dtype=x.dtype, device=x.device)

"""The shared machinery behind every clipping function.

A clipping function is fixed by three things: a *backend* that yields per-example
gradients (or what is needed to weight them), a *scale rule* that turns per-example
gradient norms into per-example weights, and a *state update*. This module does the
rest: each call's argument checks, microbatching, the empty batch, norms that neither
overflow nor underflow, the non-finite policy, float32 accumulation and the output
wrapper. The function's own options are checked once, when it is made
(:meth:`.options.ClipConfig.of`).

Non-finite policy: an example whose gradient contains a NaN or an inf gets weight 0
(its contribution is exactly zero, so the sensitivity bound still holds) and is
counted in ``num_nonfinite``; it never propagates into the sum.

Certified norms: every per-example norm that decides a weight is an upper bound of the
norm of what the weighted sum adds for that example, after rounding (see
:mod:`._certified`): float64 accumulation, the rounding bounds of Gram products and of
the weighted sum itself; the weights are then taken from these norms times ``1 + 4u``
(the casts and products between a weight and the output). So each example's
contribution is at most ``C`` as computed in floating point, on every backend, whatever
the inputs. The reported ``grad_norms`` are the certified norms (above the exact norms
by a relative ~1e-15 in float64; in float32, up to ~1e-4 on long sequences through the
ghost norms, whose weighted sum rounds over positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch

from opake_fx.dpsgd.clipping import _certified as cert
from opake_fx.dpsgd.clipping._per_example import autograd_grad, map_examples
from opake_fx.dpsgd.clipping.options import ClipConfig
from opake_fx.dpsgd.clipping.types import ClippedGradAux, ClippingStats
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pytree import NAMESPACE, safe_norm, tree_flatten_with_paths
from opake_fx.types import ClippedPytree, PerGroup, SecondMomentClippingOutput

Norms = torch.Tensor  # float64, shape [G, B]
WeightFn = Callable[[Norms, torch.Tensor], torch.Tensor]  # (norms [G,B], bounds [G]) -> weights [G,B]


@dataclass
class PerExample:
    """What a backend returns for one (micro)batch."""

    grad_leaves: list[torch.Tensor]  # each [B, *param_shape]
    losses: torch.Tensor  # [B]
    loss_aux: Any


@dataclass
class PerExampleNorms:
    """What a norm-based backend (``clip_backend="ghost"`` / ``"auto"``) returns for one (micro)batch.

    Instead of per-example gradients it returns their squared L2 norms, leaf by leaf,
    and a function that forms the weighted sum ``sum_i w_i g_i`` of every leaf without
    ever materialising the ``g_i`` (see :mod:`opake_fx.dpsgd.clipping._ghost`).
    """

    sq_norms: torch.Tensor  # [L, B] float64: squared norm of each leaf's per-example gradient
    # (weights [L, B], keep [B] bool or None when every example is finite) -> L sums
    weighted_sum: Callable[[torch.Tensor, torch.Tensor | None], list[torch.Tensor]]
    losses: torch.Tensor  # [B]
    loss_aux: Any


Backend = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any], ClipConfig], "PerExample | PerExampleNorms"]


def vmap_backend(loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ClipConfig) -> PerExample:
    """Per-example gradients with ``torch.func.vmap(grad(loss_fn))``."""

    def scalar_loss(*a: Any) -> tuple[torch.Tensor, tuple[Any, ...]]:
        out = loss_fn(*a, **kwargs)
        loss, aux = out if cfg.has_aux else (out, None)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise InputValueError(
                "loss_fn must return a scalar tensor for ONE example (it is vmapped over the batch); got "
                f"{'shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else type(loss).__name__}. "
                "Reduce the example's loss to a scalar, e.g. with .squeeze() or .sum()."
            )
        return loss, ((loss.detach(), aux) if cfg.has_aux else (loss.detach(),))

    argnums = cfg.argnums[0] if cfg.single_argnum else cfg.argnums
    grad_fn = torch.func.grad(scalar_loss, argnums=argnums, has_aux=True)
    loop_fn = autograd_grad(scalar_loss, argnums=argnums, has_aux=True)
    if cfg.pre_clip is not None:
        grad_fn, loop_fn = _with_pre_clip(grad_fn, cfg.pre_clip), _with_pre_clip(loop_fn, cfg.pre_clip)
    in_dims = tuple(0 if i in cfg.batch_argnums else None for i in range(len(args)))
    # randomness="different": dropout draws its own mask for each example, as in a batched pass;
    # where vmap cannot run the loss, an exact loop over the examples does (with a warning).
    grads, extras = map_examples(grad_fn, in_dims, args, batch_size_of(args, cfg), what="loss_fn", loop_fn=loop_fn)
    return PerExample(optree.tree_leaves(grads, namespace=NAMESPACE), extras[0], extras[1] if cfg.has_aux else None)


@dataclass(frozen=True)
class StepResult:
    """Everything one call computed, before it is packaged for the caller."""

    clipped: ClippedPytree
    norms: Norms  # [G, B] float64, pre-clipping (after pre_clip)
    weights: torch.Tensor  # [G, B] float64
    bounds: torch.Tensor  # [G] float64, the clip norm of each group
    finite: torch.Tensor  # [B] bool
    losses: torch.Tensor
    loss_aux: Any
    batch_size: int  # rows in the call, padding included
    squared: ClippedPytree | None = None  # sum of clipped squared gradients (second_moment)
    valid: torch.Tensor | None = None  # [B] bool: the real examples (None: every row is one)

    @property
    def counted(self) -> torch.Tensor:
        """``[B]`` bool: the examples that contribute (finite and not padding)."""
        return self.finite if self.valid is None else self.finite & self.valid

    @property
    def examples(self) -> int:
        """The number of real (non-padding) examples (a host synchronisation with a mask)."""
        return self.batch_size if self.valid is None else int(self.valid.sum())


@dataclass(frozen=True)
class StaticPlan:
    """What one call derives from the parameters' structure and the clip norm alone.

    Kept per clipped-gradient function, keyed by the tree structure, each leaf's dtype
    and device, and the clip norm (its value; a ``PerGroup`` by identity, held here so
    the identity cannot be reused). A key that matches means the leaves passed the
    argument checks before: every leaf is a floating-point tensor (only tensors have a
    dtype in the key), so the checks are not repeated.
    """

    group_names: list[str]
    leaf_group: list[int]
    out_dtypes: list[torch.dtype]
    output_factor: float  # roundings between a weight and the output, in the least precise dtype
    bounds: torch.Tensor  # [G] float64 on the CPU: the clip norm of each group
    clipping_norm: float | PerGroup


def _static_plan(args: tuple[Any, ...], cfg: ClipConfig, clipping_norm: float | PerGroup, diff_leaves: list[Any],
                 treedef: Any, plans: dict[Any, StaticPlan] | None) -> StaticPlan:
    key: Any = None
    if torch.compiler.is_compiling():
        plans = None  # traced once per signature; the cache's treedef keys cannot be traced
    if plans is not None and all(isinstance(leaf, torch.Tensor) for leaf in diff_leaves):
        norm_key = ("groups", id(clipping_norm)) if isinstance(clipping_norm, PerGroup) else float(clipping_norm)
        key = (treedef, tuple((leaf.dtype, leaf.device) for leaf in diff_leaves), norm_key)
        found = plans.get(key)
        if found is not None:
            return found
    _check_args(args, cfg)
    if isinstance(clipping_norm, PerGroup):
        paths, _, _ = tree_flatten_with_paths(diff_tree(args, cfg))
        group_names, leaf_group = _leaf_groups(clipping_norm, paths)
        bounds = torch.tensor([clipping_norm.values[g] for g in group_names], dtype=torch.float64)
    else:
        group_names, leaf_group = ["all"], [0] * len(diff_leaves)
        bounds = torch.tensor([float(clipping_norm)], dtype=torch.float64)
    out_dtypes = [cfg.dtype or _accumulation_dtype(leaf.dtype) for leaf in diff_leaves]
    output_factor = max([1.0] + [cert.output_factor(dt) for dt in out_dtypes])
    plan = StaticPlan(group_names, leaf_group, out_dtypes, output_factor, bounds, clipping_norm)
    if key is not None:
        if len(plans) >= 16:  # an adaptive clip norm changes every step: keep the cache small
            plans.clear()
        plans[key] = plan
    return plan


def clipped_step(
    loss_fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cfg: ClipConfig,
    *,
    clipping_norm: float | PerGroup,
    weight_fn: WeightFn,
    backend: Backend = vmap_backend,
    plans: dict[Any, StaticPlan] | None = None,
    example_mask: torch.Tensor | None = None,
) -> StepResult:
    """Runs one clipped-gradient computation (all microbatches) and returns its parts.

    ``plans`` (one dict per clipped-gradient function) keeps what depends only on the
    parameters' structure and dtypes and on the clip norm (:class:`StaticPlan`), so a
    call with the same structure skips its checks and derivations. ``example_mask``
    (``[B]`` bool) marks the real examples of a padded batch: the others get weight 0,
    so their contribution is exactly zero whatever they hold.
    """
    _check_arg_count(args, cfg)
    diff_leaves, treedef = optree.tree_flatten(diff_tree(args, cfg), namespace=NAMESPACE)
    static = _static_plan(args, cfg, clipping_norm, diff_leaves, treedef, plans)
    group_names, leaf_group, out_dtypes = static.group_names, static.leaf_group, static.out_dtypes
    output_factor = static.output_factor
    bounds = static.bounds
    batch = batch_size_of(args, cfg)
    valid = check_example_mask(example_mask, batch, diff_leaves[0].device if diff_leaves else None)
    # Accumulators are created by the first microbatch (no zero-fill pass over large tables).
    sums: list[torch.Tensor | None] = [None] * len(diff_leaves)
    sq_sums: list[torch.Tensor | None] = [None] * len(diff_leaves)  # second_moment only
    prescaled = False  # norm-based backends fold 1 / normalize_by into the weights
    all_norms, all_weights, all_finite, all_losses, all_aux = [], [], [], [], []
    step = cfg.microbatch_size or max(batch, 1)
    for start in range(0, batch, step):
        chunk = _slice_batch(args, cfg, start, min(start + step, batch), batch)
        per_ex = backend(loss_fn, chunk, kwargs, cfg)
        if isinstance(per_ex, PerExampleNorms):
            norms = _norms_from_squares(per_ex.sq_norms, leaf_group, len(group_names))
        else:
            norms = group_norms(per_ex.grad_leaves, leaf_group, len(group_names))
        finite = torch.isfinite(norms).all(dim=0)
        keep = finite if valid is None else finite & valid[start:start + step].to(finite.device)
        # One host sync in eager code (the common case skips the masking); a traced step or a
        # padded batch always masks, on the device. So do the norm-based backends, whose steady
        # step makes no host synchronisation at all.
        none_bad = (valid is None and not torch.compiler.is_compiling() and not isinstance(per_ex, PerExampleNorms)
                    and bool(finite.all()))
        weights = weight_fn(norms * output_factor, bounds.to(norms.device))
        if not none_bad:
            weights = torch.where(keep.unsqueeze(0), weights, torch.zeros_like(weights))
        if isinstance(per_ex, PerExampleNorms):
            prescaled = True
            if len(group_names) == 1:  # one group: every leaf takes the same weights (no gather)
                scaled = weights / cfg.normalize_by
                if len(set(out_dtypes)) == 1:  # cast once, not once per leaf (rules compute in >= float32)
                    scaled = scaled.to(torch.promote_types(out_dtypes[0], torch.float32))
                leaf_weights = scaled.expand(len(leaf_group), -1)
            else:
                leaf_weights = weights[torch.tensor(leaf_group, dtype=torch.long, device=weights.device)] / cfg.normalize_by
            for i, part in enumerate(per_ex.weighted_sum(leaf_weights, None if none_bad else keep)):
                part = part.to(out_dtypes[i])
                sums[i] = part if sums[i] is None else sums[i].add_(part)
        else:
            if cfg.pre_clip is not None:
                _check_pre_clip_output(per_ex.grad_leaves, diff_leaves)
            sanitize = not none_bad
            for i, g_leaf in enumerate(per_ex.grad_leaves):
                if sanitize:  # zero what has weight 0 (0 * inf is NaN): non-finite rows and padding
                    g_leaf = torch.where(keep.view(-1, *([1] * (g_leaf.dim() - 1))).to(g_leaf.device), g_leaf,
                                         torch.zeros((), dtype=g_leaf.dtype, device=g_leaf.device))
                # Weight in the wider of the gradient's and the output's dtype, and cast only what
                # is weighted: a gradient finite in float64 but beyond float32's range would become
                # inf in a float32 output, and its tiny weight times inf is NaN -- one attacker
                # example would turn the whole release into NaN (present: NaN, absent: finite).
                wide = torch.promote_types(g_leaf.dtype, out_dtypes[i])
                w = weights[leaf_group[i]].to(device=g_leaf.device, dtype=wide)
                g_out = g_leaf.to(wide)
                term = torch.tensordot(w, g_out, dims=([0], [0])).to(out_dtypes[i])
                sums[i] = term if sums[i] is None else sums[i].add_(term)
                if cfg.second_moment:
                    # Square each example's clipped contribution w_i g_i (bounded by C), never g_i itself
                    # (whose square can overflow): ||(w g)^2||_2 <= ||w g||_2^2 <= C^2 per example.
                    clipped_ex = w.reshape(-1, *([1] * (g_out.dim() - 1))) * g_out
                    sq_term = clipped_ex.square_().sum(dim=0).to(out_dtypes[i])
                    sq_sums[i] = sq_term if sq_sums[i] is None else sq_sums[i].add_(sq_term)
        all_norms.append(norms)
        all_weights.append(weights)
        all_finite.append(finite)
        all_losses.append(per_ex.losses)
        all_aux.append(per_ex.loss_aux)
    device = diff_leaves[0].device if diff_leaves else torch.device("cpu")
    if batch == 0:
        empty = torch.zeros((len(group_names), 0), dtype=torch.float64, device=device)
        all_norms, all_weights = [empty], [empty]
        all_finite, all_losses = [torch.zeros(0, dtype=torch.bool, device=device)], [torch.zeros(0, device=device)]
    norms = _cat(all_norms, dim=1)
    weights = _cat(all_weights, dim=1)
    totals = [
        torch.zeros(leaf.shape, dtype=dt, device=leaf.device) if s is None else (s if prescaled else s / cfg.normalize_by)
        for s, leaf, dt in zip(sums, diff_leaves, out_dtypes)
    ]
    grads = optree.tree_unflatten(treedef, totals)
    max_norm = clipping_norm / cfg.normalize_by
    squared = None
    if cfg.second_moment:
        sq_totals = [
            torch.zeros(leaf.shape, dtype=dt, device=leaf.device) if s is None else s / cfg.normalize_by
            for s, leaf, dt in zip(sq_sums, diff_leaves, out_dtypes)
        ]
        squared = ClippedPytree(optree.tree_unflatten(treedef, sq_totals), max_norm=squared_max_norm(clipping_norm, cfg.normalize_by))
    return StepResult(
        clipped=ClippedPytree(grads, max_norm=max_norm),
        norms=norms,
        weights=weights,
        bounds=bounds,
        finite=_cat(all_finite),
        losses=_cat(all_losses),
        loss_aux=_concat_aux(all_aux) if cfg.has_aux and batch > 0 else None,
        batch_size=batch,
        squared=squared,
        valid=valid,
    )


def squared_max_norm(clipping_norm: float, normalize_by: float) -> float:
    """The sensitivity ``C**2 / normalize_by`` of the sum of clipped squared gradients.

    One example's clipped gradient ``v`` has ``||v||_2 <= C``, and its elementwise square
    has ``||v * v||_2 = (sum_j v_j**4) ** 0.5 <= sum_j v_j**2 = ||v||_2**2 <= C**2``.
    """
    return float(clipping_norm) ** 2 / normalize_by


def package(result: StepResult, cfg: ClipConfig, clipping_norm: float | PerGroup, new_state: Any) -> Any:
    """Builds the caller-facing return value from a :class:`StepResult`."""
    released: Any = result.clipped
    if result.squared is not None:
        released = SecondMomentClippingOutput(result.clipped, result.squared)
    if not (cfg.return_aux or cfg.return_stats):
        if cfg.has_aux:
            return (released, result.loss_aux), new_state
        return released, new_state
    norms, weights, batch = result.norms, result.weights, result.examples
    finite, counted = result.finite, result.counted
    clipped_mask = (norms > result.bounds.to(norms.device).unsqueeze(1)) & counted.unsqueeze(0)
    num_nonfinite = int((~finite).sum()) if result.valid is None else int((~finite & result.valid).sum())
    if isinstance(clipping_norm, PerGroup):
        names = sorted(clipping_norm.values)
        num_clipped: Any = {n: float(clipped_mask[i].sum()) for i, n in enumerate(names)}
        rate: Any = {n: (v / batch if batch else 0.0) for n, v in num_clipped.items()}
    else:
        num_clipped = float(clipped_mask[0].sum())
        rate = num_clipped / batch if batch else 0.0
    if cfg.return_stats:
        return (released, ClippingStats(num_clipped, rate, batch, num_nonfinite)), new_state
    total = norms.square().sum(dim=0).sqrt()
    after = torch.where(finite, (norms * weights).square().sum(dim=0).sqrt(), torch.zeros_like(total))
    losses = result.losses
    if result.valid is not None:  # padding reports zeros: it has no loss, norm or gradient
        valid = result.valid.to(total.device)
        total, after = torch.where(valid, total, 0.0), torch.where(valid, after, 0.0)
        norms = torch.where(valid.unsqueeze(0), norms, 0.0)
        losses = torch.where(result.valid.to(losses.device), losses, torch.zeros((), dtype=losses.dtype, device=losses.device))
    aux = ClippedGradAux(
        loss_values=losses,
        grad_norms=total,
        clipped_grad_norms=after,
        loss_aux=result.loss_aux,
        clipping_rate=None if isinstance(clipping_norm, PerGroup) else rate,
        batch_size=batch,
        group_norms={n: norms[i] for i, n in enumerate(sorted(clipping_norm.values))}
        if isinstance(clipping_norm, PerGroup)
        else None,
        num_nonfinite=num_nonfinite,
    )
    return (released, aux), new_state


def group_norms(grad_leaves: list[torch.Tensor], leaf_group: list[int], num_groups: int) -> Norms:
    """Per-example, per-group L2 norms ``[G, B]`` in float64, safe from over/underflow, each
    an upper bound of the exact norm of the stored gradients (float64 sums, whose rounding
    is covered by a ``1 + gamma`` factor)."""
    if not grad_leaves:
        raise InputValueError("nothing to differentiate: the differentiated arguments have no tensor leaves.")
    batch = grad_leaves[0].shape[0]
    leaf_norms = torch.stack([safe_norm(g.reshape(batch, -1), dim=1) for g in grad_leaves])  # [L, B]
    if num_groups == 1:
        norms = safe_norm(leaf_norms, dim=0).unsqueeze(0)
    else:  # the leaves of each group by a fixed index (no data-dependent shape: traceable)
        members = [[i for i, g in enumerate(leaf_group) if g == group] for group in range(num_groups)]
        norms = torch.stack([safe_norm(leaf_norms[m], dim=0) for m in members])
    longest = max(g[0].numel() if batch else 0 for g in grad_leaves) + len(grad_leaves)
    return norms * (1.0 + cert.gamma(longest + 4, torch.float64))


def check_example_mask(example_mask: Any, batch: int, device: torch.device | None) -> torch.Tensor | None:
    """Validates a padding mask: a bool tensor ``[batch]`` (True: a real example), or ``None``."""
    if example_mask is None:
        return None
    if not isinstance(example_mask, torch.Tensor) or example_mask.dtype != torch.bool or tuple(example_mask.shape) != (batch,):
        got = (f"a {example_mask.dtype} tensor of shape {tuple(example_mask.shape)}" if isinstance(example_mask, torch.Tensor)
               else type(example_mask).__name__)
        raise InputValueError(
            f"example_mask must be a bool tensor of shape [{batch}] (the batch size; True marks a real example, "
            f"False a padding row); got {got}. Build it with opake_fx.padding.pad_batch."
        )
    return example_mask if device is None else example_mask.to(device)


def batch_size_of(args: tuple[Any, ...], cfg: ClipConfig) -> int:
    """The common leading dimension of every batched argument (error if they differ)."""
    found: list[tuple[int, Any, int]] = []  # (argument, path, size); paths are formatted only for errors
    for i, p, leaf in _leaves_at(args, cfg.batch_argnums):
        if not isinstance(leaf, torch.Tensor):
            raise InputTypeError(
                f"batched argument {i} has a non-tensor leaf at {p} ({type(leaf).__name__}); every leaf of "
                "a batch_argnums argument must be a tensor with the batch as its first dimension."
            )
        if leaf.dim() == 0:
            raise InputValueError(
                f"batched argument {i} has a 0-dim tensor at {p}; batched tensors need a leading batch dimension."
            )
        found.append((i, p, leaf.shape[0]))
    if not found:
        raise InputValueError(f"batch_argnums={cfg.batch_argnums} name arguments with no tensors; nothing to batch over.")
    size = found[0][2]
    if any(n != size for _, _, n in found):
        detail = ", ".join(f"argument {i}{''.join(f'[{k!r}]' for k in p)}: {n}" for i, p, n in found)
        raise InputValueError(
            f"batched arguments disagree on the batch size ({detail}). Every batch_argnums tensor must have "
            "the same first dimension; check that inputs and labels come from the same batch."
        )
    return size


# --- private helpers ---------------------------------------------------------------


def _norms_from_squares(sq_norms: torch.Tensor, leaf_group: list[int], num_groups: int) -> Norms:
    """Per-group norms ``[G, B]`` from per-leaf squared norms ``[L, B]`` (float64)."""
    if sq_norms.shape[0] == 0:
        raise InputValueError("nothing to differentiate: the differentiated arguments have no tensor leaves.")
    slack = 1.0 + cert.gamma(sq_norms.shape[0] + 4, torch.float64)  # the float64 sum over leaves, the sqrt
    if num_groups == 1:
        return sq_norms.to(torch.float64).sum(dim=0, keepdim=True).sqrt() * slack
    index = torch.tensor(leaf_group, dtype=torch.long, device=sq_norms.device)
    sq = torch.zeros((num_groups, sq_norms.shape[1]), dtype=torch.float64, device=sq_norms.device)
    return sq.index_add_(0, index, sq_norms.to(torch.float64)).sqrt() * slack


def _check_arg_count(args: tuple[Any, ...], cfg: ClipConfig) -> None:
    needed = max(cfg.argnums + cfg.batch_argnums) + 1
    if len(args) < needed:
        raise InputValueError(
            f"the clipped gradient function got {len(args)} positional arguments but argnums={cfg.argnums} "
            f"and batch_argnums={cfg.batch_argnums} need at least {needed}."
        )


def _check_args(args: tuple[Any, ...], cfg: ClipConfig) -> None:
    for a, p, leaf in _leaves_at(args, cfg.argnums):
        if not isinstance(leaf, torch.Tensor):
            raise InputTypeError(
                f"argument {a} (differentiated) has a non-tensor leaf at {p}: {type(leaf).__name__}. "
                "Parameters must be tensors; pass constants through a non-differentiated argument or a closure."
            )
        if not leaf.is_floating_point():
            raise InputTypeError(
                f"argument {a} (differentiated) has a {leaf.dtype} leaf at {p}; only floating-point tensors "
                "can be differentiated."
            )


def _leaves_at(args: tuple[Any, ...], positions: tuple[int, ...]) -> list[tuple[int, tuple[Any, ...], Any]]:
    """Every leaf of the arguments at ``positions``, in order, as ``(position, path, leaf)``."""
    found: list[tuple[int, tuple[Any, ...], Any]] = []
    for i in positions:
        paths, flat, _ = tree_flatten_with_paths(args[i])
        found += [(i, p, leaf) for p, leaf in zip(paths, flat)]
    return found


def diff_tree(args: tuple[Any, ...], cfg: ClipConfig) -> Any:
    """The differentiated argument(s) of a call: ``args[argnums]``, a tuple of them for several."""
    return args[cfg.argnums[0]] if cfg.single_argnum else tuple(args[a] for a in cfg.argnums)


def _leaf_groups(clipping_norm: float | PerGroup, paths: list[tuple[Any, ...]]) -> tuple[list[str], list[int]]:
    if not isinstance(clipping_norm, PerGroup):
        return ["all"], [0] * len(paths)
    names = sorted(clipping_norm.values)
    index = {n: i for i, n in enumerate(names)}
    missing = [p for p in paths if p not in clipping_norm.groups]
    if missing:
        raise InputValueError(
            f"per-group clipping: the parameter leaves at {missing[:5]}{'...' if len(missing) > 5 else ''} belong "
            "to no group. Build the PerGroup with opake_fx.dpsgd.clipping.per_group(params, ...) so every leaf "
            "is assigned (a catch-all pattern '*' helps)."
        )
    return names, [index[clipping_norm.groups[p]] for p in paths]


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Sums of many clipped gradients are kept in at least float32 (bf16/fp16 models too).
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def _slice_batch(args: tuple[Any, ...], cfg: ClipConfig, start: int, stop: int, batch: int) -> tuple[Any, ...]:
    if start == 0 and stop == batch:
        return args
    return tuple(
        optree.tree_map(lambda t: t[start:stop], a, namespace=NAMESPACE) if i in cfg.batch_argnums else a
        for i, a in enumerate(args)
    )


def _cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` that hands back a lone part as it is (the one-microbatch case)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _with_pre_clip(grad_fn: Callable[..., Any], pre_clip: Callable[[Any], Any]) -> Callable[..., Any]:
    """``grad_fn`` followed by ``pre_clip`` on the gradient of the one example it sees."""

    def transformed(*a: Any) -> Any:
        grads, extras = grad_fn(*a)
        out = pre_clip(grads)
        if optree.tree_structure(out, namespace=NAMESPACE) != optree.tree_structure(grads, namespace=NAMESPACE):
            raise InputValueError(
                "pre_clip must return a pytree with the same structure as the gradient it is given (the parameters' "
                f"structure); got {optree.tree_structure(out, namespace=NAMESPACE)} for "
                f"{optree.tree_structure(grads, namespace=NAMESPACE)}. Map each leaf, e.g. with opake_fx.pytree.tree_map."
            )
        return out, extras

    return transformed


def _check_pre_clip_output(grad_leaves: list[torch.Tensor], diff_leaves: list[torch.Tensor]) -> None:
    for i, (g, leaf) in enumerate(zip(grad_leaves, diff_leaves)):
        if not isinstance(g, torch.Tensor) or tuple(g.shape[1:]) != tuple(leaf.shape) or not g.is_floating_point():
            got = f"{g.dtype} of shape {tuple(g.shape[1:])}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise InputValueError(
                f"pre_clip must return, for each gradient leaf, a floating-point tensor of the parameter's shape; "
                f"leaf {i} has shape {tuple(leaf.shape)} but pre_clip returned a {got}."
            )


def _concat_aux(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    return optree.tree_map(lambda *xs: torch.cat(xs), *parts, namespace=NAMESPACE)

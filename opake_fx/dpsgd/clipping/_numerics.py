"""Numerics shared by the layer rules: compute dtypes, certified row norms, weighted sums.

Every rule of the fast clipping backends (:mod:`._registry`) hands the engine a
*layer gradient*: an object with

* ``sq_norm(name)``: certified squared per-example norms of parameter ``name``, float64 ``[B]``;
* ``certified(name)``: ``(certified squared norm of the exact gradient, rounding bound of
  the weighted sum)``, for parameters shared by several calls (:mod:`._tied`);
* ``weighted(name, w, keep)``: ``sum_i w_i dP_i`` in one pass (book-keeping, Bu et al. 2023);
  rows with ``keep = False`` contribute exactly zero, even when they hold NaN or inf;
* ``per_example(name)``: ``[B, *shape]``, for parameters shared by several calls;
* ``cross_form(name)``: what the call offers for cross terms with other calls of the
  same parameter (:func:`._tied.sum_of_uses`), or None.

:class:`PerExampleGrad` is that object for explicit per-example gradients (norm layers,
registered rules, fallbacks).

Privacy contract: :func:`sq_norms_of` bounds the norm of each row *as stored* from above
after rounding, and :func:`weighted_sum_of` reads exactly those rows, so a weight
``min(1, C / norm)`` bounds each example's contribution by ``C`` in floating point.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from opake_fx.dpsgd.clipping import _certified as cert

# Largest transient (in elements) that a rule builds at once: unfolded patches and
# Gram matrices are formed for slices of the batch under this bound. 2 MiB of float32:
# transients stay in cache and are reused by the allocator instead of being faulted in
# fresh each step (cnn-256 step, 2 threads: 61-84 ms at 2**23, 55-59 ms at 2**19).
CHUNK_ELEMS = 1 << 19
# Per-example weight gradients are formed this many elements at a time (about L2 size),
# so their norms are read back from cache.
CACHE_ELEMS = 1 << 18


class LayerGrad(Protocol):
    """What a rule builds for one call (see the module docstring)."""

    def sq_norm(self, name: str) -> torch.Tensor: ...

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]: ...

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor: ...

    def per_example(self, name: str) -> torch.Tensor: ...

    def cross_form(self, name: str) -> tuple[Any, ...] | None: ...


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype rules compute in: at least float32, so low-precision models sum exactly enough."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class PerExampleGrad:
    """A layer gradient from explicit per-example gradients ``{name: [B, *shape]}``.

    Example:
        >>> import torch
        >>> pe = PerExampleGrad({"w": torch.tensor([[3.0, 4.0], [0.0, 1.0]])})
        >>> [round(float(v), 6) for v in pe.sq_norm("w")]
        [25.0, 1.0]
        >>> pe.weighted("w", torch.tensor([0.2, 1.0]), None).tolist()
        [0.6000000238418579, 1.7999999523162842]
    """

    def __init__(self, grads: dict[str, torch.Tensor]) -> None:
        self.grads = grads
        self._sq: dict[str, torch.Tensor] = {}

    def sq_norm(self, name: str) -> torch.Tensor:
        if name not in self._sq:
            self._sq[name] = sq_norms_of(self.grads[name])
        return self._sq[name]

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sq_norm(name), torch.zeros_like(self.sq_norm(name))

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        return weighted_sum_of(self.grads[name], w, keep)

    def per_example(self, name: str) -> torch.Tensor:
        return self.grads[name]

    def cross_form(self, name: str) -> tuple[Any, ...]:
        """("pe", [B, ...], s = norm)."""
        return ("pe", self.per_example(name), self.sq_norm(name).sqrt())


def sq_norms_of(pe: torch.Tensor) -> torch.Tensor:
    """Certified squared L2 norm of each row of ``[B, ...]`` as stored, float64 ``[B]``
    (:func:`opake_fx.dpsgd.clipping._certified.sq_norms`)."""
    return cert.sq_norms(pe)


def weighted_sum_of(pe: torch.Tensor, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``sum_i w_i pe_i``; rows with ``keep = False`` contribute exactly zero."""
    if keep is not None:
        pe = zero_rows(pe, keep)
    return torch.matmul(as_dtype(w, pe.dtype), pe.reshape(pe.shape[0], -1)).reshape(pe.shape[1:])


@torch.library.custom_op("opake_fx::rows_summed_by_index", mutates_args=())
def rows_summed_by_index(n: int, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``zeros(n, *rows.shape[1:]).index_add_(0, index, rows)``: row ``index[k]`` of the result
    sums the ``rows[k]`` sent to it.

    An operator of its own so that ``torch.compile`` calls ATen's kernel instead of generating
    one: inductor's CPU code adds each element by an atomic operation (embbag-256, 16384 rows
    of 64 into a 20000-row table: 3.4 ms a step, against ATen's vectorised row additions).
    Not differentiable (the rules' weighted sums and rows are never differentiated).

    Example:
        >>> rows_summed_by_index(3, torch.tensor([2, 0, 2]), torch.tensor([[1.0], [2.0], [3.0]]))
        tensor([[2.],
                [0.],
                [4.]])
    """
    return rows.new_zeros((n, *rows.shape[1:])).index_add_(0, index, rows)


@rows_summed_by_index.register_fake
def _rows_summed_by_index_shape(n: int, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((n, *rows.shape[1:]))


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (no copy when it already is)."""
    return x if x.dtype == dtype else x.to(dtype)


def zero_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` with the rows where ``keep`` is False set to exactly zero (NaN and inf included)."""
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))


__all__ = ["CACHE_ELEMS", "CHUNK_ELEMS", "LayerGrad", "PerExampleGrad", "as_dtype", "compute_dtype",
           "rows_summed_by_index", "sq_norms_of", "weighted_sum_of", "zero_rows"]

"""Streaming multiplication by ``C^{-1}``: row ``t`` of ``C^{-1} Z`` one step at a time.

DP-FTRL adds ``(C^{-1} Z)_t`` to the gradient of step ``t``, where ``Z`` has i.i.d.
standard normal rows ``z_t`` (drawn from ``fold_in(key, t)`` by the noise stage). A
:class:`StreamingInverse` produces those rows with a small state of *parameter-sized
buffers*; ``memory`` says how many:

=========================  ==========================================  ===============
strategy                   recurrence                                  memory
=========================  ==========================================  ===============
identity (DP-SGD)          ``x_t = z_t``                               0
banded ``C`` (BandMF,      forward substitution over the band          ``bands - 1``
BSR; Toeplitz or not)
BLT                        ``x_t = z_t - sum_j w_j u_j``,              ``buffers``
                           ``u_j <- theta_j u_j + x_t``
banded ``C^{-1}`` (BISR)   ``x_t = sum_{j<p} d_{t,j} z_{t-j}``         ``p - 1``
banded ``C^{-1}``, replay  same, re-drawing ``z_{t-j}`` from the key   0
(lambda-CGD)
dense ``C``                forward substitution over all past rows     ``n - 1``
=========================  ==========================================  ===============

Buffers are stacked per parameter leaf: a state is a tuple with one tensor of shape
``(memory, *leaf.shape)`` per leaf. Updates are out of place by default (the state is a
value, as everywhere in opake_fx); ``inplace=True`` reuses the buffers' storage, which
halves the peak memory but invalidates the previous state.

Example:
    >>> import torch
    >>> from opake_fx.dpftrl import band_mf_strategy
    >>> s = band_mf_strategy(8, bands=2, max_iterations=5)
    >>> inv = s.inverse_noise()
    >>> inv.memory
    1
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = [
    "StreamingInverse",
    "IdentityInverse",
    "BandedSolve",
    "BltSolve",
    "BandedInverseApply",
    "DenseSolve",
]

Draw = Callable[[int], list[torch.Tensor]]
Buffers = tuple[torch.Tensor, ...]


class StreamingInverse:
    """Base class: ``init`` makes the buffers, ``next`` returns row ``t`` of ``C^{-1} Z``.

    ``next(t, draw, buffers)`` must be called for ``t = 0, 1, 2, ...`` in order;
    ``draw(s)`` returns the standard-normal leaves ``z_s`` of step ``s`` (a pure function
    of the key, so replaying ``draw(s)`` for ``s < t`` gives the same numbers).
    """

    memory: int = 0

    def init(self, leaves: Sequence[torch.Tensor]) -> Buffers:
        """Zero buffers shaped like ``leaves`` (an empty tuple when ``memory == 0``)."""
        if self.memory == 0:
            return ()
        return tuple(torch.zeros((self.memory, *leaf.shape), dtype=leaf.dtype, device=leaf.device) for leaf in leaves)

    def next(self, t: int, draw: Draw, buffers: Buffers, *, inplace: bool = False) -> tuple[list[torch.Tensor], Buffers]:
        raise NotImplementedError

    def memory_bytes(self, leaves: Sequence[torch.Tensor]) -> int:
        """Bytes held in buffers for parameters shaped like ``leaves``."""
        return self.memory * sum(leaf.numel() * leaf.element_size() for leaf in leaves)


class IdentityInverse(StreamingInverse):
    """``C = I``: the noise is ``z_t`` itself (DP-SGD)."""

    memory = 0

    def next(self, t: int, draw: Draw, buffers: Buffers, *, inplace: bool = False) -> tuple[list[torch.Tensor], Buffers]:
        return draw(t), buffers


class BandedSolve(StreamingInverse):
    """Forward substitution ``x_t = (z_t - sum_{j=1}^{b-1} C[t, t-j] x_{t-j}) / C[t, t]``.

    Args:
        diagonal: ``C[t, t]`` for every ``t`` (length ``n``), or one value (Toeplitz).
        lower: ``lower[t, j-1] = C[t, t-j]`` (shape ``(n, b-1)``), or ``(1, b-1)`` (Toeplitz).
    """

    def __init__(self, diagonal: np.ndarray, lower: np.ndarray) -> None:
        self._diag = np.asarray(diagonal, dtype=np.float64).reshape(-1)
        self._lower = np.asarray(lower, dtype=np.float64).reshape(self._diag.shape[0], -1)
        self.memory = self._lower.shape[1]

    def _row(self, t: int) -> tuple[float, np.ndarray]:
        i = t if self._diag.shape[0] > 1 else 0
        if i >= self._diag.shape[0]:
            raise IndexError(f"step {t} is beyond the strategy's n_steps={self._diag.shape[0]}.")
        return float(self._diag[i]), self._lower[i]

    def next(self, t: int, draw: Draw, buffers: Buffers, *, inplace: bool = False) -> tuple[list[torch.Tensor], Buffers]:
        diag, lower = self._row(t)
        z = draw(t)
        m = self.memory
        if m == 0:
            return [zi / diag for zi in z], buffers
        weights = np.zeros(m)
        for j in range(1, min(t, m) + 1):
            weights[(t - j) % m] = lower[j - 1]
        slot = t % m
        out, new = [], []
        for zi, buf in zip(z, buffers):
            w = torch.as_tensor(weights, dtype=buf.dtype, device=buf.device)
            x = (zi - torch.tensordot(w, buf, dims=1)) / diag if t > 0 else zi / diag
            out.append(x)
            new.append(_write(buf, slot, x, inplace))
        return out, tuple(new)


class BltSolve(StreamingInverse):
    """Buffered linear Toeplitz ``C`` (``C[t, t] = 1``, ``C[t, s] = sum_j w_j theta_j^(t-s-1)``).

    Solves ``C x = z`` with one buffer per ``theta_j`` (Dvijotham et al. 2024; Alg. 3 of
    arXiv:2408.08868): ``x_t = z_t - sum_j w_j u_j``, then ``u_j <- theta_j u_j + x_t``.
    """

    def __init__(self, buf_decay: np.ndarray, output_scale: np.ndarray) -> None:
        self._theta = np.asarray(buf_decay, dtype=np.float64)
        self._omega = np.asarray(output_scale, dtype=np.float64)
        self.memory = int(self._theta.shape[0])

    def next(self, t: int, draw: Draw, buffers: Buffers, *, inplace: bool = False) -> tuple[list[torch.Tensor], Buffers]:
        z = draw(t)
        if self.memory == 0:
            return z, buffers
        out, new = [], []
        for zi, buf in zip(z, buffers):
            shape = (self.memory,) + (1,) * zi.dim()
            omega = torch.as_tensor(self._omega, dtype=buf.dtype, device=buf.device)
            theta = torch.as_tensor(self._theta, dtype=buf.dtype, device=buf.device).reshape(shape)
            x = zi - torch.tensordot(omega, buf, dims=1)
            out.append(x)
            if inplace:
                new.append(buf.mul_(theta).add_(x.unsqueeze(0)))
            else:
                new.append(buf * theta + x.unsqueeze(0))
        return out, tuple(new)


class BandedInverseApply(StreamingInverse):
    """``C^{-1}`` banded: ``x_t = sum_{j < p} D[t, j] z_{t-j}`` with ``D[t, j] = C^{-1}[t, t-j]``.

    Args:
        rows: ``D`` of shape ``(n, p)``, or ``(1, p)`` when ``C^{-1}`` is Toeplitz.
        replay: re-draw ``z_{t-j}`` from the key (no buffers, ``p`` draws per step)
            instead of keeping the last ``p - 1`` draws.
    """

    def __init__(self, rows: np.ndarray, *, replay: bool = False) -> None:
        self._rows = np.atleast_2d(np.asarray(rows, dtype=np.float64))
        self._replay = bool(replay)
        p = self._rows.shape[1]
        self.memory = 0 if replay else p - 1

    def next(self, t: int, draw: Draw, buffers: Buffers, *, inplace: bool = False) -> tuple[list[torch.Tensor], Buffers]:
        i = t if self._rows.shape[0] > 1 else 0
        if i >= self._rows.shape[0]:
            raise IndexError(f"step {t} is beyond the strategy's n_steps={self._rows.shape[0]}.")
        row = self._rows[i]
        p = row.shape[0]
        z = draw(t)
        out = [zi * row[0] for zi in z]
        if self._replay:
            for j in range(1, min(t, p - 1) + 1):
                if row[j] != 0.0:
                    past = draw(t - j)
                    out = [o + row[j] * zj for o, zj in zip(out, past)]
            return out, buffers
        m = self.memory
        if m == 0:
            return out, buffers
        weights = np.zeros(m)
        for j in range(1, min(t, m) + 1):
            weights[(t - j) % m] = row[j]
        new = []
        for k, (zi, buf) in enumerate(zip(z, buffers)):
            if t > 0:
                out[k] = out[k] + torch.tensordot(torch.as_tensor(weights, dtype=buf.dtype, device=buf.device), buf, dims=1)
            new.append(_write(buf, t % m, zi, inplace))
        return out, tuple(new)


class DenseSolve(StreamingInverse):
    """Dense lower-triangular ``C``: forward substitution over every past row (``n - 1`` buffers)."""

    def __init__(self, matrix: np.ndarray) -> None:
        self._c = np.asarray(matrix, dtype=np.float64)
        self.memory = max(self._c.shape[0] - 1, 0)

    def next(self, t: int, draw: Draw, buffers: Buffers, *, inplace: bool = False) -> tuple[list[torch.Tensor], Buffers]:
        if t >= self._c.shape[0]:
            raise IndexError(f"step {t} is beyond the strategy's n_steps={self._c.shape[0]}.")
        z = draw(t)
        diag = float(self._c[t, t])
        out, new = [], []
        for zi, buf in zip(z, buffers or (None,) * len(z)):
            if t == 0 or buf is None:
                x = zi / diag
            else:
                w = torch.as_tensor(self._c[t, :t], dtype=buf.dtype, device=buf.device)
                x = (zi - torch.tensordot(w, buf[:t], dims=1)) / diag
            out.append(x)
            if buf is not None and t < self.memory:
                new.append(_write(buf, t, x, inplace))
            elif buf is not None:
                new.append(buf)
        return out, tuple(new)


def _write(buf: torch.Tensor, slot: int, value: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace:
        buf[slot].copy_(value)
        return buf
    return buf.index_copy(0, torch.tensor([slot], device=buf.device), value.unsqueeze(0).to(buf.dtype))

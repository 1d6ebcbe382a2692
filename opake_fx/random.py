"""Explicit, splittable random keys, bit-identical to ``jax.random``.

A key is a value: :class:`RngKey` holds two uint32 words and is hashed with
Threefry-2x32 (20 rounds; Salmon et al. 2011) in JAX's *partitionable* layout, so
``split``, ``fold_in``, ``bits`` and ``uniform`` give the same numbers as
``jax.random`` for the same key, and ``normal(..., exact=True)`` the same normals up
to one ulp of ``erfinv``.

Nothing here touches the global torch RNG. Bulk Gaussian noise (``normal`` without
``exact``) is drawn by a ``torch.Generator`` seeded from the key's hash on the target
device: as fast as ``torch.randn`` and deterministic per key, shape, dtype and device
type, but not JAX-identical.

Keys may also be given as int64 tensors of shape ``(..., 2)`` (see :func:`key_data`);
``split``, ``fold_in``, ``bits``, ``uniform`` and ``normal`` then work elementwise and
under ``torch.func.vmap`` (pass stacked keys with ``in_dims=0`` rather than relying on
``randomness="different"``).

Example:
    >>> k = key(42)
    >>> k.words
    (0, 42)
    >>> a, b = split(k)
    >>> normal(fold_in(a, 3), (2,)).shape
    torch.Size([2])
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import numpy as np
import optree
import torch

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.typing import typechecked

__all__ = [
    "RngKey",
    "key",
    "split",
    "fold_in",
    "bits",
    "uniform",
    "normal",
    "tree_normal",
    "flat_tree_normal",
    "flat_tree_normal_rows",
    "flat_normal_group",
    "key_data",
    "wrap_key_data",
]

_MASK = 0xFFFFFFFF
_SCALAR_SPLIT_MAX = 32  # below this many children, Python-int Threefry beats numpy's per-op overhead
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


@dataclass(frozen=True)
class RngKey:
    """An immutable Threefry-2x32 key: two uint32 words ``(hi, lo)``.

    Keys are hashable and comparable, so they can sit in sets, dict keys and
    dataclass states. Make them with :func:`key`; derive new ones with :func:`split`
    and :func:`fold_in`, never by reusing a key for two purposes.
    """

    words: tuple[int, int]

    def __post_init__(self) -> None:
        if (
            not isinstance(self.words, tuple)
            or len(self.words) != 2
            or not all(isinstance(w, int) and 0 <= w <= _MASK for w in self.words)
        ):
            raise InputValueError(
                f"RngKey needs two uint32 words (hi, lo); got {self.words!r}. "
                "Make keys with opake_fx.random.key(seed)."
            )

    def __repr__(self) -> str:
        return f"RngKey({self.words[0]}, {self.words[1]})"

    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The key as an int64 tensor ``[hi, lo]`` (for stacking and ``vmap``)."""
        return torch.tensor(self.words, dtype=torch.int64, device=device)


KeyLike = RngKey | torch.Tensor


def _derived_key(words: tuple[int, int]) -> RngKey:
    """An ``RngKey`` from words Threefry just produced (two Python ints below ``2**32`` by
    construction), without re-validating them: the noise stage derives several keys a step."""
    k = object.__new__(RngKey)
    object.__setattr__(k, "words", words)
    return k


def key(seed: int) -> RngKey:
    """Makes a key from an integer seed, as ``jax.random.PRNGKey`` does.

    A seed in ``[0, 2**64)`` maps to ``(seed >> 32, seed & 0xFFFFFFFF)``; negative
    seeds are taken modulo ``2**64``.

    Example:
        >>> key(42).words
        (0, 42)
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputTypeError(f"key(seed) needs a Python int seed; got {type(seed).__name__}.")
    if seed >= 2**64:
        raise InputValueError(f"key(seed) needs a seed below 2**64; got {seed}.")
    seed %= 2**64
    return RngKey((seed >> 32, seed & _MASK))


@typechecked
def key_data(keys: RngKey | Sequence[RngKey]) -> torch.Tensor:
    """Stacks keys into an int64 tensor of shape ``(2,)`` or ``(n, 2)``.

    Use this to hand per-example keys to ``torch.func.vmap`` (``in_dims=0``).
    """
    if isinstance(keys, RngKey):
        return keys.to_tensor()
    return torch.tensor([k.words for k in keys], dtype=torch.int64).reshape(-1, 2)


@typechecked
def wrap_key_data(data: torch.Tensor) -> RngKey | list[RngKey]:
    """Inverse of :func:`key_data`: an int64 ``(2,)`` or ``(n, 2)`` tensor back to keys."""
    rows = data.reshape(-1, 2).tolist()
    out = [RngKey((int(a), int(b))) for a, b in rows]
    return out[0] if data.dim() == 1 else out


@typechecked
def split(k: KeyLike, num: int = 2) -> Any:
    """Splits a key into ``num`` independent children.

    Child ``i`` is the Threefry hash of counter ``i``, so ``split(k, 3)[:2] ==
    split(k, 2)`` (JAX's partitionable layout).

    Returns:
        A tuple of ``num`` :class:`RngKey` for an ``RngKey`` input; for a tensor key
        of shape ``(..., 2)``, a tensor of shape ``(..., num, 2)``.

    Example:
        >>> a, b = split(key(0))
        >>> a.words
        (1797259609, 2579123966)
    """
    if num < 1:
        raise InputValueError(f"split needs num >= 1; got {num}.")
    if isinstance(k, RngKey):
        return _split_key(k, num)
    kt = _check_key_tensor(k)
    counters = torch.arange(num, dtype=torch.int64, device=kt.device)
    y0, y1 = _hash_counters(kt, counters)
    return torch.stack((y0, y1), dim=-1)


def _split_key(k: RngKey, num: int) -> tuple[RngKey, ...]:
    """:func:`split` of an ``RngKey`` (``num >= 1``), without the argument checks."""
    if num <= _SCALAR_SPLIT_MAX:
        return tuple(_derived_key(_threefry(*k.words, i >> 32, i & _MASK)) for i in range(num))
    y0, y1 = _threefry(*_np_key(k), *_np_counters(num))
    return tuple(_derived_key((a, b)) for a, b in zip(y0[0].tolist(), y1[0].tolist()))


def fold_in(k: KeyLike, data: int | torch.Tensor) -> Any:
    """Derives a key from ``k`` and an integer (a step, a rank), as ``jax.random.fold_in``.

    The key is the Threefry hash of the 64-bit counter ``(data >> 32, data & 0xFFFFFFFF)``
    under ``k``: for ``data < 2**32`` that is exactly ``jax.random.fold_in`` (and
    ``split(k, n)[data]``); larger ``data`` (up to ``2**64 - 1``) fold their high word
    into the counter instead of wrapping. Threefry is a permutation of the counter for a
    fixed key, so distinct ``data`` always give distinct keys: step ``2**32`` never
    reuses step 0's key.

    Args:
        k: the key (an ``RngKey``, or a key tensor ``[..., 2]``).
        data: an int in ``[0, 2**64)``; a tensor of ints is read as 64-bit two's
            complement (so distinct int64 values still give distinct keys).

    Raises:
        InputTypeError: ``data`` is not an integer.
        InputValueError: ``data`` is negative or ``>= 2**64`` (it would alias another
            value's key).

    Example:
        >>> fold_in(key(0), 7).words
        (2716826189, 292468403)
        >>> fold_in(key(0), 2**32) != fold_in(key(0), 0)
        True
    """
    # (checked by hand, not by @typechecked: the noise stage derives a key every step)
    if type(k) is RngKey and type(data) is int and 0 <= data < 2**64:  # the common case: a step, a rank
        return _derived_key(_threefry(*k.words, data >> 32, data & _MASK))
    if isinstance(k, RngKey):
        if isinstance(data, torch.Tensor):
            if data.numel() != 1 or data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
                raise InputTypeError(
                    f"fold_in on an RngKey needs one integer; got a {data.dtype} tensor of shape {tuple(data.shape)}."
                )
            data = int(data)
        if isinstance(data, bool) or not isinstance(data, numbers.Integral):
            raise InputTypeError(f"fold_in needs an int; got {type(data).__name__}.")
        data = int(data)
        if not 0 <= data < 2**64:
            raise InputValueError(
                f"fold_in needs data in [0, 2**64); got {data}. A negative or larger value would alias another "
                "value's key (a reused key repeats its noise); count steps and ranks from 0."
            )
        return _derived_key(_threefry(*k.words, data >> 32, data & _MASK))
    kt = _check_key_tensor(k)
    if isinstance(data, torch.Tensor):
        if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
            raise InputTypeError(f"fold_in needs integer data; got a {data.dtype} tensor.")
    elif isinstance(data, bool) or not isinstance(data, numbers.Integral):
        raise InputTypeError(f"fold_in needs an int or an integer tensor; got {type(data).__name__}.")
    d = torch.as_tensor(data, dtype=torch.int64, device=kt.device)
    y0, y1 = _threefry(kt[..., 0], kt[..., 1], (d >> 32) & _MASK, d & _MASK)
    return torch.stack((y0, y1), dim=-1)


@typechecked
def bits(k: KeyLike, shape: Sequence[int] = (), dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Random uint32 words, equal to ``jax.random.bits(k, shape, uint32)``.

    Args:
        k: the key.
        shape: output shape (row-major counter order).
        dtype: ``torch.int64`` (values in ``[0, 2**32)``) or ``torch.uint32``.

    Example:
        >>> bits(key(0), (2,)).tolist()
        [4070199207, 4202968722]
    """
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if isinstance(k, RngKey):
        y0, y1 = _threefry(*_np_key(k), *_np_counters(n))
        out = torch.from_numpy((y0[0] ^ y1[0]).astype(np.int64)).reshape(shape)
    else:
        kt = _check_key_tensor(k)
        counters = torch.arange(n, dtype=torch.int64, device=kt.device)
        y0, y1 = _hash_counters(kt, counters)
        out = (y0 ^ y1).reshape((*kt.shape[:-1], *shape))
    if dtype == torch.int64:
        return out
    if dtype == torch.uint32:
        return out.to(torch.uint32)
    raise InputValueError(f"bits returns int64 or uint32 words; got dtype={dtype}.")


@typechecked
def uniform(
    k: KeyLike,
    shape: Sequence[int] = (),
    dtype: torch.dtype = torch.float32,
    minval: float = 0.0,
    maxval: float = 1.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Uniform floats in ``[minval, maxval)``, equal to ``jax.random.uniform`` in float32.

    The mantissa comes from the top 23 bits of :func:`bits`. Other float dtypes are
    computed in float32 and cast (so they are not JAX-identical).
    """
    if not dtype.is_floating_point:
        raise InputValueError(f"uniform needs a floating dtype; got {dtype}.")
    u = _unit_uniform(bits(k, shape))
    if minval != 0.0 or maxval != 1.0:
        u = torch.clamp(u * (maxval - minval) + minval, min=minval)
    return u.to(dtype=dtype, device=device)


@typechecked
def normal(
    k: KeyLike,
    shape: Sequence[int] = (),
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    *,
    exact: bool = False,
) -> torch.Tensor:
    """Standard normal samples drawn from a key; the global RNG is never used.

    Args:
        k: the key.
        shape: output shape.
        dtype: floating dtype of the output.
        device: target device (the draw happens there; no host-device copy).
        exact: if True, use Threefry bits and ``sqrt(2) * erfinv`` exactly as
            ``jax.random.normal`` (float32; equal to JAX up to ~1e-6). Slow: meant for
            tests and small draws. If False (default), seed a local ``torch.Generator``
            on ``device`` with the key's hash and call ``torch.randn``: as fast as
            ``torch.randn``, deterministic per (key, shape, dtype, device type).
            Tensor keys (stacked keys, ``vmap``) always take the exact path.

    Example:
        >>> x = normal(key(0), (1000,))
        >>> bool(abs(x.std() - 1) < 0.1)
        True
    """
    if not dtype.is_floating_point:
        raise InputValueError(f"normal needs a floating dtype; got {dtype}.")
    shape = tuple(int(s) for s in shape)
    if exact or not isinstance(k, RngKey):
        u = _unit_uniform(bits(k, shape))
        lo = math.nextafter(-1.0, 0.0)
        lo32 = torch.tensor(lo, dtype=torch.float32).item()
        u = torch.clamp(u * (1.0 - lo32) + lo32, min=lo32)
        # erfinv in float64, rounded once to float32: within one ulp of XLA's kernel.
        out = (math.sqrt(2.0) * torch.erfinv(u.double())).float()
        return out.to(dtype=dtype, device=device)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return torch.randn(shape, generator=_keyed_generators([k], [dev])[0], dtype=dtype, device=dev)


@typechecked
def tree_normal(k: RngKey, like_tree: Any, *, exact: bool = False) -> Any:
    """A pytree of standard normals shaped like ``like_tree``, one subkey per leaf.

    Leaf ``i`` (in optree flattening order) uses ``split(k, n_leaves)[i]`` and takes
    the leaf's shape, dtype and device.
    """
    leaves, treedef = optree.tree_flatten(like_tree, none_is_leaf=False, namespace="opake_fx")
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise InputTypeError(
                f"tree_normal needs tensor leaves; got {type(leaf).__name__}. "
                "Convert the leaf to a tensor or remove it from the tree."
            )
    if not leaves:
        return optree.tree_unflatten(treedef, [])
    subkeys = split(k, len(leaves))
    if exact:
        draws = [normal(sk, leaf.shape, dtype=leaf.dtype, exact=True).to(leaf.device) for sk, leaf in zip(subkeys, leaves)]
    else:
        # Same numbers as normal(subkey_i, ...) per leaf, with the key hashing batched.
        gens = _keyed_generators(list(subkeys), [leaf.device for leaf in leaves])
        draws = [
            torch.randn(leaf.shape, generator=g, dtype=leaf.dtype, device=leaf.device) for g, leaf in zip(gens, leaves)
        ]
    return optree.tree_unflatten(treedef, draws)


def flat_tree_normal(
    k: RngKey, leaves: Sequence[torch.Tensor], *, stddev: float = 1.0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Normals ``N(0, stddev^2)`` for a list of tensors from ONE draw per (device, dtype).

    The cheap way to noise a whole gradient: leaves are grouped by device and dtype (in
    order of first appearance); group ``j`` draws one flat ``torch.randn`` of its total
    size from the generator of ``split(k, n_groups)[j]``, and each leaf gets the next
    ``numel`` values, reshaped. Deterministic per key, leaf shapes, dtypes and device
    types; not the same numbers as :func:`tree_normal` (which seeds a generator per leaf).
    A CPU draw of more than 2**20 values is cut into 2**20-value chunks, chunk ``c`` drawn
    by the generator of ``split(group_key, n_chunks)[c]``; from 4 chunks on they are drawn
    on ``torch.get_num_threads()`` threads (torch's CPU generator is serial). The chunking
    depends only on the size, so the numbers do not depend on the thread count.
    ``stddev`` scales inside the generator's kernel (``stddev * z``, no extra pass over
    the draw); the standard normals ``z`` are the same for every ``stddev``.

    Returns:
        ``(draws, buffers)``: ``draws[i]`` is shaped like ``leaves[i]`` and is a view
        into one of ``buffers`` (the flat draws), so an in-place op on ``buffers`` reaches
        every draw in one kernel.

    Example:
        >>> draws, buffers = flat_tree_normal(key(0), [torch.zeros(2, 3), torch.zeros(4)])
        >>> [tuple(d.shape) for d in draws], [b.numel() for b in buffers]
        ([(2, 3), (4,)], [10])
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((leaf.device, leaf.dtype), []).append(i)
    draws: list[torch.Tensor | None] = [None] * len(leaves)
    buffers = []
    subkeys = _split_key(k, len(groups)) if groups else ()
    for ((device, dtype), members), gk in zip(groups.items(), subkeys):
        sizes = [leaves[i].numel() for i in members]
        flat = _keyed_randn(gk, sum(sizes), dtype, device, stddev)
        buffers.append(flat)
        if len(members) == 1:
            draws[members[0]] = flat.view(leaves[members[0]].shape)
            continue
        for i, part in zip(members, flat.split_with_sizes(sizes)):
            draws[i] = part if len(leaves[i].shape) == 1 else part.view(leaves[i].shape)
    return draws, buffers  # type: ignore[return-value]


def flat_tree_normal_rows(
    k: RngKey,
    leaves: Sequence[torch.Tensor],
    full_shapes: Sequence[Sequence[int]],
    rows: Sequence[tuple[int, int]],
    *,
    stddev: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rows ``rows[i]`` of leaf ``i`` of :func:`flat_tree_normal`'s draw for leaves of ``full_shapes``.

    What a rank that holds only rows ``[start, stop)`` (along the first axis) of every
    leaf draws to noise its shard: ``draws[i]`` equals
    ``flat_tree_normal(k, full)[0][i][start:stop]`` bit for bit, where ``full[i]`` has
    shape ``full_shapes[i]`` and ``leaves[i]``'s dtype and device. Only the generator
    chunks that overlap the rows are drawn on the CPU (2**20 values each, independent
    keys); on another device the whole group is drawn and sliced (its generator cannot
    skip ahead).

    Args:
        k: the key (as for :func:`flat_tree_normal`).
        leaves: the shards; ``leaves[i]`` has ``stop - start`` rows and the other
            dimensions of ``full_shapes[i]``.
        full_shapes: the unsharded shapes.
        rows: ``(start, stop)`` of each leaf's shard along its first axis.
        stddev: as for :func:`flat_tree_normal`.

    Returns:
        ``(draws, buffers)`` as :func:`flat_tree_normal` (``draws[i]`` shaped like
        ``leaves[i]``, each its own memory), so it can serve as the ``draw`` of
        :func:`opake_fx._gaussian.add_gaussian_noise`.

    Raises:
        InputValueError: a shard whose shape is not its rows of the full shape.

    Example:
        >>> full, _ = flat_tree_normal(key(3), [torch.zeros(4, 2), torch.zeros(3)])
        >>> part, _ = flat_tree_normal_rows(key(3), [torch.zeros(2, 2), torch.zeros(1)], [(4, 2), (3,)],
        ...                                 [(1, 3), (2, 3)])
        >>> torch.equal(part[0], full[0][1:3]), torch.equal(part[1], full[1][2:3])
        (True, True)
    """
    if not (len(leaves) == len(full_shapes) == len(rows)):
        raise InputValueError(f"flat_tree_normal_rows: {len(leaves)} leaves, {len(full_shapes)} full shapes and "
                              f"{len(rows)} row ranges; give one of each per leaf.")
    spans = []
    for leaf, shape, (start, stop) in zip(leaves, full_shapes, rows):
        shape = tuple(int(d) for d in shape)
        if not shape or not 0 <= start <= stop <= shape[0] or tuple(leaf.shape) != (stop - start, *shape[1:]):
            raise InputValueError(
                f"flat_tree_normal_rows: a shard of shape {tuple(leaf.shape)} is not rows [{start}, {stop}) of a leaf of "
                f"shape {shape}; each shard must be a contiguous range of its leaf's first axis."
            )
        spans.append((math.prod(shape), start * math.prod(shape[1:]), stop * math.prod(shape[1:])))
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((leaf.device, leaf.dtype), []).append(i)
    draws: list[torch.Tensor | None] = [None] * len(leaves)
    buffers: list[torch.Tensor] = []
    subkeys = _split_key(k, len(groups)) if groups else ()
    for ((device, dtype), members), gk in zip(groups.items(), subkeys):
        offset, ranges = 0, []
        for i in members:
            size, a, b = spans[i]
            ranges.append((offset + a, offset + b))
            offset += size
        for i, part in zip(members, _keyed_randn_ranges(gk, offset, ranges, dtype, device, stddev)):
            draws[i] = part.view(leaves[i].shape)
            buffers.append(part)
    return draws, buffers  # type: ignore[return-value]


@torch.library.custom_op("opake_fx::flat_normal_group", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def flat_normal_group(words: list[int], step: int, groups: int, group: int, n: int, dtype: torch.dtype,
                      device: torch.device, stddev: float) -> torch.Tensor:
    """Group ``group``'s flat buffer of ``flat_tree_normal(fold_in(k, step), leaves, stddev=stddev)``,
    where ``k.words == words`` and the leaves form ``groups`` (device, dtype) groups, this one of
    ``n`` values of ``dtype`` on ``device``: the same numbers, drawn the same way.

    An operator of its own (``torch.library.custom_op``) so that a compiled step calls the
    keyed draw inside its graph, with the step as a symbolic integer, instead of breaking the
    graph around it: the key is derived and the generator run when the graph runs, never at
    tracing. Tagged ``cudagraph_unsafe``: a CUDA graph never captures it (a captured draw
    would replay one step's noise).

    Privacy:
        None of its own: the numbers are exactly :func:`flat_tree_normal`'s for the same key
        and step, so the mechanism is the noise stage's. As for every keyed draw, the key
        must stay secret and a step's key is never used for two releases.

    Example:
        >>> leaves = [torch.zeros(2, 3), torch.zeros(4)]
        >>> draws, buffers = flat_tree_normal(fold_in(key(5), 7), leaves, stddev=0.5)
        >>> flat = flat_normal_group([0, 5], 7, 1, 0, 10, torch.float32, torch.device("cpu"), 0.5)
        >>> torch.equal(flat, buffers[0])
        True
    """
    group_key = _split_key(fold_in(RngKey((int(words[0]), int(words[1]))), step), groups)[group]
    return _keyed_randn(group_key, n, dtype, device, stddev)


@flat_normal_group.register_fake
def _flat_normal_group_shape(words: list[int], step: int, groups: int, group: int, n: int, dtype: torch.dtype,
                             device: torch.device, stddev: float) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device=device)


def _keyed_randn_ranges(k: RngKey, n: int, ranges: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
                        stddev: float) -> list[torch.Tensor]:
    """Values ``[a, b)`` of ``_keyed_randn(k, n, ...)`` for each range, each a tensor of its own."""
    if device.type != "cpu" or n <= _CPU_CHUNK:
        full = _keyed_randn(k, n, dtype, device, stddev)
        return [full[a:b].clone() for a, b in ranges]
    n_chunks = -(-n // _CPU_CHUNK)
    needed = sorted({c for a, b in ranges if b > a for c in range(a // _CPU_CHUNK, (b - 1) // _CPU_CHUNK + 1)})
    keys = _split_key(k, n_chunks)
    gens = _keyed_generators([keys[c] for c in needed], [device] * len(needed))
    chunk = {}
    for c, gen in zip(needed, gens):  # a chunk drawn alone gives the values it has inside the whole draw
        chunk[c] = torch.empty(min(_CPU_CHUNK, n - c * _CPU_CHUNK), dtype=dtype).normal_(0.0, stddev, generator=gen)
    out = []
    for a, b in ranges:
        pieces = [chunk[c][max(a - c * _CPU_CHUNK, 0): min(b - c * _CPU_CHUNK, _CPU_CHUNK)]
                  for c in range(a // _CPU_CHUNK, (b - 1) // _CPU_CHUNK + 1)] if b > a else []
        out.append(torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype))
    return out


_CPU_CHUNK = 1 << 20
# Below 4 chunks, a thread pool's dispatch and its competition with torch's own intra-op
# threads ate the gain inside a training step (1.28M values: 14.9 ms per embedding-bag step
# with 2**19-value chunks on the pool, 13.7 ms on the calling thread; 10M: 1.7x faster on 2 cores).
_PARALLEL_MIN_CHUNKS = 4
_pool: Any = None
_pool_size = 0


def _forget_pool_in_child() -> None:
    # A forked child inherits the pool object but not its threads: a draw mapped onto it
    # would wait forever. The child builds its own pool on its first large draw.
    global _pool, _pool_size
    _pool, _pool_size = None, 0


os.register_at_fork(after_in_child=_forget_pool_in_child)


def _keyed_randn(k: RngKey, n: int, dtype: torch.dtype, device: torch.device, stddev: float = 1.0) -> torch.Tensor:
    """``n`` normals ``N(0, stddev^2)`` from key ``k``: one generator, or parallel chunks on the CPU."""
    if device.type != "cpu" or n <= _CPU_CHUNK:
        (gen,) = _keyed_generators([k], [device])
        return torch.empty(n, dtype=dtype, device=device).normal_(0.0, stddev, generator=gen)
    out = torch.empty(n, dtype=dtype)
    chunks = torch.split(out, _CPU_CHUNK)
    gens = _keyed_generators(list(_split_key(k, len(chunks))), [device] * len(chunks))
    workers = torch.get_num_threads()  # the pool keeps this size whatever the chunk count
    if workers <= 1 or len(chunks) < _PARALLEL_MIN_CHUNKS:
        for chunk, gen in zip(chunks, gens):
            chunk.normal_(0.0, stddev, generator=gen)
        return out
    global _pool, _pool_size
    if _pool is None or _pool_size != workers:
        from concurrent.futures import ThreadPoolExecutor

        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool, _pool_size = ThreadPoolExecutor(workers, thread_name_prefix="opake_fx-randn"), workers
    list(_pool.map(lambda cg: cg[0].normal_(0.0, stddev, generator=cg[1]), zip(chunks, gens)))
    return out


# --- private helpers ---------------------------------------------------------------


def _check_key_tensor(k: Any) -> torch.Tensor:
    if not isinstance(k, torch.Tensor):
        raise InputTypeError(
            f"expected an RngKey or an int64 key tensor of shape (..., 2); got {type(k).__name__}. "
            "Make keys with opake_fx.random.key(seed)."
        )
    if k.dtype != torch.int64 or k.shape[-1:] != (2,):
        raise InputValueError(
            f"a key tensor must be int64 with last dimension 2; got dtype={k.dtype}, "
            f"shape={tuple(k.shape)}. Build it with opake_fx.random.key_data."
        )
    return k


def _threefry(k0: Any, k1: Any, x0: Any, x1: Any) -> tuple[Any, Any]:
    """Threefry-2x32, 20 rounds, elementwise with broadcasting.

    Works on anything with ``+ ^ << >> &``: Python ints, int64 tensors holding uint32
    values (also under ``vmap``) and uint32 numpy arrays (where the masks are no-ops).
    """
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0 = (x0 + k0) & _MASK
    x1 = (x1 + k1) & _MASK
    for group in range(1, 6):
        for r in _ROTATIONS[(group - 1) % 2]:
            x0 = (x0 + x1) & _MASK
            x1 = (((x1 << r) & _MASK) | (x1 >> (32 - r))) ^ x0
        x0 = (x0 + ks[group % 3]) & _MASK
        x1 = (x1 + ks[(group + 1) % 3] + group) & _MASK
    return x0, x1


def _np_key(k: RngKey) -> tuple[np.ndarray, np.ndarray]:
    """The key's words as uint32 numpy arrays of shape (1, 1) (Threefry on numpy: low per-op overhead)."""
    words = np.array([k.words], dtype=np.uint32)
    return words[:, :1], words[:, 1:]


def _np_counters(n: int) -> tuple[np.ndarray, np.ndarray]:
    """64-bit counters 0..n-1 as (hi, lo) uint32 words, shaped (1, n)."""
    c = np.arange(n, dtype=np.uint64)
    return (c >> np.uint64(32)).astype(np.uint32)[None, :], (c & np.uint64(_MASK)).astype(np.uint32)[None, :]


def _hash_counters(kt: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hashes 64-bit counters (partitionable layout: x0 = hi word, x1 = lo word)."""
    kk = kt.unsqueeze(-2)
    return _threefry(kk[..., 0], kk[..., 1], counters >> 32, counters & _MASK)


def _unit_uniform(words: torch.Tensor) -> torch.Tensor:
    """uint32 words (int64 tensor) -> float32 in [0, 1) via the mantissa trick."""
    mant = (words >> 9) | 0x3F800000
    return mant.to(torch.int32).view(torch.float32) - 1.0


# Domain-separation counter: generator material is hashed from fold_in(key, this), so it
# never equals a value that split/bits hand out for the same key.
_GENERATOR_DOMAIN = 0x6F70616B
_MT_WORDS = 624


def _keyed_generators(keys: list[RngKey], devices: list[torch.device]) -> list[torch.Generator]:
    """One torch.Generator per (key, device) whose whole state is derived from the key.

    Each key is first hashed to a 64-bit value ``fold_in(key, _GENERATOR_DOMAIN)``.
    CUDA (Philox) generators take that full 64-bit seed. The CPU generator (mt19937)
    keeps only the low 32 bits of a seed, so seeding it would let distinct keys collide
    after ~2**16 draws (identical noise on two steps cancels in their difference).
    Instead its 624-word state is filled with the SplitMix64 expansion of the 64-bit
    hash (:func:`_splitmix64_words`): ~10 us per generator.
    """
    gens = []
    for k, device in zip(keys, devices):
        hi, lo = _threefry(*k.words, 0, _GENERATOR_DOMAIN)
        seed = (hi << 32) | lo
        if device.type == "cpu":
            gens.append(_cpu_state_generator(seed))
        else:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed & (2**63 - 1))
            gens.append(gen)
    return gens


# Byte layout of the CPU generator state (torch's CPUGeneratorImplStateLegacy, stable since
# torch 1.x): the_initial_seed u64 @0, left i32 @8, seeded i32 @12, next u64 @16,
# state u64[624] @24, normal_x/y/rho f64 @5016.., normal_is_valid i32 @5040,
# next_float_normal_sample f32 @5048, is_next_float_normal_sample_valid bool @5052.
_STATE_BYTES = 5056
_LEFT, _SEEDED, _STATE, _STATE_END, _NORMAL_VALID, _FLOAT_NORMAL_VALID = 8, 12, 24, 24 + 8 * _MT_WORDS, 5040, 5052
_state_template: np.ndarray | None = None


def _cpu_state_template() -> np.ndarray:
    global _state_template
    if _state_template is None:
        state = torch.Generator().get_state().numpy().copy()
        if state.size != _STATE_BYTES:
            raise RuntimeError(
                f"opake_fx.random: this torch's CPU generator state has {state.size} bytes, not {_STATE_BYTES}; "
                "the keyed fast normal path does not know its layout. Use normal(..., exact=True) and report "
                "the torch version."
            )
        state[_LEFT : _LEFT + 4].view(np.int32)[0] = 1  # twist the new state on the first draw
        state[_SEEDED : _SEEDED + 4].view(np.int32)[0] = 1
        state[_NORMAL_VALID : _NORMAL_VALID + 4].view(np.int32)[0] = 0  # no cached normals
        state[_FLOAT_NORMAL_VALID] = 0
        _state_template = state
    return _state_template


def _cpu_state_generator(seed: int) -> torch.Generator:
    state = _cpu_state_template().copy()
    state[_STATE:_STATE_END].view(np.int64)[:] = _splitmix64_words(seed, _MT_WORDS)
    gen = torch.Generator()
    gen.set_state(torch.from_numpy(state))
    return gen


_SPLITMIX_INDEX = np.arange(1, _MT_WORDS // 2 + 1, dtype=np.uint64)
_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SPLITMIX_BASE = _SPLITMIX_INDEX * _GOLDEN  # j * golden, the seed-free part of every state
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _splitmix64_words(seed: int, n: int) -> np.ndarray:
    """``n`` uint32 words (as int64) of the SplitMix64 sequence started at ``seed``.

    SplitMix64 (Steele et al. 2014) is the standard way to expand one 64-bit seed into a
    generator state: output ``j`` is a bijective mix of ``seed + j * golden``, so distinct
    seeds give distinct, well-mixed sequences. Vectorised in numpy (uint64 wraps).
    """
    # (array arithmetic wraps silently; only numpy scalar overflow would warn; in place: few
    # temporaries, as this runs every step)
    z = _SPLITMIX_BASE[: (n + 1) // 2] + np.uint64(seed)
    t = z >> _S30
    z ^= t
    z *= _M1
    np.right_shift(z, _S27, out=t)
    z ^= t
    z *= _M2
    np.right_shift(z, _S31, out=t)
    z ^= t
    return z.view(np.uint32)[:n].astype(np.int64)

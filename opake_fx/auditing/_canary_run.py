"""The plumbing of one canary training run, shared by the example-level audit
(:mod:`opake_fx.auditing.dpsgd`) and the user-level one (:mod:`opake_fx.auditing.users`).

Private: the canary rows' inputs (zeros), the per-row loss (the model's loss times 0 on a
canary row, plus the Dirac canary loss), the loop over batches of slots, the progress bar.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from opake_fx.errors import InputValueError


def pad_rows(tensors: Sequence[Any], rows: int) -> tuple[Any, ...]:
    """Each tensor followed by ``rows`` all-zeros rows (the canaries' model inputs)."""
    import torch

    return tuple(torch.cat([t, torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)]) for t in tensors)


def row_loss(loss_fn: Callable[..., Any], canaries: Any) -> Callable[..., Any]:
    """The loss of one row ``(*inputs, which)``: the model's loss (times 0 on a canary row) plus the canary loss."""

    def audit_loss(p: Any, *example: Any) -> Any:
        *inputs, which = example
        ordinary = 1.0 - which.sum()
        return ordinary * loss_fn(p[0], *inputs) + canaries.loss(p[1], which)

    return audit_loss


def train_slots(pipe: Any, state: Any, p: Any, padded: Sequence[Any], batches: Any, slot_to_canary: np.ndarray,
                 m: int, dtype: Any, progress: bool) -> Any:
    """Runs an example-level pipeline over ``batches`` of slots; ``slot_to_canary[s]`` is slot s's canary (or -1)."""
    import torch

    from opake_fx.transforms import apply_updates

    bar = progress_bar(len(batches), progress)
    for batch in batches:
        idx = torch.as_tensor(batch, dtype=torch.int64)
        which = torch.zeros((len(batch), m), dtype=dtype)
        c = torch.as_tensor(slot_to_canary[np.asarray(batch, dtype=np.int64)]) if batch else torch.zeros(0, dtype=torch.int64)
        rows = torch.nonzero(c >= 0).reshape(-1)
        which[rows, c[rows]] = 1.0
        updates, state = pipe.update((*(t[idx] for t in padded), which), state, p)
        p = apply_updates(p, updates)
        bar(1)
    bar(None)
    return p


def param_leaves(tree: Any) -> list[Any]:
    import optree

    leaves = optree.tree_leaves(tree)
    if not leaves:
        raise InputValueError("audit_dpsgd: params has no tensors.")
    return leaves


def progress_bar(total: int, enabled: bool) -> Callable[[int | None], None]:
    if not enabled:
        return lambda _: None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        done = [0]

        def line(k: int | None) -> None:
            if k is None:
                print(file=sys.stderr)
                return
            done[0] += k
            print(f"\raudit: step {done[0]}/{total}", end="", file=sys.stderr)

        return line
    bar = tqdm(total=total, desc="audit", leave=False)
    return lambda k: bar.close() if k is None else bar.update(k)


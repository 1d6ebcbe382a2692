"""Makes non-reentrant gradient checkpointing usable inside ``torch.func`` transforms.

``torch.utils.checkpoint(..., use_reentrant=False)`` pushes saved-tensor hooks, which
``torch.func.grad`` / ``vjp`` refuse ("don't yet support saved tensor hooks"), so a
checkpointed model cannot run under the vmap backend or the vmap fallbacks of the fast
backends. Inside a transform checkpointing has nothing to gain anyway (functorch keeps
its own intermediate values), so :func:`checkpoint_passthrough` lets checkpointed
segments run as plain calls there. Outside transforms checkpointing is untouched.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.utils.checkpoint as _ckpt

_LOCK = threading.Lock()
_DEPTH = [0]
_ORIGINAL = getattr(_ckpt, "_checkpoint_without_reentrant_generator", None)


def _passthrough(*args: Any, **kwargs: Any) -> Iterator[None]:
    if _ORIGINAL is None or torch._C._functorch.maybe_current_level() is None:
        # Not inside a torch.func transform (another thread, or the fast backend's own
        # batched pass): checkpoint exactly as torch does.
        yield from _ORIGINAL(*args, **kwargs)  # type: ignore[misc]
    else:
        yield  # once: run the segment as a plain call


@contextlib.contextmanager
def checkpoint_passthrough() -> Iterator[None]:
    """Within this block, checkpointed segments run plainly inside ``torch.func`` transforms."""
    if _ORIGINAL is None or torch.compiler.is_compiling():
        # a torch without this internal, or a traced step (torch.compile traces checkpointed
        # segments itself): nothing to adapt
        yield
        return
    with _LOCK:
        _DEPTH[0] += 1
        _ckpt._checkpoint_without_reentrant_generator = _passthrough
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                _ckpt._checkpoint_without_reentrant_generator = _ORIGINAL

"""opake_fx: functional, JAX-style differentially private training for PyTorch.

The top level re-exports only the core verbs; everything else is imported from its
topic (``opake_fx.dpsgd.clipping``, ``opake_fx.accounting``, ``opake_fx.distributed``...).

The re-exports and the submodules are loaded on first access (PEP 562), so importing a
torch-free part such as ``opake_fx.accounting`` or ``opake_fx.errors`` does not import
torch.
"""

from opake_fx import _lazy
import pkgutil as _pkgutil
from typing import TYPE_CHECKING as _TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "OpakeError",
    "RngKey",
    "key",
    "split",
    "fold_in",
    "Transform",
    "chain",
    "named_chain",
    "apply_updates",
    "ClippedPytree",
    "NoisedPytree",
    "PerGroup",
]

# Each re-exported name and the module that defines it.
_EXPORTS = {
    "OpakeError": "opake_fx.errors",
    "RngKey": "opake_fx.random",
    "key": "opake_fx.random",
    "split": "opake_fx.random",
    "fold_in": "opake_fx.random",
    "Transform": "opake_fx.transforms",
    "chain": "opake_fx.transforms",
    "named_chain": "opake_fx.transforms",
    "apply_updates": "opake_fx.transforms",
    "ClippedPytree": "opake_fx.types",
    "NoisedPytree": "opake_fx.types",
    "PerGroup": "opake_fx.types",
}
# Public submodules (opake_fx.random, opake_fx.dpsgd, ...), importable as attributes.
_SUBMODULES = frozenset(m.name for m in _pkgutil.iter_modules(__path__) if not m.name.startswith("_"))

if _TYPE_CHECKING:  # static analysers see the eager imports
    from opake_fx.errors import OpakeError
    from opake_fx.random import RngKey, fold_in, key, split
    from opake_fx.transforms import Transform, apply_updates, chain, named_chain
    from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup


__getattr__, __dir__ = _lazy.attach(__name__, globals(), _EXPORTS, _SUBMODULES)

"""A steady-state step of the fast clipping backends makes no host synchronisation.

A host synchronisation is a read of a tensor's value by Python (``.item()``,
``bool(tensor)``, ``int(tensor)``, a boolean index): on a GPU it stalls the host until
the device has caught up, so a step that makes hundreds of them cannot keep the device
busy. torch records each as one ``aten::_local_scalar_dense`` event, on the CPU too, so
they are counted here on the CPU. The first calls for a module and input signature may
probe and decide (``._provenance``, ``._independence``); after two warm-up steps with
the same shapes, one step of ``clipped_grad(..., clip_backend=b)`` must make none, for
``b`` in ``("auto", "ghost")``, on models that cover the rules (Linear, Conv2d,
GroupNorm, Embedding, LayerNorm, Linear over sequences with both the per-example and the
Gram method, Hugging Face GPT-2), in float32 and float64; and so must a whole
``DPPlan(..., clip_backend="auto")`` pipeline update (clip, psum, noise, optimizer).
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from opake_fx.dpsgd.clipping import _rules_linear, clipped_grad
from opake_fx.functional import make_functional

SYNC = "aten::_local_scalar_dense"
B, T, V, D = 6, 16, 40, 32


def count_syncs(fn: Callable[[], Any]) -> tuple[int, list[str]]:
    """The host synchronisations one call of ``fn`` makes, and where (the Python lines of
    opake_fx that made them, from a dispatch mode that sees the same op)."""
    spy = _Spy()
    with profile(activities=[ProfilerActivity.CPU]) as prof, spy:
        fn()
    return sum(1 for e in prof.events() if e.name == SYNC), spy.where


class _Spy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = [f for f in traceback.extract_stack() if "opake_fx" in f.filename]
            self.where.append(" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames)))
        return func(*args, **(kwargs or {}))


# --- models that cover the rules --------------------------------------------------------


class TinyLM(nn.Module):
    """Embedding + positions, LayerNorm, Linear over sequences: ``Linear(D, D)`` takes the
    per-example method under ``"auto"`` (``D * D <= T * 2D``), ``Linear(D, 4D)`` the Gram
    method (both take the Gram method under ``"ghost"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.ln = nn.LayerNorm(D)
        self.mix, self.up = nn.Linear(D, D), nn.Linear(D, 4 * D)
        self.head = nn.Linear(4 * D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        h = self.ln(self.tok(ids) + self.pos(positions))
        return self.head(torch.tanh(self.up(torch.tanh(self.mix(h)))))


def _mlp() -> tuple[nn.Module, Callable[..., torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    return net, lambda out, y: F.cross_entropy(out, y, reduction="none"), (torch.randn(B, 12), torch.randint(0, 4, (B,)))


def _cnn() -> tuple[nn.Module, Callable[..., torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 16, 3, stride=2),
                        nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 3))
    return net, lambda out, y: F.cross_entropy(out, y, reduction="none"), (torch.randn(B, 1, 16, 16),
                                                                          torch.randint(0, 3, (B,)))


def _lm_loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def _lm() -> tuple[nn.Module, Callable[..., torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(0, V, (B, T))
    return TinyLM(), _lm_loss, (ids, ids)


class RMSNormLike(nn.Module):
    """LlamaRMSNorm's forward: a norm-like module the affine-norm rule takes by what it computes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class ScaleShift(nn.Module):
    """A module without a rule that owns parameters: the per-module fallback."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale + self.shift) * self.scale


class AttentionLM(nn.Module):
    """nn.MultiheadAttention (rewritten from tapped projections), an RMSNorm-like module, a
    module fallback: the rules whose calls are checked."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.norm, self.act = RMSNormLike(D), ScaleShift(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.tok(ids))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.act(h))


def _attention() -> tuple[nn.Module, Callable[..., torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(0, V, (B, T))
    return AttentionLM().eval(), _lm_loss, (ids, ids)


MODELS = {"mlp": _mlp, "cnn": _cnn, "lm": _lm, "attention": _attention}


def test_the_tiny_lm_takes_both_linear_methods_under_auto():
    assert _rules_linear.choose_method("auto", T, D, D) == "pe"
    assert _rules_linear.choose_method("auto", T, D, 4 * D) == "ghost"


def _step(kind: str, backend: str, dtype: torch.dtype) -> Callable[[], Any]:
    torch.manual_seed(0)
    net, per_example, (x, y) = MODELS[kind]()
    net = net.to(dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    fmodel, params = make_functional(net)
    fn, state = clipped_grad(lambda p, xb, yb: per_example(fmodel(p, xb), yb), clipping_norm=0.1,
                             batch_argnums=(1, 2), clip_backend=backend, model=fmodel)
    return lambda: fn(params, x, y, state=state)


def _steady_syncs(step: Callable[[], Any]) -> tuple[int, list[str]]:
    for _ in range(2):  # the first calls per signature may probe and decide
        step()
    return count_syncs(step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("backend", ["auto", "ghost"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_steady_step_makes_no_host_synchronisation(kind, backend, dtype):
    n, where = _steady_syncs(_step(kind, backend, dtype))
    assert n == 0, f"{n} host synchronisations in one steady {backend} step of {kind} ({dtype}); at:\n" + "\n".join(where)


def _gpt2_step(backend: str, dtype: torch.dtype, batched_positions: bool = True) -> Callable[[], Any]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).to(dtype).eval()
    fmodel, params = make_functional(model)
    ids = torch.randint(0, V, (B, T))

    def losses(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not batched_positions:  # GPT-2's own [1, T] positions: the shared-tensor rule takes wpe
            return _lm_loss(fmodel(p, input_ids=x).logits, y)
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)  # batched: wpe takes its rule
        return _lm_loss(fmodel(p, input_ids=x, position_ids=positions).logits, y)

    fn, state = clipped_grad(losses, clipping_norm=0.1, batch_argnums=(1, 2), clip_backend=backend, model=fmodel)
    return lambda: fn(params, ids, ids, state=state)


@pytest.mark.parametrize("positions", ["batched", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("backend", ["auto", "ghost"])
def test_a_steady_gpt2_step_makes_no_host_synchronisation(backend, dtype, positions):
    n, where = _steady_syncs(_gpt2_step(backend, dtype, batched_positions=positions == "batched"))
    assert n == 0, f"{n} host synchronisations in one steady {backend} GPT-2 step ({dtype}); at:\n" + "\n".join(where)


def test_a_steady_plan_pipeline_update_makes_no_host_synchronisation():
    from opake_fx.optimizers import sgd
    from opake_fx.plan import DPPlan
    from opake_fx.random import key

    torch.manual_seed(0)
    net, per_example, (x, y) = _lm()
    fmodel, params = make_functional(net)
    plan = DPPlan(dataset_size=600, batch_size=B, steps=10, noise_multiplier=1.0, clipping_norm=0.1,
                  clip_backend="auto")
    pipe = plan.pipeline(lambda p, xb, yb: per_example(fmodel(p, xb), yb), sgd(0.1), key=key(0), model=fmodel)
    state = [pipe.init(params)]

    def update() -> None:
        _, state[0] = pipe.update((x, y), state[0], params)

    n, where = _steady_syncs(update)
    assert n == 0, f"{n} host synchronisations in one steady pipeline update; first at:\n" + (where[0] if where else "")

"""The fast clipping backends end to end: fallbacks, per-group clipping, microbatching,
gradient checkpointing, the non-finite policy, AUTO-S / adaptive clipping and errors."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from opake_fx.dpsgd.clipping import _ghost, _rules_fallback, adaptive_clipped_grad, auto_clipped_grad, clipped_grad, per_group
from opake_fx.errors import InputValueError, OperationError, SlowPathWarning
from opake_fx.functional import make_functional
from opake_fx.random import key
from tests.dpsgd.test_ghost_layers import mse, reference, run_backend


def check(model: nn.Module, x: Any, y: Any, batched_of: Any = mse, backends: tuple[str, ...] = ("ghost", "auto"),
          rtol: float = 1e-9, c: float | None = None) -> None:
    model = model.double()
    fmodel, params = make_functional(model)
    batched = batched_of(fmodel)
    if c is None:
        c = float(reference(batched, params, x, y, math.inf)[1].median())
    want, norms, _ = reference(batched, params, x, y, c)
    for backend in backends:
        out, aux = run_backend(backend, batched, fmodel, params, x, y, c)
        for name, got, ref in zip(fmodel.param_names, out.pytree, want):
            assert float((got - ref).abs().max()) <= rtol * max(float(ref.abs().max()), 1e-12), (backend, name)
        torch.testing.assert_close(aux.grad_norms, norms, rtol=rtol, atol=1e-12)


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls = [0]
    original = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# --- fallbacks ----------------------------------------------------------------------


class ScaleShift(nn.Module):
    """A custom parameterised module: no rule, so ``scale`` (not broadcast as it is: through
    ``exp``) goes to the module fallback; ``shift`` is added, a broadcast the elementwise rule takes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * torch.exp(self.scale) + self.shift) * torch.exp(self.scale)


def test_custom_module_uses_the_module_fallback_only_for_its_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), ScaleShift(5), nn.PReLU(), nn.Linear(5, 2))
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    module_calls = count_calls(monkeypatch, _rules_fallback, "module_per_example")
    whole_calls = count_calls(monkeypatch, _ghost, "_whole_loss_per_example")
    check(model, x, y)
    assert module_calls[0] == 4  # ScaleShift and PReLU, for each of the two backends
    assert whole_calls[0] == 0


def test_multihead_attention_fallback_covers_out_proj(monkeypatch: pytest.MonkeyPatch) -> None:
    # nn.MultiheadAttention owns in_proj_weight and uses out_proj's parameters without calling out_proj.
    # A subclass with its own forward is outside the attention rule (it recomputes only the
    # module's own forward), so this call takes the module fallback, which must cover out_proj too.
    torch.manual_seed(1)

    class Scaled(nn.MultiheadAttention):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out, weights = super().forward(*args, **kwargs)
            return 0.5 * out, weights

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = Scaled(8, 2, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.mha(x, x, x, need_weights=True)[0]).squeeze(-1)

    module_calls = count_calls(monkeypatch, _rules_fallback, "module_per_example")
    x, y = torch.randn(5, 4, 8, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    check(Attn(), x, y)
    assert module_calls[0] == 2  # once per backend


def test_transformer_encoder_layer() -> None:
    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Linear(3, 8), layer, nn.Linear(8, 1))
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randn(4, 5, 1, dtype=torch.float64)
    check(model, x, y)


def test_parameter_used_outside_modules_goes_to_whole_loss_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))

    def batched_of(fmodel: Any) -> Any:
        def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = fmodel(p, x).squeeze(1)
            # p[0] (the first weight) is also read directly: a use no hook sees.
            return (out - y) ** 2 + 0.1 * (x @ p[0].t()).pow(2).sum(1)

        return loss

    whole = count_calls(monkeypatch, _ghost, "_whole_loss_per_example")
    with pytest.warns(SlowPathWarning, match=r"1 parameter\(s\).*0\.weight: also used outside the hooked module calls"):
        check(model, torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64), batched_of)
    assert whole[0] == 2  # once per backend, for that one leaf


def test_tied_embedding_and_output_layer() -> None:
    torch.manual_seed(4)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.out = nn.Linear(4, 7, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.emb(ids)))

    def batched_of(fmodel: Any) -> Any:
        def loss(p: Any, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = fmodel(p, ids)
            return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)

        return loss

    ids, y = torch.randint(0, 7, (6, 5)), torch.randint(0, 7, (6, 5))
    check(Tied(), ids, y, batched_of)


def test_layer_applied_twice() -> None:
    torch.manual_seed(5)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(torch.tanh(self.lin(x))))

    x = torch.randn(6, 3, 4, dtype=torch.float64)
    check(Twice(), x, torch.randn(6, 3, 4, dtype=torch.float64))


class _Pos(nn.Module):
    """Position embeddings looked up with arange(T) (no batch axis), joined to the batch by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.tok = nn.Embedding(9, 4)
        self.pos = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.pos(torch.arange(ids.shape[1]))
        h = self.tok(ids)
        h = h + p if self.how == "add" else h + torch.tanh(h @ p.T) @ p  # "matmul": meets the batch in a matmul
        return self.head(torch.tanh(h)).squeeze(-1)


def test_module_called_without_batch_dimension() -> None:
    # The shared-tensor rule takes the positions where they meet the batch (an add): no fallback.
    torch.manual_seed(6)
    ids = torch.randint(0, 9, (7, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        check(_Pos("add"), ids, torch.randn(7, 5, dtype=torch.float64))


def test_shared_tensor_meeting_the_batch_elsewhere_takes_the_whole_loss_fallback() -> None:
    torch.manual_seed(6)
    ids = torch.randint(0, 9, (7, 5))
    with pytest.warns(SlowPathWarning, match=r"pos\.weight: its module's outputs have no batch axis and meet the batch "
                      r"in an op the shared-tensor rule does not take \(.*matmul.*\)"):
        check(_Pos("matmul"), ids, torch.randn(7, 5, dtype=torch.float64))


def test_fast_paths_do_not_warn() -> None:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Embedding(9, 4), nn.Flatten(), nn.Linear(20, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        check(model, torch.randint(0, 9, (6, 5)), torch.randn(6, 1, dtype=torch.float64))


def test_unused_and_frozen_parameters() -> None:
    torch.manual_seed(7)

    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 2)
            self.unused = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Partial().double()
    fmodel, params = make_functional(model)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    out, aux = run_backend("ghost", mse(fmodel), fmodel, params, x, y, 1.0)
    assert float(out.pytree[2].abs().max()) == 0.0 and float(out.pytree[3].abs().max()) == 0.0
    want, norms, _ = reference(mse(fmodel), params, x, y, 1.0)
    torch.testing.assert_close(aux.grad_norms, norms)


# --- engine features --------------------------------------------------------------------


def small_cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(8)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 25, 3))
    return model, torch.randn(10, 1, 5, 5), torch.randint(0, 3, (10,))


def ce(fmodel: Any) -> Any:
    return lambda p, x, y: F.cross_entropy(fmodel(p, x), y, reduction="none")


@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_per_group_matches_vmap(backend: str) -> None:
    model, x, y = small_cnn()
    fmodel, params = make_functional(model)
    groups = per_group(params, names=fmodel.param_names, bias=(0.05, "*bias"), norm=(0.2, "1.*"), rest=(0.5, "*"))
    want, want_aux = run_backend("vmap", ce(fmodel), fmodel, params, x, y, groups)  # type: ignore[arg-type]
    got, got_aux = run_backend(backend, ce(fmodel), fmodel, params, x, y, groups)  # type: ignore[arg-type]
    assert got.max_norm == want.max_norm
    for a, b in zip(got.pytree, want.pytree):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for g in want_aux.group_norms:
        torch.testing.assert_close(got_aux.group_norms[g], want_aux.group_norms[g], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_microbatching_gives_the_same_result(backend: str) -> None:
    model, x, y = small_cnn()
    fmodel, params = make_functional(model)
    full, full_aux = run_backend(backend, ce(fmodel), fmodel, params, x, y, 0.3)
    micro, micro_aux = run_backend(backend, ce(fmodel), fmodel, params, x, y, 0.3, microbatch_size=3)
    for a, b in zip(full.pytree, micro.pytree):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(full_aux.grad_norms, micro_aux.grad_norms)
    torch.testing.assert_close(full_aux.loss_values, micro_aux.loss_values)


def test_gradient_checkpointing_composes_with_every_backend() -> None:
    torch.manual_seed(9)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(6)
            self.ff = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
            self.scale = ScaleShift(6)  # a fallback module inside the checkpointed region

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.scale(self.ff(self.ln(x)))

    class Net(nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            self.emb = nn.Embedding(11, 6)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(6, 11)
            self.ckpt = ckpt

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            for b in self.blocks:
                h = checkpoint(b, h, use_reentrant=False) if self.ckpt else b(h)
            return self.head(h)

    def batched_of(fmodel: Any) -> Any:
        return lambda p, ids, y: F.cross_entropy(fmodel(p, ids).transpose(1, 2), y, reduction="none").mean(1)

    ids, y = torch.randint(0, 11, (6, 7)), torch.randint(0, 11, (6, 7))
    torch.manual_seed(10)
    plain = Net(ckpt=False).double()
    ckpt = Net(ckpt=True).double()
    ckpt.load_state_dict(plain.state_dict())
    check(ckpt, ids, y, batched_of, backends=("ghost", "auto", "vmap"))


@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_nonfinite_examples_are_zeroed_and_counted(backend: str) -> None:
    model, x, y = small_cnn()
    x[3, 0, 2, 2] = float("nan")
    x[7, 0, 0, 0] = float("inf")
    fmodel, params = make_functional(model)
    fn, state = clipped_grad(ce(fmodel), clipping_norm=0.5, batch_argnums=(1, 2), return_stats=True,
                             clip_backend=backend, model=fmodel)
    (out, stats), _ = fn(params, x, y, state=state)
    assert stats.num_nonfinite == 2
    keep = torch.tensor([i not in (3, 7) for i in range(10)])
    ref, _ = run_backend("vmap", ce(fmodel), fmodel, params, x[keep], y[keep], 0.5)
    for a, b in zip(out.pytree, ref.pytree):
        assert bool(torch.isfinite(a).all())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_low_precision_model_accumulates_in_float32() -> None:
    model, x, y = small_cnn()
    fmodel32, params32 = make_functional(model)
    fmodel, params = make_functional(model.to(torch.bfloat16))
    out, _ = run_backend("auto", ce(fmodel), fmodel, params, x.bfloat16(), y, 0.5)
    assert all(t.dtype == torch.float32 for t in out.pytree)
    ref, _ = run_backend("vmap", ce(fmodel), fmodel, params, x.bfloat16(), y, 0.5)
    for a, b in zip(out.pytree, ref.pytree):
        assert float((a - b).abs().max()) <= 0.05 * float(b.abs().max()) + 1e-3


def test_empty_batch() -> None:
    model, x, y = small_cnn()
    fmodel, params = make_functional(model)
    out, aux = run_backend("auto", ce(fmodel), fmodel, params, x[:0], y[:0], 1.0)
    assert aux.batch_size == 0 and all(float(t.abs().sum()) == 0 for t in out.pytree)


def test_has_aux_and_kwargs() -> None:
    model, x, y = small_cnn()
    fmodel, params = make_functional(model)

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor, *, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        logits = fmodel(p, x) / temperature
        return F.cross_entropy(logits, y, reduction="none"), logits.argmax(1)

    fn, state = clipped_grad(loss, has_aux=True, clipping_norm=1.0, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    (out, pred), _ = fn(params, x, y, state=state, temperature=2.0)
    assert pred.shape == (10,)


@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_auto_clipping_and_adaptive_clipping(backend: str) -> None:
    model, x, y = small_cnn()
    fmodel, params = make_functional(model)
    per_example = lambda p, xi, yi: ce(fmodel)(p, xi[None], yi[None])[0]  # noqa: E731
    for make, kw in ((auto_clipped_grad, dict(clipping_norm=1.0, gamma=0.01)),
                     (adaptive_clipped_grad, dict(initial_clipping_norm=0.3, count_noise_multiplier=0.0, key=key(0), expected_batch_size=10))):
        ref_fn, ref_state = make(per_example, batch_argnums=(1, 2), **kw)
        fn, state = make(ce(fmodel), batch_argnums=(1, 2), clip_backend=backend, model=fmodel, **kw)
        for _ in range(2):
            want, ref_state = ref_fn(params, x, y, state=ref_state)
            got, state = fn(params, x, y, state=state)
            for a, b in zip(got.pytree, want.pytree):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert getattr(state, "clipping_norm") == pytest.approx(getattr(ref_state, "clipping_norm"))


# --- errors ------------------------------------------------------------------------------


def test_scalar_loss_is_rejected_with_a_hint() -> None:
    model, x, y = small_cnn()
    fmodel, params = make_functional(model)
    fn, state = clipped_grad(lambda p, x, y: F.cross_entropy(fmodel(p, x), y), clipping_norm=1.0,
                             batch_argnums=(1, 2), clip_backend="ghost", model=fmodel)
    with pytest.raises(InputValueError, match="reduction='none'"):
        fn(params, x, y, state=state)


def test_backend_arguments_are_checked() -> None:
    with pytest.raises(InputValueError, match="needs model="):
        clipped_grad(lambda p, x: x, clipping_norm=1.0, clip_backend="auto")
    with pytest.raises(InputValueError, match="clip_backend must be"):
        clipped_grad(lambda p, x: x, clipping_norm=1.0, clip_backend="fast", model=nn.Linear(1, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        clipped_grad(lambda p, x: x, clipping_norm=1.0, clip_backend="auto", model="net")  # type: ignore[arg-type]


@pytest.mark.parametrize("case", ["batchnorm", "freq", "max_norm"])
def test_modules_that_mix_examples_are_errors(case: str) -> None:
    if case == "batchnorm":
        model: nn.Module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        x: torch.Tensor = torch.randn(6, 3)
    else:
        emb = nn.Embedding(5, 3, scale_grad_by_freq=True) if case == "freq" else nn.Embedding(5, 3, max_norm=1.0)
        model, x = nn.Sequential(emb, nn.Flatten(), nn.Linear(6, 1)), torch.randint(0, 5, (6, 2))
    fmodel, params = make_functional(model)
    fn, state = clipped_grad(lambda p, x, y: (fmodel(p, x).squeeze(1) - y) ** 2, clipping_norm=1.0,
                             batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    with pytest.raises(InputValueError, match={"batchnorm": "BatchNorm", "freq": "scale_grad_by_freq", "max_norm": "max_norm"}[case]):
        fn(params, x, torch.randn(6), state=state)


def test_batchnorm_in_eval_mode_is_fine() -> None:
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model(torch.randn(20, 3))  # non-trivial running statistics
    model.eval()
    check(model, torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64))


def test_input_modified_in_place_after_use_is_an_error() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 1.0
            out = self.lin(h)
            h.mul_(2.0)  # the Linear's input changes after the Linear read it
            return out + h

    fmodel, params = make_functional(Bad())
    fn, state = clipped_grad(lambda p, x, y: ((fmodel(p, x) - y) ** 2).sum(1), clipping_norm=1.0,
                             batch_argnums=(1, 2), clip_backend="ghost", model=fmodel)
    with pytest.raises(OperationError, match="in place"):
        fn(params, torch.randn(4, 3), torch.randn(4, 3), state=state)


def test_checkpoint_recomputation_uses_the_params_passed_in() -> None:
    # functional_call has returned when the backward pass recomputes a checkpointed segment;
    # the module's own (here: different, stale) parameters must not leak into the result.
    torch.manual_seed(12)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(lambda z: torch.tanh(self.a(z)), x, use_reentrant=False)
            return self.b(h).squeeze(1)

    model = Net().double()
    fmodel, params = make_functional(model)
    fresh = tuple(p.detach().clone() * 1.5 + 0.1 for p in params)  # not the module's own parameters
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    loss = lambda p, x, y: (fmodel(p, x) - y) ** 2  # noqa: E731

    def plain(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a_w, a_b, b_w, b_b = p
        return (F.linear(torch.tanh(F.linear(x, a_w, a_b)), b_w, b_b).squeeze(1) - y) ** 2

    want, norms, _ = reference(plain, fresh, x, y, 0.5)
    for backend in ("ghost", "auto"):
        out, aux = run_backend(backend, loss, fmodel, fresh, x, y, 0.5)
        for got, ref in zip(out.pytree, want):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(aux.grad_norms, norms)


@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_huge_but_finite_gradients_are_clipped_not_zeroed(backend: str) -> None:
    # Entries of 1e20 are finite in float32 but their squares are not: norms are redone in float64.
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    fmodel, params = make_functional(model)
    x = torch.randn(5, 4)
    x[2] *= 1e20
    loss = lambda p, x, y: fmodel(p, x).squeeze(1) * y  # noqa: E731
    y = torch.ones(5)
    want, want_aux = run_backend("vmap", loss, fmodel, params, x, y, 1.0)
    got, got_aux = run_backend(backend, loss, fmodel, params, x, y, 1.0)
    assert got_aux.num_nonfinite == want_aux.num_nonfinite == 0
    torch.testing.assert_close(got_aux.grad_norms, want_aux.grad_norms, rtol=1e-5, atol=0)
    for a, b in zip(got.pytree, want.pytree):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clip_stage_takes_the_fast_backend():
    from opake_fx.dpsgd import clip
    from opake_fx.functional import make_functional

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    fmodel, params = make_functional(model)
    x, y = torch.randn(9, 5), torch.randint(0, 2, (9,))

    def one(p, xi, yi):
        return torch.nn.functional.cross_entropy(fmodel(p, xi[None]), yi[None])

    def batched(p, xb, yb):
        return torch.nn.functional.cross_entropy(fmodel(p, xb), yb, reduction="none")

    slow = clip(one, clipping_norm=0.1, batch_argnums=(1, 2))
    fast = clip(batched, clipping_norm=0.1, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    a, _ = slow.update((x, y), slow.init(params), params)
    b, _ = fast.update((x, y), fast.init(params), params)
    assert a.max_norm == b.max_norm
    for u, v in zip(a.pytree, b.pytree):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-7)

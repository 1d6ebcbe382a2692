"""DP training of an FSDP2 model on 2 gloo ranks equals the single-process run (issue 32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.distributed import psum
from opake_fx.dpsgd import clip, noise
from opake_fx.functional import make_functional
from opake_fx.optimizers import adam, sgd
from opake_fx.random import key
from opake_fx.transforms import apply_updates, named_chain

STEPS, B, C, SIGMA = 20, 12, 0.7, 0.8


def _model() -> nn.Module:
    torch.manual_seed(0)
    # odd sizes: 7 and 3 rows split unevenly over 2 ranks (4 + 3, 2 + 1)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(B, 5, generator=g) * 3, torch.randint(0, 3, (B,), generator=g)


def _stages(fmodel, backend, opt, zero_loss=False):
    def loss(p, xb, yb):
        out = F.cross_entropy(fmodel(p, xb), yb, reduction="none")
        return out * 0.0 if zero_loss else out
    return (clip(loss, clipping_norm=C, batch_argnums=(1, 2), normalize_by=float(B), clip_backend=backend, model=fmodel),
            noise(noise_multiplier=SIGMA, key=key(7)), opt)


def _single(backend: str, opt_name: str, zero_loss: bool = False) -> list[torch.Tensor]:
    fmodel, params = make_functional(_model())
    c, n, o = _stages(fmodel, backend, adam(1e-2) if opt_name == "adam" else sgd(1.0), zero_loss)
    pipe = named_chain(("clip", c), ("psum", psum()), ("noise", n), ("opt", o))
    state = pipe.init(params)
    for t in range(STEPS):
        updates, state = pipe.update(_batch(t), state, params)
        params = apply_updates(params, updates)
    return [p.clone() for p in params]


def _sharded(rank: int, world_size: int, backend: str, opt_name: str, zero_loss: bool = False) -> list[list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake_fx.distributed.fsdp import fsdp_pipeline, make_functional_fsdp

    model = _model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fmodel, params = make_functional_fsdp(model)
    c, n, o = _stages(fmodel, backend, adam(1e-2) if opt_name == "adam" else sgd(1.0), zero_loss)
    pipe = fsdp_pipeline(c, n, o)
    state = pipe.init(params)
    for t in range(STEPS):
        x, y = _batch(t)
        mine = slice(rank * B // world_size, (rank + 1) * B // world_size)  # each example on one rank
        updates, state = pipe.update((x[mine], y[mine]), state, params)
        params = apply_updates(params, updates)
    return [p.full_tensor().tolist() for p in params]


@pytest.mark.distributed
@pytest.mark.parametrize("backend,opt_name", [("vmap", "adam"), ("auto", "sgd")])
def test_fsdp2_training_equals_the_single_process_run(group2, backend, opt_name):
    r0, r1 = group2.run(_sharded, backend, opt_name, timeout=180.0)
    assert r0 == r1  # every rank gathers the same parameters
    want = _single(backend, opt_name)
    for got, w in zip(r0, want):
        torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_fsdp2_noise_is_the_unsharded_noise_bit_for_bit(group2):
    """A zero loss: the clipped sum is 0, so the parameters move by the noise alone (sgd, lr 1)."""
    r0, _ = group2.run(_sharded, "vmap", "sgd", True, timeout=180.0)
    want = _single("vmap", "sgd", zero_loss=True)
    assert all(torch.equal(torch.tensor(got), w) for got, w in zip(r0, want))


def _plan_run(rank: int, world_size: int, keys=(0, 0)) -> list[list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake_fx.distributed.fsdp import make_functional_fsdp
    from opake_fx.plan import DPPlan

    model = _model()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    fmodel, params = make_functional_fsdp(model)
    plan = DPPlan(dataset_size=96, batch_size=24, steps=4, clipping_norm=C, noise_multiplier=1.0, delta=1e-5,
                  clip_backend="auto")
    x = torch.randn(96, 5, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (96,), generator=torch.Generator().manual_seed(4))
    loss = lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none")  # noqa: E731
    pipe = plan.pipeline(loss, sgd(0.5), key=key(keys[rank]), model=fmodel)
    state, acct = pipe.init(params), plan.accountant()
    for t, batch in enumerate(plan.sampler(x, key(100))):  # a sampler key neither rank uses for noise
        acct.step(plan.step_cost_at(t))
        idx = torch.as_tensor(batch, dtype=torch.long)
        updates, state = pipe.update((x[idx], y[idx]), state, params)
        params = apply_updates(params, updates)
    report = str(pipe.privacy_report(sample_rate=plan.sample_rate, steps=plan.steps, delta=plan.delta))
    return [[p.full_tensor().tolist() for p in params], report, acct.epsilon]


@pytest.mark.distributed
def test_a_plan_drives_an_fsdp2_model(group2):
    (p0, report, eps), (p1, _, _) = group2.run(_plan_run, timeout=180.0)
    assert p0 == p1 and "reduce_scatter" in report and "epsilon per example" in report and 0 < eps < float("inf")


@pytest.mark.distributed
def test_ranks_with_different_noise_keys_are_refused(group2):
    outs = group2.outcomes(_plan_run, (0, 1), timeout=180.0)
    assert all(o.status == "error" and "gaussian_noise.key differs" in o.value for o in outs), [
        str(o.value)[-400:] for o in outs]


@pytest.mark.parametrize("strategy", ["identity", "bsr"])
def test_sharded_values_get_their_rows_of_the_one_unsharded_noise(strategy):
    """A mechanism that drew the same keyed noise for every rank's shard would give different coordinates equal
    noise (the difference of two shards would cancel it). A RowShardedClippedPytree is not a ClippedPytree: the
    Gaussian and the DP-FTRL noise stages draw exactly its rows of the unsharded noise (the correlated noise's
    buffers holding those rows), and the draws that cannot skip to rows (exact, secure) refuse it."""
    from opake_fx.dpftrl.noise import mf_gaussian_noise
    from opake_fx.dpftrl.strategies import bsr_strategy, identity_strategy
    from opake_fx.errors import InputValueError
    from opake_fx.types import ClippedPytree, RowShardedClippedPytree

    make = identity_strategy if strategy == "identity" else lambda n: bsr_strategy(n, 2)
    whole_fn, whole = mf_gaussian_noise(make(3), noise_multiplier=1.0, key=key(0))
    shard_fn, shard = mf_gaussian_noise(make(3), noise_multiplier=1.0, key=key(0))
    for _ in range(3):  # three steps: the banded inverse's buffers carry each coordinate's own past draws
        full, whole = whole_fn(ClippedPytree((torch.zeros(5, 3),), max_norm=0.5), whole)
        rows, shard = shard_fn(RowShardedClippedPytree((torch.zeros(2, 3),), max_norm=0.5, full_shapes=((5, 3),),
                                                       rows=((2, 4),)), shard)
        assert torch.equal(rows.pytree[0], full.pytree[0][2:4])
    exact_fn, exact_state = mf_gaussian_noise(make(3), noise_multiplier=1.0, key=key(0), exact=True)
    one = RowShardedClippedPytree((torch.zeros(2, 3),), max_norm=0.5, full_shapes=((4, 3),), rows=((2, 4),))
    with pytest.raises(InputValueError, match="not exact=True"):
        exact_fn(one, exact_state)
    stage = noise(noise_multiplier=1.0, key=key(0))
    other = RowShardedClippedPytree((torch.zeros(2, 3),), max_norm=0.5, full_shapes=((4, 3),), rows=((0, 2),))
    a, _ = stage.update(one, stage.init(None))
    b, _ = stage.update(other, stage.init(None))
    assert not torch.equal(a.pytree[0], b.pytree[0])  # the two ranks' rows get different noise
    secure = noise(noise_multiplier=1.0, key=key(0), secure=True)
    with pytest.raises(InputValueError, match="not exact=True or secure=True"):
        secure.update(one, secure.init(None))
    with pytest.raises(Exception, match="rows"):
        RowShardedClippedPytree((torch.zeros(3, 3),), max_norm=0.5, full_shapes=((4, 3),), rows=((2, 4),))


class _LoraLinear(nn.Module):
    """A frozen base with a trainable rank-2 adapter (what peft builds)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base, self.a, self.b = nn.Linear(d_in, d_out), nn.Linear(d_in, 2, bias=False), nn.Linear(2, d_out, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


class _Tied(nn.Module):
    """A tied LM head: the embedding's weight is the output layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


def _arch(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "lora":
        return nn.Sequential(_LoraLinear(5, 7), nn.Tanh(), _LoraLinear(7, 3))
    return _Tied()


def _arch_batch(name: str, t: int):
    g = torch.Generator().manual_seed(200 + t)
    if name == "lora":
        return torch.randn(B, 5, generator=g) * 3, torch.randint(0, 3, (B,), generator=g)
    tokens = torch.randint(0, 11, (B, 4), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _arch_loss(fmodel, name, backend):
    if name == "lora":
        return lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none")
    if backend == "vmap":  # one example: tokens [T]
        return lambda p, tb, yb: F.cross_entropy(fmodel(p, tb), yb)
    return lambda p, tb, yb: F.cross_entropy(fmodel(p, tb).transpose(1, 2), yb, reduction="none").mean(1)


def _arch_single(name: str, backend: str) -> list[torch.Tensor]:
    fmodel, params = make_functional(_arch(name), trainable_only=name == "lora")
    c, n, o = (clip(_arch_loss(fmodel, name, backend), clipping_norm=C, batch_argnums=(1, 2), normalize_by=float(B),
                    clip_backend=backend, model=fmodel), noise(noise_multiplier=SIGMA, key=key(7)), adam(1e-2))
    pipe = named_chain(("clip", c), ("psum", psum()), ("noise", n), ("opt", o))
    state = pipe.init(params)
    for t in range(8):
        updates, state = pipe.update(_arch_batch(name, t), state, params)
        params = apply_updates(params, updates)
    return [p.clone() for p in params]


def _arch_sharded(rank: int, world_size: int, name: str, backend: str) -> list[list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake_fx.distributed.fsdp import fsdp_pipeline, make_functional_fsdp

    model = _arch(name)
    mesh = init_device_mesh("cpu", (world_size,))
    if name == "lora":
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # a tied weight lives in one group: the root's
    fmodel, params = make_functional_fsdp(model, trainable_only=name == "lora")
    c, n, o = (clip(_arch_loss(fmodel, name, backend), clipping_norm=C, batch_argnums=(1, 2), normalize_by=float(B),
                    clip_backend=backend, model=fmodel), noise(noise_multiplier=SIGMA, key=key(7)), adam(1e-2))
    pipe = fsdp_pipeline(c, n, o, model=fmodel)
    state = pipe.init(params)
    for t in range(8):
        xb, yb = _arch_batch(name, t)
        mine = slice(rank * B // world_size, (rank + 1) * B // world_size)
        updates, state = pipe.update((xb[mine], yb[mine]), state, params)
        params = apply_updates(params, updates)
    frozen = [p.full_tensor().tolist() for n_, p in model.named_parameters() if not p.requires_grad]
    return [[p.full_tensor().tolist() for p in params], list(fmodel.param_names), frozen]


@pytest.mark.distributed
@pytest.mark.parametrize("name,backend", [("lora", "vmap"), ("lora", "auto"), ("tied", "vmap"), ("tied", "auto")])
def test_lora_on_a_sharded_base_and_a_tied_head_train_as_in_one_process(group2, name, backend):
    (got, names, frozen), _ = group2.run(_arch_sharded, name, backend, timeout=180.0)
    ref_model = _arch(name)
    fmodel, _ = make_functional(ref_model, trainable_only=name == "lora")
    assert names == list(fmodel.param_names)  # LoRA: the adapters only; tied: the shared weight once
    if name == "lora":
        assert names == ["0.a.weight", "0.b.weight", "2.a.weight", "2.b.weight"]
        base = [p.tolist() for n_, p in ref_model.named_parameters() if not p.requires_grad]
        assert frozen == base  # the sharded base never moved
    else:
        assert names == ["emb.weight", "mix.weight", "mix.bias"]
    for g, w in zip(got, _arch_single(name, backend)):
        torch.testing.assert_close(torch.tensor(g), w, rtol=1e-5, atol=1e-6)


# --- mixed precision: FSDP2's MixedPrecisionPolicy(param_dtype=bf16) ---------------------------------


def _bf16_loss(fmodel, seen, zero_loss=False):
    def loss(p, xb, yb):
        seen.add(str(p[0].dtype))
        out = F.cross_entropy(fmodel(p, xb).float(), yb, reduction="none")  # the model's input x stays float32
        return out * 0.0 if zero_loss else out
    return loss


def _bf16_single(backend: str, zero_loss: bool = False) -> list[torch.Tensor]:
    """The reference: float32 master parameters, the clip stage given their bfloat16 casts, float32 noise."""
    fmodel, params = make_functional(_model())
    seen: set[str] = set()
    model_loss = _bf16_loss(lambda p, x: fmodel(p, x.to(torch.bfloat16)), seen, zero_loss)
    c = clip(model_loss, clipping_norm=C, batch_argnums=(1, 2), normalize_by=float(B), clip_backend=backend,
             model=fmodel)
    n, o = noise(noise_multiplier=SIGMA, key=key(7)), sgd(1.0)
    cs, ns = c.init(tuple(p.to(torch.bfloat16) for p in params)), n.init(None)
    os_ = o.init(params)
    for t in range(8):
        clipped, cs = c.update(_batch(t), cs, tuple(p.to(torch.bfloat16) for p in params))
        noised, ns = n.update(clipped, ns)
        updates, os_ = o.update(noised, os_, params)
        params = apply_updates(params, updates)
    assert "torch.bfloat16" in seen and "torch.float32" not in seen  # (auto's independence probe runs float64)
    return [p.clone() for p in params]


def _bf16_sharded(rank: int, world_size: int, backend: str, zero_loss: bool = False) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from opake_fx.distributed.fsdp import fsdp_pipeline, make_functional_fsdp
    from opake_fx.errors import InputValueError

    model = _model()
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    fmodel, params = make_functional_fsdp(model)
    seen: set[str] = set()
    c = clip(_bf16_loss(fmodel, seen, zero_loss), clipping_norm=C, batch_argnums=(1, 2), normalize_by=float(B),
             clip_backend=backend, model=fmodel)
    pipe = fsdp_pipeline(c, noise(noise_multiplier=SIGMA, key=key(7)), sgd(1.0), model=fmodel)
    state = pipe.init(params)
    dtypes = set()
    for t in range(8):
        x, y = _batch(t)
        mine = slice(rank * B // world_size, (rank + 1) * B // world_size)
        updates, state = pipe.update((x[mine], y[mine]), state, params)
        dtypes |= {str(u.dtype) for u in updates}
        params = apply_updates(params, updates)
    try:  # the policy's dtype is not optional: float32 parameters given straight to fmodel are refused
        fmodel(tuple(p.full_tensor() for p in params), x)
        refusal = ""
    except InputValueError as exc:
        refusal = str(exc)
    return [[p.full_tensor().tolist() for p in params], sorted(seen), sorted(dtypes | {str(params[0].dtype)}), refusal]


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["vmap", "auto"])
def test_bf16_compute_with_float32_sums_noise_and_parameters_trains_as_in_one_process(group2, backend):
    (got, seen, dtypes, refusal), (got1, _, _, _) = group2.run(_bf16_sharded, backend, timeout=180.0)
    assert got == got1 and "torch.bfloat16" in seen and "torch.float32" not in seen and dtypes == ["torch.float32"]
    assert "MixedPrecisionPolicy computes in torch.bfloat16" in refusal
    want = _bf16_single(backend)
    for g, w in zip(got, want):  # the two ranks' bf16 forward sees 6 examples, the reference 12: an ulp apart
        torch.testing.assert_close(torch.tensor(g), w, rtol=2e-2, atol=2e-3)
    float32_run = _single(backend, "sgd")
    assert max((torch.tensor(g) - w).abs().max().item() for g, w in zip(got, float32_run[:4])) > 0  # bf16 did run


@pytest.mark.distributed
def test_bf16_compute_draws_the_float32_noise_of_the_unsharded_run_bit_for_bit(group2):
    (got, _, _, _), _ = group2.run(_bf16_sharded, "vmap", True, timeout=180.0)
    want = _bf16_single("vmap", zero_loss=True)
    assert all(torch.equal(torch.tensor(g), w) for g, w in zip(got, want))


# --- a parameter no rule covers: auto's exact fallback, with its warning, sharded -------------------


def _fallback_loss(fmodel):
    def loss(p, xb, yb):  # p[0] (the first weight) is also read directly: a use no hook sees
        return F.cross_entropy(fmodel(p, xb), yb, reduction="none") + 0.01 * (xb @ p[0].t()).pow(2).sum(-1)
    return loss


def _fallback_run(rank: int, world_size: int) -> list:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake_fx.distributed.fsdp import fsdp_pipeline, make_functional_fsdp
    from opake_fx.errors import SlowPathWarning

    model = _model()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    fmodel, params = make_functional_fsdp(model)
    c = clip(_fallback_loss(fmodel), clipping_norm=C, batch_argnums=(1, 2), normalize_by=float(B), clip_backend="auto",
             model=fmodel)
    pipe = fsdp_pipeline(c, noise(noise_multiplier=SIGMA, key=key(7)), sgd(1.0), model=fmodel)
    state = pipe.init(params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SlowPathWarning)
        for t in range(4):
            x, y = _batch(t)
            mine = slice(rank * B // world_size, (rank + 1) * B // world_size)
            updates, state = pipe.update((x[mine], y[mine]), state, params)
            params = apply_updates(params, updates)
    said = [str(w.message) for w in caught if issubclass(w.category, SlowPathWarning)]
    return [[p.full_tensor().tolist() for p in params], said]


@pytest.mark.distributed
def test_a_parameter_no_rule_covers_takes_the_exact_fallback_with_its_warning_sharded(group2):
    (got, said), (got1, said1) = group2.run(_fallback_run, timeout=180.0)
    assert got == got1 and said and said1 and "0.weight" in said[0]
    fmodel, params = make_functional(_model())
    c = clip(_fallback_loss(fmodel), clipping_norm=C, batch_argnums=(1, 2), normalize_by=float(B), clip_backend="vmap",
             model=fmodel)  # the reference: per-example gradients by vmap, nothing to fall back from
    pipe = named_chain(("clip", c), ("psum", psum()), ("noise", noise(noise_multiplier=SIGMA, key=key(7))),
                       ("opt", sgd(1.0)))
    state = pipe.init(params)
    for t in range(4):
        updates, state = pipe.update(_batch(t), state, params)
        params = apply_updates(params, updates)
    for g, w in zip(got, params):
        torch.testing.assert_close(torch.tensor(g), w, rtol=1e-5, atol=1e-6)


# --- DP-FTRL (correlated noise) on a sharded model ------------------------------------------------


def _ftrl_run(rank: int, world_size: int, mechanism: str, zero_loss: bool, per_group: bool = False,
              clipping_mode: str = "fixed", augmult: int = 1) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake_fx.distributed.fsdp import make_functional_fsdp
    from opake_fx.plan import DPPlan

    from opake_fx.planning.clip_norms import per_group_by_regex

    norm = C
    if per_group:  # the first layer at 0.3, everything else at 1.0 (its own noise stddev per group)
        fm, p0 = make_functional(_model())
        norm = per_group_by_regex(p0, list(fm.param_names), {r"^0\.": 0.3, "fallback": 1.0})
    sampling = dict(sampling="b_min_sep", min_sep=2) if mechanism != "gaussian" else {}
    plan = DPPlan(dataset_size=96, batch_size=24, steps=8, clipping_norm=norm, noise_multiplier=1.0, delta=1e-5,
                  mechanism=mechanism, clip_backend="auto", clipping_mode=clipping_mode, augmult=augmult, **sampling,
                  **({"bands": 2} if mechanism == "band_mf" else {}))
    x = torch.randn(96, 5, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (96,), generator=torch.Generator().manual_seed(4))
    out = []
    for sharded in (False, True):  # the data-parallel run, then the FSDP2 run: the same keys and batches
        model = _model()
        if sharded:
            mesh = init_device_mesh("cpu", (world_size,))
            fully_shard(model[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
            fmodel, params = make_functional_fsdp(model)
        else:
            fmodel, params = make_functional(model)

        def loss(p, xb, yb, fmodel=fmodel):
            per_example = F.cross_entropy(fmodel(p, xb), yb, reduction="none")
            return per_example * 0.0 if zero_loss else per_example

        count = {"count_key": key(5)} if clipping_mode == "adaptive" else {}
        if augmult > 1:
            from opake_fx.augmult import gaussian_noise

            count.update(augment=gaussian_noise, augment_key=key(9))
        pipe = plan.pipeline(loss, sgd(0.5), key=key(0), model=fmodel, **count)
        state = pipe.init(params)
        norms = []
        for batch in plan.sampler(x, key(100)):
            idx = torch.as_tensor(batch, dtype=torch.long)
            updates, state = pipe.update((x[idx], y[idx]), state, params)
            params = apply_updates(params, updates)
            if clipping_mode == "adaptive":  # the AdaptiveClipState, inside the plan's clip stage state
                clip_state = state.clip if sharded else state["clip"]
                while not hasattr(clip_state, "clipping_norm"):
                    clip_state = clip_state.clip_state
                norms.append(float(clip_state.clipping_norm))
        out.append([(p.full_tensor() if sharded else p).tolist() for p in params])
        out.append(norms)
    return out[0::2] if clipping_mode == "fixed" else out


@pytest.mark.distributed
@pytest.mark.parametrize("mechanism", ["blt", "band_mf"])
def test_dp_ftrl_on_an_fsdp2_model_equals_the_data_parallel_run(group2, mechanism):
    (ddp, fsdp), (ddp1, fsdp1) = group2.run(_ftrl_run, mechanism, False, timeout=180.0)
    assert ddp == ddp1 and fsdp == fsdp1
    for got, want in zip(fsdp, ddp):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    (ddp, fsdp), _ = group2.run(_ftrl_run, mechanism, True, timeout=180.0)  # the correlated noise alone
    init = [p.tolist() for p in make_functional(_model())[1]]
    assert fsdp == ddp and fsdp != init  # each rank's rows of the one correlated noise, bit for bit


@pytest.mark.distributed
def test_per_group_clip_norms_on_an_fsdp2_model_equal_the_data_parallel_run(group2):
    (ddp, fsdp), _ = group2.run(_ftrl_run, "gaussian", False, True, timeout=180.0)
    for got, want in zip(fsdp, ddp):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    (ddp, fsdp), _ = group2.run(_ftrl_run, "gaussian", True, True, timeout=180.0)  # the per-group noise alone
    init = [p.tolist() for p in make_functional(_model())[1]]
    assert fsdp == ddp and fsdp != init


@pytest.mark.distributed
def test_adaptive_clipping_on_an_fsdp2_model_equals_the_data_parallel_run(group2):
    """The noised count is summed over the ranks as under data parallelism: every rank moves the clip norm alike."""
    (ddp, ddp_norms, fsdp, fsdp_norms), (_, _, fsdp1, fsdp_norms1) = group2.run(
        _ftrl_run, "gaussian", False, False, "adaptive", timeout=180.0)
    assert fsdp_norms == ddp_norms == fsdp_norms1 and len(set(ddp_norms)) > 1  # the norm moved, alike everywhere
    assert fsdp == fsdp1
    for got, want in zip(fsdp, ddp):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_augmult_on_an_fsdp2_model_equals_the_data_parallel_run(group2):
    (ddp, fsdp), (_, fsdp1) = group2.run(_ftrl_run, "gaussian", False, False, "fixed", 3, timeout=180.0)
    assert fsdp == fsdp1
    for got, want in zip(fsdp, ddp):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    (plain, _), _ = group2.run(_ftrl_run, "gaussian", False, timeout=180.0)
    assert plain != ddp  # the K = 3 augmented copies changed the run

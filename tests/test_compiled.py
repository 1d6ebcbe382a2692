"""The compiled DP step (opake_fx.compiled): the same mechanism as the eager pipeline.

Compiled and eager steps with the same keys give the same parameters (float32, 1e-6
relative over 20 steps), the noise is bit-identical, padding to a bucket changes
nothing, a Poisson run compiles once per bucket it meets, the certified norms stay upper
bounds in compiled code on adversarial inputs, and a model the compiler cannot trace
still trains, with the break reported.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.compiled import compile_step
from opake_fx.dpsgd import clip, noise
from opake_fx.errors import InputValueError, SlowPathWarning
from opake_fx.functional import make_functional
from opake_fx.optimizers import adam, sgd
from opake_fx.padding import geometric_buckets
from opake_fx.plan import DPPlan
from opake_fx.pytree import leaves, zeros_like
from opake_fx.random import key
from opake_fx.scheduling import cosine
from opake_fx.transforms import apply_updates, chain, stateless

D, K = 12, 4


def _mlp(backend: str = "vmap"):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, K))
    fmodel, params = make_functional(net)
    if backend == "vmap":
        def loss(p, x, y):
            return F.cross_entropy(fmodel(p, x.unsqueeze(0)), y.unsqueeze(0))
    else:
        def loss(p, x, y):
            return F.cross_entropy(fmodel(p, x), y, reduction="none")
    return fmodel, params, loss


def _batches(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g)) for n in sizes]


def _max_rel(a, b) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(leaves(a), leaves(b), strict=True))


def test_compiled_equals_eager_over_20_padded_steps():
    fmodel, params, loss = _mlp()
    plan = DPPlan(dataset_size=500, batch_size=16, steps=20, noise_multiplier=1.0, clipping_norm=1.0)
    step = plan.compiled_step(loss, adam(1e-2), key=key(7), buckets=(16,))
    eager_pipe = plan.pipeline(loss, adam(1e-2), key=key(7))
    p_c, s_c = params, step.init(params)
    p_e, s_e = params, eager_pipe.init(params)
    for x, y in _batches([16, 13, 15, 16, 11] * 4):  # every size pads to the one bucket
        p_c, s_c = step(p_c, s_c, (x, y))
        updates, s_e = eager_pipe.update((x, y), s_e, p_e)  # the unpadded eager pipeline
        p_e = apply_updates(p_e, updates)
    assert _max_rel(p_c, p_e) < 1e-6
    assert step.sizes == {16}
    assert step.graphs_compiled <= 6  # one bucket: the first step, then once more for symbolic counters
    # a steady-state compiled step makes no host synchronisation (.item(), bool(tensor))
    x, y = _batches([14], seed=9)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(p_c, s_c, (x, y))
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense") == 0


def test_plan_padding_buckets_cover_every_batch_it_can_draw():
    plan = DPPlan(dataset_size=500, batch_size=16, steps=20, noise_multiplier=1.0, clipping_norm=1.0)
    sizes = plan.padding_buckets()
    assert sizes[0] == 8 and sizes[-1] == 500
    capped = DPPlan(dataset_size=500, batch_size=16, steps=20, noise_multiplier=1.0, clipping_norm=1.0,
                    sampling="truncated_poisson", max_batch_size=40)
    assert capped.padding_buckets()[-1] == 40


def test_noise_is_bit_identical():
    params = {"w": torch.zeros(300), "b": torch.zeros(7)}

    def loss(p, x):  # no gradient: the update is the noise alone
        return (p["w"].sum() + p["b"].sum()) * 0.0 + x.sum() * 0.0

    def pipe():
        return chain(clip(loss, clipping_norm=1.0, batch_argnums=1, normalize_by=4.0),
                     noise(noise_multiplier=2.0, key=key(11)), sgd(1.0))

    step = compile_step(pipe(), buckets=(8,))
    eager = pipe()
    p_c, s_c = params, step.init(params)
    p_e, s_e = params, eager.init(params)
    for x in [torch.ones(5, 3), torch.ones(8, 3), torch.ones(6, 3)]:
        p_c, s_c = step(p_c, s_c, (x,))
        u, s_e = eager.update((x,), s_e, p_e)
        p_e = apply_updates(p_e, u)
    for k in params:
        assert torch.equal(p_c[k], p_e[k]), k
    # 3 steps of std noise_multiplier * C / normalize_by = 0.5; 5 standard errors of a 300-sample std
    assert float(p_c["w"].std()) == pytest.approx(0.5 * math.sqrt(3), rel=5 / math.sqrt(2 * 300))


def test_padding_needs_a_clip_stage_that_takes_the_mask():
    _, params, loss = _mlp()
    undescribed = stateless(lambda x, params=None: x)  # says nothing about its stages
    with pytest.raises(InputValueError, match="no described clip stage"):
        compile_step(chain(undescribed, sgd(0.1)), buckets=(8,))
    with pytest.raises(InputValueError, match="mode must be one of"):
        compile_step(chain(clip(loss, clipping_norm=1.0, batch_argnums=(1, 2)), noise(noise_multiplier=1.0, key=key(0)),
                           sgd(0.1)), mode="fast")


@pytest.mark.slow
def test_poisson_run_compiles_once_per_bucket():
    fmodel, params, loss = _mlp()
    plan = DPPlan(dataset_size=400, batch_size=16, steps=200, noise_multiplier=1.0, clipping_norm=1.0)
    step = compile_step(plan.pipeline(loss, sgd(0.05), key=key(1)), buckets=geometric_buckets(16, up_to=400))
    data_x, data_y = torch.randn(400, D), torch.randint(0, K, (400,))
    p, s = params, step.init(params)
    sampler = plan.sampler(list(range(400)), key(2))
    sizes = []
    for idx in sampler:
        idx = torch.as_tensor(list(idx), dtype=torch.long)
        sizes.append(len(idx))
        if len(idx):
            p, s = step(p, s, (data_x[idx], data_y[idx]))
    assert len(sizes) == 200 and len(set(sizes)) > len(step.sizes)  # fewer shapes than batch sizes
    # The first bucket: the step's graphs twice (constants, then symbolic counters); every
    # later bucket recompiles the clip graph only.
    assert step.graphs_compiled <= 6 + len(step.sizes), (step.graphs_compiled, sorted(step.sizes))
    print(f"200 Poisson steps: {len(set(sizes))} batch sizes, {len(step.sizes)} buckets, "
          f"{step.graphs_compiled} graphs compiled")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vmap", "auto"])
@pytest.mark.parametrize("scale", [1e30, 1e-30, 1e-41, 1.0])
def test_certified_norms_bound_the_contribution_when_compiled(scale, backend):
    """One crafted example at a time (the rest padding): its compiled contribution is <= C."""
    d = 4096
    g = torch.Generator().manual_seed(5)
    c = 0.75
    lin = nn.Linear(d, 1, bias=False)
    fmodel, params = make_functional(lin)
    params = zeros_like(params)
    if backend == "vmap":
        def loss(p, x):  # gradient = x: the attacker writes its gradient directly
            return fmodel(p, x.unsqueeze(0)).sum()
    else:
        def loss(p, x):
            return fmodel(p, x)[:, 0]

    stage = clip(loss, clipping_norm=c, batch_argnums=1, normalize_by=1.0, clip_backend=backend,
                 model=fmodel if backend == "auto" else None)
    step = compile_step(chain(stage, noise(noise_multiplier=0.0, key=key(0)), sgd(1.0)), buckets=(4,))
    for trial in range(6):
        x = torch.randn(1, d, generator=g) * scale
        if trial % 2:  # one huge coordinate among tiny ones, at the clip boundary's scale
            x = x * 1e-6
            x[0, trial] = c * (1 + 2.0**-23) * (1 if scale >= 1 else scale)
        p, _ = step(params, step.init(params), (x,))
        norm = float(torch.linalg.vector_norm(leaves(p)[0].double()))
        assert norm <= c, (scale, trial, norm)


class _ItemGate(nn.Module):
    """A layer with a host-side branch (``.item()``): the compiler breaks its graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * 2.0 if float(h.detach().abs().max().item()) > 1e6 else h


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vmap", "auto"])
def test_an_untraceable_model_still_trains_and_the_break_is_reported(backend):
    torch.manual_seed(0)
    fmodel, params = make_functional(_ItemGate())
    if backend == "vmap":  # vmap refuses .item(): the exact per-example loop runs it, with a SlowPathWarning
        def loss(p, x, y):
            return F.cross_entropy(fmodel(p, x.unsqueeze(0)), y.unsqueeze(0))
    else:  # the fast backend runs eagerly inside the compiled step (one break by design)
        def loss(p, x, y):
            return F.cross_entropy(fmodel(p, x), y, reduction="none")

    plan = DPPlan(dataset_size=100, batch_size=8, steps=5, noise_multiplier=1.0, clipping_norm=1.0, clip_backend=backend)
    model = fmodel if backend == "auto" else None
    step = compile_step(plan.pipeline(loss, sgd(0.1), key=key(3), model=model), buckets=(8,))
    eager = plan.pipeline(loss, sgd(0.1), key=key(3), model=model)
    p_c, s_c = params, step.init(params)
    p_e, s_e = params, eager.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        for x, y in _batches([8, 6, 7]):
            p_c, s_c = step(p_c, s_c, (x, y))
            u, s_e = eager.update((x, y), s_e, p_e)
            p_e = apply_updates(p_e, u)
        assert _max_rel(p_c, p_e) < 1e-6
        report = step.explain(p_c, s_c, _batches([8])[0])
    reasons = [r.reason for r in report.break_reasons]
    if backend == "vmap":  # the noise draw is one break, the .item() (and the loop vmap falls back to) more
        assert report.graph_break_count >= 2, reasons
    else:  # the eager fast backend sits between graphs
        assert report.graph_count >= 2 and report.graph_break_count >= 1, (report.graph_count, reasons)


@pytest.mark.slow
def test_vmap_step_traces_into_one_graph():
    """The vmap clip, the noise (its keyed draw an operator in the graph) and the optimizer trace
    as one graph, without a break."""
    _, params, loss = _mlp()
    plan = DPPlan(dataset_size=500, batch_size=16, steps=20, noise_multiplier=1.0, clipping_norm=1.0)
    step = compile_step(plan.pipeline(loss, sgd(0.1), key=key(7)), buckets=(16,))
    report = step.explain(params, step.init(params), _batches([16])[0])
    reasons = [r.reason for r in report.break_reasons]
    assert report.graph_count == 1 and report.graph_break_count == 0, reasons


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [None, True])
def test_noise_drawn_in_the_graph_is_the_eager_draw_bit_for_bit(prefetch):
    """Two (device, dtype) groups, four steps (the counter a constant, then a symbol): the
    in-graph draw gives the eager numbers bit for bit. An explicit prefetch=True keeps its
    draw-ahead, eagerly between two graphs, with the same numbers."""
    params = {"w": torch.zeros(5, 40), "v": torch.zeros(33, dtype=torch.float64), "b": torch.zeros(7)}

    def loss(p, x):  # no gradient: the update is the noise alone (compiled gradients agree to rounding only)
        return ((p["w"].sum() + p["b"].sum()) * x.sum() + p["v"].sum() * x.sum().double()) * 0.0

    def pipe():
        return chain(clip(loss, clipping_norm=1.0, batch_argnums=1, normalize_by=4.0),
                     noise(noise_multiplier=1.5, key=key(21), prefetch=prefetch), sgd(1.0))

    step = compile_step(pipe())
    eager = pipe()
    p_c, s_c = params, step.init(params)
    p_e, s_e = params, eager.init(params)
    for x in [torch.ones(4, 3) * 0.1 * i for i in range(1, 5)]:
        p_c, s_c = step(p_c, s_c, (x,))
        u, s_e = eager.update((x,), s_e, p_e)
        p_e = apply_updates(p_e, u)
    for k in params:
        assert torch.equal(p_c[k], p_e[k]), k
        assert p_c[k].dtype == params[k].dtype
    report = step.explain(p_c, s_c, (torch.ones(4, 3),))
    if prefetch is None:
        assert report.graph_break_count == 0, [r.reason for r in report.break_reasons]
    else:
        assert report.graph_break_count >= 1


def test_adaptive_clipping_is_refused_with_the_fix():
    _, _, loss = _mlp()
    plan = DPPlan(dataset_size=500, batch_size=16, steps=20, noise_multiplier=1.0, clipping_norm=1.0,
                  clipping_mode="adaptive")
    with pytest.raises(InputValueError, match="every step would compile again"):
        plan.compiled_step(loss, sgd(0.1), key=key(1), count_key=key(2))


@pytest.mark.slow
def test_many_compiled_steps_in_one_process_each_compile():
    """Dynamo caches graphs per code object and, past its recompile limit (8), silently
    runs the function eagerly. Every compiled step shares the pipeline's code objects, so
    the ninth step built in a process (a notebook, a sweep) used to run uncompiled."""
    fmodel, params, loss = _mlp()
    (x, y), = _batches([8])
    for i in range(11):
        pipe = chain(clip(loss, clipping_norm=1.0 + i, batch_argnums=(1, 2)), noise(noise_multiplier=1.0, key=key(i)),
                     sgd(0.1))
        step = compile_step(pipe)
        step(params, step.init(params), (x, y))
        assert step.graphs_compiled > 0, f"compiled step {i} ran eagerly"


def _count_rule_calls(monkeypatch) -> list[int]:
    from opake_fx.dpsgd.clipping import _ghost

    calls = [0]
    original = _ghost._NormBackend.__call__

    def counted(self, *a, **k):
        calls[0] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(_ghost._NormBackend, "__call__", counted)
    return calls


def _auto_steps(optimizer, norm: bool = False):
    """A compiled and an eager "auto" step (same plan and keys) on a small MLP, and its params;
    with ``norm``, a LayerNorm too (parameters the traced path takes exactly)."""
    torch.manual_seed(0)
    layers = [nn.Linear(D, 16), *([nn.LayerNorm(16)] if norm else []), nn.Tanh(), nn.Linear(16, K)]
    fmodel, params = make_functional(nn.Sequential(*layers))

    def loss(p, x, y):
        return F.cross_entropy(fmodel(p, x), y, reduction="none")

    plan = DPPlan(dataset_size=500, batch_size=16, steps=20, noise_multiplier=1.0, clipping_norm=0.5,
                  clip_backend="auto")
    return (plan.compiled_step(loss, optimizer, key=key(7), buckets=(16,), model=fmodel),
            plan.pipeline(loss, optimizer, key=key(7), model=fmodel), params)


def test_compiled_auto_traces_its_own_path_on_a_small_model(monkeypatch):
    """"auto" inside a compiled step runs its traced path (the Linear layers tapped, no eager
    rule call), equal to the eager "auto" step."""
    calls = _count_rule_calls(monkeypatch)
    step, eager, params = _auto_steps(adam(1e-2))
    p_c, s_c = params, step.init(params)
    p_e, s_e = params, eager.init(params)
    for x, y in _batches([16, 13, 15, 11] * 3):
        p_c, s_c = step(p_c, s_c, (x, y))
        calls_compiled = calls[0]
        u, s_e = eager.update((x, y), s_e, p_e)
        p_e = apply_updates(p_e, u)
        assert calls[0] == calls_compiled + 1  # the eager step used the rules, the compiled one did not
    assert _max_rel(p_c, p_e) < 1e-6
    x, y = _batches([14], seed=9)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(p_c, s_c, (x, y))
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense") == 0


@pytest.mark.slow
@pytest.mark.parametrize("limit, rules_run", [(("TRACED_WHOLE_LOSS_MAX_ELEMENTS", 16 * 16), True),
                                              (("TRACED_WHOLE_LOSS_MAX_BATCH", 15), False)], ids=["elements", "batch"])
def test_compiled_auto_keeps_the_eager_rules_above_the_thresholds(monkeypatch, limit, rules_run):
    """Per-example gradients of the exactly-taken parameters above the element limit: the eager
    rules run inside the compiled step. The batch limit bounds only the whole-loss path: the
    traced path, whose tapped layers form no per-example gradient, still runs above it."""
    from opake_fx.dpsgd.clipping import _ghost

    calls = _count_rule_calls(monkeypatch)
    monkeypatch.setattr(_ghost, *limit)  # below this model's B * (LayerNorm's 32), or below its batch of 16
    step, eager, params = _auto_steps(sgd(0.1), norm=True)
    p_c, s_c = params, step.init(params)
    p_e, s_e = params, eager.init(params)
    for i, (x, y) in enumerate(_batches([16, 12, 15])):
        before = calls[0]
        p_c, s_c = step(p_c, s_c, (x, y))
        if i:  # (the first call also runs the planning step, eagerly)
            assert calls[0] == before + int(rules_run)  # the rules ran (eagerly, inside the compiled step) or not
        u, s_e = eager.update((x, y), s_e, p_e)
        p_e = apply_updates(p_e, u)
    assert _max_rel(p_c, p_e) < 1e-6


def test_a_sweep_over_clip_norms_keeps_the_steady_step_free_of_host_syncs():
    """Steps built in one process share code objects; dynamo's automatic dynamic shapes would
    turn a float that differs between them (the clip norm of a sweep) into a 0-d tensor read
    back with .item() every step. compile_step specializes floats (they are fixed per step)."""
    fmodel, params, loss = _mlp()
    (x, y), = _batches([8])
    for c in (1.0, 2.0, 3.0):
        pipe = chain(clip(loss, clipping_norm=c, batch_argnums=(1, 2)), noise(noise_multiplier=1.0, key=key(0)),
                     sgd(0.1))
        step = compile_step(pipe)
        p, s = params, step.init(params)
        for _ in range(3):
            p, s = step(p, s, (x, y))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(p, s, (x, y))
        assert sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense") == 0, c


@pytest.mark.slow
@pytest.mark.parametrize("make_opt", [lambda: sgd(cosine(0.1, 50)), lambda: adam(cosine(0.01, 50))], ids=["sgd", "adam"])
def test_a_learning_rate_schedule_does_not_recompile_every_step(make_opt):
    """A schedule traced with a symbolic step specialized on each step's value: one more graph
    per step (and, past the recompile limit, silently eager). It is evaluated outside the graph."""
    fmodel, params, loss = _mlp()
    pipe = lambda: chain(clip(loss, clipping_norm=1.0, batch_argnums=(1, 2)), noise(noise_multiplier=1.0, key=key(0)),
                         make_opt())
    step, eager = compile_step(pipe()), pipe()
    p_c, s_c = params, step.init(params)
    p_e, s_e = params, eager.init(params)
    for x, y in _batches([8] * 14):
        p_c, s_c = step(p_c, s_c, (x, y))
        u, s_e = eager.update((x, y), s_e, p_e)
        p_e = apply_updates(p_e, u)
    assert step.graphs_compiled <= 8, step.graphs_compiled
    assert _max_rel(p_c, p_e) < 1e-6


class _DropoutSequenceModel(nn.Module):
    """Embedding -> dropout (training mode) -> mean over positions -> linear: a model whose
    per-example step draws dropout masks of the sequence's length inside ``vmap``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, K)

    def forward(self, ids):
        return self.head(self.drop(self.emb(ids)).mean(-2))


@pytest.mark.slow
def test_a_second_compiled_step_on_another_sequence_length_stays_static():
    """Dynamo keeps the shapes it has seen per code object, and every compiled step shares
    the pipeline's code objects: a second step in the process on another sequence length
    used to turn that length into a symbol (automatic dynamic shapes), and dropout under
    vmap cannot draw a mask of symbolic size (it failed inside torch.compile; found when the
    slow suite ran the trainer's compiled step before the architectures benchmark's)."""
    torch.manual_seed(0)
    fmodel, params = make_functional(_DropoutSequenceModel())

    def loss(p, ids, y):
        return F.cross_entropy(fmodel(p, ids.unsqueeze(0)), y.unsqueeze(0))

    g = torch.Generator().manual_seed(0)
    for length in (6, 9, 11):
        pipe = chain(clip(loss, clipping_norm=1.0, batch_argnums=(1, 2)), noise(noise_multiplier=1.0, key=key(length)),
                     sgd(0.1))
        step = compile_step(pipe)
        ids, y = torch.randint(0, 20, (4, length), generator=g), torch.randint(0, K, (4,), generator=g)
        new_params, _ = step(params, step.init(params), (ids, y))
        assert step.graphs_compiled > 0
        assert all(torch.isfinite(t).all() for t in leaves(new_params))


@pytest.mark.slow
def test_a_compiled_step_that_ran_the_eager_rules_leaves_later_steps_their_traced_path(monkeypatch):
    """A step whose clip stage runs the eager rules (above the thresholds) broke its graph inside
    the clipping function's packaging, and dynamo then gave up on that function's code for the
    whole process: every later compiled "auto" step (same code) ran the eager rules too."""
    from opake_fx.dpsgd.clipping import _ghost

    calls = _count_rule_calls(monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(_ghost, "TRACED_WHOLE_LOSS_MAX_ELEMENTS", 16)
        first, _, params = _auto_steps(sgd(0.1), norm=True)
        (x, y), = _batches([16])
        first(params, first.init(params), (x, y))
    assert calls[0] >= 1  # the first step ran the rules
    second, _, params = _auto_steps(sgd(0.1), norm=True)
    s = second.init(params)
    for x, y in _batches([16, 12]):
        before = calls[0]
        params, s = second(params, s, (x, y))
    assert calls[0] == before  # the second step's last call traced its own path


@pytest.mark.slow
def test_a_changed_float32_matmul_precision_is_refused_with_the_fix():
    """The traced certified norms take the matmul rounding of the step's first call as a
    constant: TF32 ("high") rounds more than IEEE float32, so the step refuses to go on."""
    fmodel, params, loss = _mlp()
    step = compile_step(chain(clip(loss, clipping_norm=1.0, batch_argnums=(1, 2)), noise(noise_multiplier=1.0, key=key(0)),
                              sgd(0.1)))
    (x, y), = _batches([8])
    p, s = step(params, step.init(params), (x, y))
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        with pytest.raises(InputValueError, match="matmul precision settings changed"):
            step(p, s, (x, y))
    finally:
        torch.set_float32_matmul_precision(previous)
    step(p, s, (x, y))  # the first call's settings again: it runs


@pytest.mark.slow
def test_explain_reports_the_traced_path_that_a_call_runs(monkeypatch):
    """explain() runs the batch shape's planning step first, as a call does: without it, the
    traced "auto" path had no plan and the report described another path than the one run."""
    from opake_fx.dpsgd.clipping import _traced

    traced_while_compiling = []
    original = _traced.traced_norms

    def recorded(*args, **kwargs):
        traced_while_compiling.append(torch.compiler.is_compiling())
        return original(*args, **kwargs)

    monkeypatch.setattr(_traced, "traced_norms", recorded)
    fmodel, params, loss = _mlp("auto")
    plan = DPPlan(dataset_size=100, batch_size=8, steps=5, noise_multiplier=1.0, clipping_norm=1.0, clip_backend="auto")
    step = compile_step(plan.pipeline(loss, sgd(0.1), key=key(3), model=fmodel), buckets=(8,))
    report = step.explain(params, step.init(params), _batches([8])[0])
    assert True in traced_while_compiling, traced_while_compiling
    assert report.graph_count == 1  # clip, noise (its draw an operator in the graph) and the optimizer


@pytest.mark.slow
def test_a_cpu_conv_step_compiles_without_channels_last_layouts(monkeypatch):
    """On a CPU the compiled step turns inductor's layout optimization off: channels-last
    convolutions made the per-example GroupNorm and pooling around them strided gathers
    (benchmarks/clipping.py cnn-64: 1.38x -> 1.09x of the floor). The step still equals its
    eager run."""
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering

    decided = []
    original = GraphLowering.decide_layout_opt

    def recorded(gm, *, is_inference):
        decided.append((inductor_config.layout_optimization, original(gm, is_inference=is_inference)))
        return decided[-1][1]

    monkeypatch.setattr(GraphLowering, "decide_layout_opt", staticmethod(recorded))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(4 * 4 * 4, K))
    fmodel, params = make_functional(net)

    def loss(p, x, y):
        return F.cross_entropy(fmodel(p, x), y, reduction="none")

    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, K, (6,), generator=g))
    pipe = chain(clip(loss, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=6, clip_backend="auto", model=fmodel),
                 noise(noise_multiplier=1.0, key=key(2)), sgd(0.1))
    step = compile_step(pipe)
    # (config.patch, not monkeypatch: monkeypatch's undo leaves inductor's config entry hidden)
    with inductor_config.patch(fx_graph_cache=False):  # lower the graphs here, not from the cache
        compiled, _ = step(params, step.init(params), batch)
    eager, _ = step.eager(params, step.init(params), batch)
    assert decided and all(setting is False and chosen is False for setting, chosen in decided), decided
    assert _max_rel(compiled, eager) < 1e-5


def test_the_draw_operator_is_never_captured_in_a_cuda_graph():
    """Inductor partitions a graph around an operator it reads as CUDA-graph unsafe and runs it
    as an ordinary call every step; a captured draw would replay one step's noise."""
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    from opake_fx.random import flat_normal_group

    def draw(step):
        return flat_normal_group([0, 3], 5, 1, 0, 4, torch.float32, torch.device("cpu"), 1.0)

    gm = torch.fx.experimental.proxy_tensor.make_fx(draw)(torch.zeros(()))
    ops = [n for n in gm.graph.nodes if n.target is torch.ops.opake_fx.flat_normal_group.default]
    assert ops and all(is_cudagraph_unsafe_fx_node(n) for n in ops)


@pytest.mark.slow
def test_a_step_that_records_cuda_graphs_draws_its_noise_between_graphs():
    """mode="reduce-overhead" keeps the eager draw between two graphs (the design measured on a
    GPU); on this CPU the same numbers as the eager step, bit for bit."""
    params = {"w": torch.zeros(50)}

    def loss(p, x):  # no gradient: the update is the noise alone
        return p["w"].sum() * x.sum() * 0.0

    def pipe():
        return chain(clip(loss, clipping_norm=1.0, batch_argnums=1, normalize_by=4.0),
                     noise(noise_multiplier=1.0, key=key(4)), sgd(1.0))

    step = compile_step(pipe(), mode="reduce-overhead")
    assert step.records_cuda_graphs and not compile_step(pipe()).records_cuda_graphs
    eager = pipe()
    p_c, s_c = params, step.init(params)
    p_e, s_e = params, eager.init(params)
    for _ in range(3):
        p_c, s_c = step(p_c, s_c, (torch.ones(4, 2),))
        u, s_e = eager.update((torch.ones(4, 2),), s_e, p_e)
        p_e = apply_updates(p_e, u)
    assert torch.equal(p_c["w"], p_e["w"])
    report = step.explain(p_c, s_c, (torch.ones(4, 2),))
    assert report.graph_break_count >= 1, [r.reason for r in report.break_reasons]

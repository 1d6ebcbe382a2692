"""Checkpoints: state_dict / from_state_dict (template-driven) and save_checkpoint / load_checkpoint."""

from __future__ import annotations

import importlib
import io
import json
import math
import pickle
import sys
from typing import Any, NamedTuple

import pytest
import torch

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx import dpftrl, scheduling
from opake_fx.dpftrl.sampling import BallsInBinsSampler, CyclicPoissonSampler, FixedEpochSampler, MinSepSampler
from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.clipping import adaptive_clipped_grad, as_stage, auto_clipped_grad, per_group
from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler, TruncatedPoissonSampler
from opake_fx.errors import CheckpointError, InputTypeError, OpakeError
from opake_fx.optimizers import adam, sgd
from opake_fx.random import fold_in, key
from opake_fx.serialization import from_state_dict, load_checkpoint, register_serializer, save_checkpoint, state_dict
from opake_fx.transforms import apply_updates, chain, named_chain
from opake_fx.testing import assert_trees_equal
from opake_fx.types import ClippedPytree

# Tight and coarse enough that the accountant's headroom searches stay short (~1 s a run).
BUDGET = acc.epsilon_budget(2.0, delta=1e-5, discretization=1e-3)
STEP = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.05)


def _loss(p, x):
    return 0.5 * ((x - p["w"]) ** 2).sum() + (p["b"] * x.sum()).sum()


def _params():
    return {"w": torch.zeros(3), "b": torch.zeros(1)}


def _batches(n, seed=0):
    return torch.randn(n, 4, 3, generator=torch.Generator().manual_seed(seed))


def _roundtrip(template, obj):
    buf = io.BytesIO()
    torch.save(state_dict(obj), buf)
    buf.seek(0)
    return from_state_dict(template, torch.load(buf, weights_only=True))


def _entries_equal(a, b):
    assert_trees_equal(state_dict(a), state_dict(b))


class OptaxLikeState(NamedTuple):
    count: int
    trace: Any


def _pipeline(adaptive=False, mf=False):
    if adaptive:
        grad_fn, s0 = adaptive_clipped_grad(
            _loss, initial_clipping_norm=1.0, count_noise_multiplier=2.0, key=key(11), expected_batch_size=4.0
        )
        clip_stage = as_stage(grad_fn, s0)
    else:
        clip_stage = clip(_loss, clipping_norm=1.0, batch_argnums=(1,))
    if mf:
        noise_stage = dpftrl.noise(dpftrl.bsr_strategy(16, 3), noise_multiplier=1.0, key=key(5))
    else:
        noise_stage = noise(noise_multiplier=1.0, key=key(5))
    return named_chain(("clip", clip_stage), ("noise", noise_stage), ("opt", adam(0.05)))


@pytest.mark.parametrize("adaptive,mf", [(False, False), (True, False), (False, True)])
def test_pipeline_resumes_bit_identically_from_the_init_template(adaptive, mf):
    pipeline = _pipeline(adaptive, mf)
    xs = _batches(8)
    params = _params()
    state = pipeline.init(params)
    for x in xs[:4]:
        u, state = pipeline.update((x,), state, params)
        params = apply_updates(params, u)
    ckpt = _roundtrip({"params": _params(), "state": pipeline.init(_params())}, {"params": params, "state": state})
    p_a, s_a, p_b, s_b = params, state, ckpt["params"], ckpt["state"]
    _entries_equal(s_a, s_b)
    for x in xs[4:]:
        ua, s_a = pipeline.update((x,), s_a, p_a)
        ub, s_b = pipeline.update((x,), s_b, p_b)
        p_a, p_b = apply_updates(p_a, ua), apply_updates(p_b, ub)
    assert_trees_equal(p_b, p_a)


def _every_state(advanced=True):
    """Every kind of state the library has; ``advanced=False`` gives the fresh templates."""
    params = _params()
    pg = per_group(params, bias=(0.1, "b"), rest=(1.0, "*"))
    _, auto_state = auto_clipped_grad(_loss, clipping_norm=1.0)
    grad_fn, adaptive = adaptive_clipped_grad(
        _loss, initial_clipping_norm=1.0, count_noise_multiplier=1.0, key=key(1), expected_batch_size=4.0
    )
    ch = chain(sgd(0.1, momentum=0.9), adam(1e-3))
    ch_state = ch.init(params)
    mf_stage = dpftrl.noise(dpftrl.bsr_strategy(8, 3), noise_multiplier=1.0, key=key(9))
    mf_state = mf_stage.init(params)
    samplers = {
        "poisson": PoissonSampler(40, sample_rate=0.2, n_steps=5, key=key(2)),
        "truncated": TruncatedPoissonSampler(40, sample_rate=0.2, n_steps=5, key=key(3), max_batch_size=6),
        "sequential": SequentialBatchSampler(10, batch_size=3),
        "cyclic": CyclicPoissonSampler(40, sample_rate=0.3, partitions=2, n_steps=6, key=key(4)),
        "bins": BallsInBinsSampler(40, cycle_length=3, n_steps=6, key=key(5)),
        "minsep": MinSepSampler(40, sample_rate=0.2, min_sep=2, n_steps=6, key=key(6)),
        "epochs": FixedEpochSampler(40, steps_per_epoch=4, epochs=2, key=key(7)),
    }
    accountant = acc.Accountant(BUDGET)
    optax = OptaxLikeState(count=0, trace={"w": torch.zeros(3, dtype=torch.float64)})
    if advanced:
        _, adaptive = grad_fn(params, _batches(1)[0], state=adaptive)
        _, ch_state = ch.update({"w": torch.ones(3), "b": torch.ones(1)}, ch_state, params)
        for _ in range(2):
            _, mf_state = mf_stage.update(ClippedPytree({"w": torch.ones(3), "b": torch.ones(1)}, max_norm=1.0), mf_state)
        for s in samplers.values():
            it = iter(s)
            next(it), next(it)
        for _ in range(3):
            accountant.step(STEP)
        optax = OptaxLikeState(count=3, trace={"w": torch.full((3,), 0.5, dtype=torch.float64)})
    return {
        "key": key(123) if advanced else key(0),
        "fixed": clip(_loss, clipping_norm=pg).init(params),
        "auto": auto_state,
        "adaptive": adaptive,
        "chain": ch_state,
        "optax": optax,
        "mf": mf_state,
        "samplers": samplers,
        "schedule": scheduling.with_warmup(scheduling.cosine(0.1, decay_steps=90), warmup_steps=10),
        "accountant": accountant,
        "per_group": pg,
        "plain": (1.5, float("inf"), None, [1, "a", True]) if advanced else (0.0, 0.0, None, [0, "", False]),
    }


def test_every_library_state_survives_a_checkpoint(tmp_path):
    states = _every_state()
    save_checkpoint(tmp_path / "ckpt.pt", **states)
    template = _every_state(advanced=False)
    back = load_checkpoint(tmp_path / "ckpt.pt", **template)
    for name in states:
        if name not in ("samplers", "accountant"):
            _entries_equal(back[name], states[name])
    assert back["key"] == key(123) and back["adaptive"] == states["adaptive"]
    assert back["adaptive"].prev_clipping_norm is not None
    assert type(back["optax"]) is OptaxLikeState and back["optax"].trace["w"].dtype == torch.float64
    assert len(back["mf"].buffers) == 2 and back["mf"].step == 2 and back["mf"].max_norm == 1.0
    assert back["schedule"] == states["schedule"] and back["per_group"] == states["per_group"]
    for k, s in states["samplers"].items():
        r = back["samplers"][k]
        assert r is not template["samplers"][k] and template["samplers"][k].next_step == 0
        assert r.next_step == s.next_step, k
        assert list(r) == list(s), k  # the same remaining batches
    a, b = states["accountant"], back["accountant"]
    assert b.spent == a.spent and template["accountant"].spent != a.spent
    for _ in range(2):
        a.step(STEP)
        b.step(STEP)
    assert b.spent == a.spent
    assert b.spent_epsilon(1e-5) == a.spent_epsilon(1e-5)  # the running composition is in the checkpoint


def test_samplers_and_accountant_resume_mid_run():
    sampler = PoissonSampler(60, sample_rate=0.1, n_steps=8, key=fold_in(key(1), 0))
    first = [b for _, b in zip(range(3), sampler)]
    restored = _roundtrip(PoissonSampler(60, sample_rate=0.1, n_steps=8, key=key(99)), sampler)
    full = list(PoissonSampler(60, sample_rate=0.1, n_steps=8, key=fold_in(key(1), 0)))
    assert first + list(restored) == full
    acct = acc.Accountant(BUDGET)
    for _ in range(4):
        acct.step(STEP)
    resumed = _roundtrip(acc.Accountant(BUDGET), acct)
    uninterrupted = acc.Accountant(BUDGET)
    for _ in range(10):
        uninterrupted.step(STEP)
    for _ in range(6):
        resumed.step(STEP)
    assert resumed.spent == uninterrupted.spent  # the whole history, exactly
    assert resumed.spent_epsilon(1e-5) == uninterrupted.spent_epsilon(1e-5)


OTHER_STEP = dpsgd_acc.poisson(dpsgd_acc.gaussian(0.8), 0.02)


def _resumes_bit_identically(budget, steps, split):
    """Runs ``steps``; a copy restored from a checkpoint after ``split`` of them runs the rest."""
    uninterrupted = acc.Accountant(budget)
    for s in steps[:split]:
        uninterrupted.step(s)
    resumed = _roundtrip(acc.Accountant(budget), uninterrupted)
    for s in steps[split:]:
        uninterrupted.step(s)
        resumed.step(s)
    for engine in ("pld", "rdp"):
        assert resumed.spent_epsilon(1e-5, accountant=engine) == uninterrupted.spent_epsilon(1e-5, accountant=engine)
    assert resumed.spent_delta(1.0) == uninterrupted.spent_delta(1.0)
    assert resumed.remaining_steps(STEP) == uninterrupted.remaining_steps(STEP)
    assert resumed.spent == uninterrupted.spent


@pytest.mark.parametrize("split", [1, 3, 5])  # after one step, inside a run, after a switch
def test_spent_epsilon_after_a_resume_is_bit_identical(split):
    # A run of identical steps is counted down and folded in later, a different step folds
    # it in at once: the checkpoint holds the running composition, the pending run and the
    # counted-down headroom, so the resumed accountant folds exactly when and what the
    # uninterrupted one folds.
    steps = [STEP, STEP, STEP, OTHER_STEP, STEP, STEP]
    _resumes_bit_identically(BUDGET, steps, split)


def test_rdp_budget_accountant_resumes_bit_identically():
    _resumes_bit_identically(acc.epsilon_budget(4.0, delta=1e-5, accountant="rdp", discretization=1e-3), [STEP, STEP, OTHER_STEP, STEP], 2)


def test_accountant_round_trips_through_a_checksummed_file(tmp_path):
    acct = acc.Accountant(BUDGET)
    for s in (STEP, STEP, OTHER_STEP, STEP, STEP):
        acct.step(s)
    save_checkpoint(tmp_path / "a.pt", accountant=acct)
    back = load_checkpoint(tmp_path / "a.pt", accountant=acc.Accountant(BUDGET))["accountant"]
    assert_trees_equal(state_dict(back), state_dict(acct))  # every entry, bit for bit
    for s in (STEP, OTHER_STEP):
        acct.step(s)
        back.step(s)
    assert back.spent_epsilon(1e-5) == acct.spent_epsilon(1e-5)
    raw = torch.load(tmp_path / "a.pt", weights_only=True)
    raw["trees"]["accountant"]["pld/remove/probs"] = raw["trees"]["accountant"]["pld/remove/probs"][:-10]
    torch.save(raw, tmp_path / "cut.pt")  # the running state truncated, checksum kept
    with pytest.raises(CheckpointError, match="failed its checksum"):
        load_checkpoint(tmp_path / "cut.pt", accountant=acc.Accountant(BUDGET))


def _accountant_flat():
    acct = acc.Accountant(BUDGET)
    for s in (STEP, STEP, OTHER_STEP):
        acct.step(s)
    return acct, state_dict({"acct": acct})


def test_a_truncated_or_altered_running_state_is_refused():
    acct, flat = _accountant_flat()
    template = {"acct": acc.Accountant(BUDGET)}
    probs = flat["acct/pld/remove/probs"]
    bumped = probs.clone()
    bumped[probs.argmax()] *= 0.5  # less mass at the peak: an under-report if it were taken
    spliced = dict(flat, **{"acct/state": state_dict({"acct": acct | STEP})["acct/state"]})
    for name, bad in [("truncated", {**flat, "acct/pld/remove/probs": probs[:-7]}),
                      ("altered", {**flat, "acct/pld/remove/probs": bumped}),
                      ("altered offset", {**flat, "acct/pld/add/lo": flat["acct/pld/add/lo"] + 1}),
                      ("spliced", spliced)]:
        with pytest.raises(CheckpointError, match=r"'acct' was refused: the accountant's running state does not match its digest"):
            from_state_dict(template, bad)
    assert from_state_dict(template, flat)["acct"].spent == acct.spent


def test_a_mistyped_running_state_entry_is_named():
    _, flat = _accountant_flat()
    template = {"acct": acc.Accountant(BUDGET)}
    probs = flat["acct/pld/remove/probs"]
    cases = [
        ({"acct/pld/remove/probs": probs.float()}, r"'acct/pld/remove/probs': dtype torch.float32 in the checkpoint, the template has torch.float64"),
        ({"acct/pld/add/probs": probs[None]}, r"'acct/pld/add/probs': 2 dimensions in the checkpoint, the template has 1"),
        ({"acct/rdp_sum": 0.0}, r"'acct/rdp_sum': the checkpoint has the float 0.0 where the template has a tensor"),
        ({"acct/pld/folds": "3"}, r"'acct/pld/folds': the checkpoint has the str '3' where the template has the int"),
    ]
    for change, message in cases:
        with pytest.raises(CheckpointError, match=message):
            from_state_dict(template, {**flat, **change})
    with pytest.raises(CheckpointError, match=r"'acct/pld/remove/probs' is missing"):
        from_state_dict(template, {k: v for k, v in flat.items() if k != "acct/pld/remove/probs"})


def test_an_accountant_saved_without_its_running_state_still_loads():
    # The earlier format: one JSON entry with the budget and the spent process. It loads; the
    # composition is recomputed in one go, so epsilon agrees to ~1e-9, not bit for bit.
    acct, _ = _accountant_flat()
    old = {"acct": json.dumps(acct.state_dict())}
    back = from_state_dict({"acct": acc.Accountant(BUDGET)}, old)["acct"]
    assert back.spent == acct.spent
    assert back.spent_epsilon(1e-5) == pytest.approx(acct.spent_epsilon(1e-5), rel=1e-7)  # ~1e-8 measured
    with pytest.raises(CheckpointError, match=r"'acct' was refused: .*budget"):
        from_state_dict({"acct": acc.Accountant(acc.epsilon_budget(1.0, delta=1e-5, discretization=1e-3))}, old)
    with pytest.raises(CheckpointError, match=r"'acct' was refused: the accountant's state is not valid JSON"):
        from_state_dict({"acct": acc.Accountant(BUDGET)}, {"acct": "{"})


def test_variable_shapes_serializer_for_a_growing_state():
    class History:
        def __init__(self, values):
            self.values = values

    register_serializer(History, to_tree=lambda h: {"values": h.values},
                        from_tree=lambda template, tree: History(tree["values"]), variable_shapes=True)
    grown = from_state_dict(History(torch.zeros(1)), state_dict(History(torch.arange(5.0))))
    assert grown.values.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(CheckpointError, match=r"'values': dtype torch.float64 in the checkpoint, the template has torch.float32"):
        from_state_dict(History(torch.zeros(1)), {"values": torch.zeros(3, dtype=torch.float64)})
    # without variable_shapes the template's shape is required, as everywhere
    register_serializer(History, to_tree=lambda h: {"values": h.values}, from_tree=lambda template, tree: History(tree["values"]))
    with pytest.raises(CheckpointError, match=r"'values': shape \(5,\) in the checkpoint, the template has \(1,\)"):
        from_state_dict(History(torch.zeros(1)), state_dict(History(torch.arange(5.0))))


def test_dtype_and_device_come_from_the_template():
    opt = adam(0.1)
    params = {"w": torch.randn(4)}
    _, st = opt.update({"w": torch.ones(4)}, opt.init(params), params)
    half = {"w": torch.zeros(4, dtype=torch.bfloat16, device="meta")}
    back = from_state_dict(opt.init(half), state_dict(st))
    assert back.mu["w"].dtype == torch.bfloat16 and back.mu["w"].device.type == "meta"
    p = torch.zeros(4, requires_grad=True)
    assert from_state_dict({"p": p}, {"p": torch.ones(4)})["p"].requires_grad
    module_params = dict(torch.nn.Linear(2, 1).named_parameters())
    back = from_state_dict(module_params, {"weight": torch.ones(1, 2), "bias": torch.zeros(1, dtype=torch.float64)})
    assert isinstance(back["weight"], torch.nn.Parameter) and back["bias"].dtype == torch.float32
    assert back["weight"].tolist() == [[1.0, 1.0]]


def test_state_dict_copies_tensors_and_template_is_not_modified():
    t = torch.ones(2)
    flat = state_dict({"t": t})
    t.add_(1)
    assert flat["t"].tolist() == [1.0, 1.0]
    template = {"t": torch.zeros(2)}
    out = from_state_dict(template, flat)
    out["t"].add_(5)
    assert template["t"].tolist() == [0.0, 0.0] and flat["t"].tolist() == [1.0, 1.0]


def _adam_flat():
    opt = adam(0.1)
    params = {"w": torch.zeros(3)}
    return opt.init(params), state_dict(opt.update({"w": torch.ones(3)}, opt.init(params), params)[1])


def test_renamed_entry_is_named_as_missing_and_unknown():
    template, flat = _adam_flat()
    flat["mu/weight"] = flat.pop("mu/w")
    with pytest.raises(CheckpointError, match=r"'mu/w' is missing.*unknown entries 'mu/weight'.*renamed 'mu/w'"):
        from_state_dict(template, flat)


def test_resized_wrong_kind_and_wrong_integer_dtype_are_named():
    template, flat = _adam_flat()
    flat["nu/w"] = torch.zeros(4)
    with pytest.raises(CheckpointError, match=r"'nu/w': shape \(4,\) in the checkpoint, the template has \(3,\)"):
        from_state_dict(template, flat)
    template, flat = _adam_flat()
    flat["count"] = torch.tensor(1)
    with pytest.raises(CheckpointError, match=r"'count': the checkpoint has a Tensor where the template has the int 0"):
        from_state_dict(template, flat)
    with pytest.raises(CheckpointError, match=r"'key': dtype torch.float32 in the checkpoint cannot become"):
        from_state_dict({"key": key(0)}, {"key": torch.tensor([0.0, 3.5])})
    with pytest.raises(CheckpointError, match=r"'key' was refused: RngKey needs two uint32 words"):
        from_state_dict({"key": key(0)}, {"key": torch.tensor([0, 2**40])})


def test_mismatched_configuration_is_refused_with_its_path():
    s = PoissonSampler(40, sample_rate=0.2, n_steps=5, key=key(2))
    other = PoissonSampler(40, sample_rate=0.3, n_steps=5, key=key(2))
    with pytest.raises(CheckpointError, match=r"'sampler' was refused: .*sample_rate=0.2 differs"):
        from_state_dict({"sampler": other}, state_dict({"sampler": s}))
    acct = acc.Accountant(BUDGET)
    with pytest.raises(CheckpointError, match=r"'acct' was refused: .*budget"):
        from_state_dict({"acct": acc.Accountant(acc.epsilon_budget(1.0, delta=1e-5))}, state_dict({"acct": acct}))


def test_old_import_path_format_is_refused_without_importing(monkeypatch):
    calls = []
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: calls.append(a) or None)
    old = {"__opake_type__": "os:system", "fields": {}}
    for data in (old, {"noise": old}, [old]):
        with pytest.raises(CheckpointError, match="old format"):
            from_state_dict(_params(), data)
    assert calls == []


def test_user_types_need_a_serializer_and_errors_name_the_path():
    class Counter:
        def __init__(self, n):
            self.n = n

    with pytest.raises(InputTypeError, match=r"Counter at 'a/0'.*register_serializer"):
        state_dict({"a": [Counter(1)]})
    with pytest.raises(InputTypeError, match="parameter to_tree"):
        register_serializer(Counter, to_tree=3, from_tree=lambda t, x: x)
    register_serializer(Counter, to_tree=lambda c: {"n": c.n}, from_tree=lambda t, tree: Counter(tree["n"]))
    assert from_state_dict({"a": [Counter(0)]}, state_dict({"a": [Counter(4)]}))["a"][0].n == 4


def test_keys_with_separators_round_trip_and_collisions_are_refused():
    tree = {"enc/w": torch.ones(1), "enc%2Fw": torch.zeros(1), 3: 1.0}
    flat = state_dict(tree)
    assert set(flat) == {"enc%2Fw", "enc%252Fw", "3"}
    back = from_state_dict({"enc/w": torch.zeros(1), "enc%2Fw": torch.ones(1), 3: 0.0}, flat)
    assert back["enc/w"].item() == 1.0 and back["enc%2Fw"].item() == 0.0 and back[3] == 1.0
    with pytest.raises(CheckpointError, match="same path component"):
        state_dict({3: 1.0, "3": 2.0})


def test_plain_values_fit_by_kind():
    assert from_state_dict({"x": 1.0}, {"x": 2}) == {"x": 2}
    assert from_state_dict({"x": None}, {"x": 0.5}) == {"x": 0.5}
    assert math.isinf(from_state_dict({"x": 0.0}, {"x": float("inf")})["x"])
    with pytest.raises(CheckpointError, match="the checkpoint has the float 2.5 where the template has the int 1"):
        from_state_dict({"x": 1}, {"x": 2.5})
    with pytest.raises(CheckpointError, match="from_state_dict needs the flat dict"):
        from_state_dict({"x": 1}, [1])


# --- files -------------------------------------------------------------------------


def test_truncated_and_altered_files_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, params={"w": torch.arange(64.0)}, step=3)
    data = path.read_bytes()
    (tmp_path / "short.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path / "short.pt", step=0)
    raw = pickle.loads(pickle.dumps(torch.load(path, weights_only=True)))
    raw["trees"]["params"]["w"][5] = 1e9  # altered after writing, checksum kept
    torch.save(raw, tmp_path / "altered.pt")
    with pytest.raises(CheckpointError, match="failed its checksum"):
        load_checkpoint(tmp_path / "altered.pt", step=0)
    flipped = bytearray(data)
    pos = data.index(torch.arange(64.0)[40:41].numpy().tobytes())
    flipped[pos] ^= 0x01
    (tmp_path / "flipped.pt").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="failed its checksum"):
        load_checkpoint(tmp_path / "flipped.pt", step=0)
    with pytest.raises(CheckpointError, match="no checkpoint file"):
        load_checkpoint(tmp_path / "none.pt", step=0)
    with pytest.raises(CheckpointError, match="has no tree 'state'"):
        load_checkpoint(path, state=0)
    with pytest.raises(CheckpointError, match=r"tree 'params': .*'w': shape \(64,\)"):
        load_checkpoint(path, params={"w": torch.zeros(8)})


def test_a_file_naming_a_class_or_callable_is_refused_without_importing(tmp_path, monkeypatch):
    module = tmp_path / "evil_ckpt_module.py"
    marker = tmp_path / "imported"
    module.write_text(f"open({str(marker)!r}, 'w').close()\nclass Payload:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import evil_ckpt_module  # noqa: F401  (to pickle a reference to it)

    marker.unlink()
    path = tmp_path / "evil.pt"
    torch.save({"format": "opake_fx.checkpoint", "version": 1, "trees": {"x": {"": sys.modules["evil_ckpt_module"].Payload()}},
                "sha256": ""}, path)
    del sys.modules["evil_ckpt_module"]
    with pytest.raises(CheckpointError, match="refused: .*Nothing was imported"):
        load_checkpoint(path, x=0)
    assert not marker.exists() and "evil_ckpt_module" not in sys.modules
    torch.save({"x": print}, tmp_path / "callable.pt")
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(tmp_path / "callable.pt", x=0)


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, step=1)

    def dies_halfway(obj, f, *a, **k):
        f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, step=2)
    monkeypatch.undo()
    assert load_checkpoint(path, step=0) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_checkpoint_file_loads_with_plain_weights_only_torch_load(tmp_path):
    save_checkpoint(tmp_path / "c.pt", state=_every_state()["mf"])
    data = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(data) == {"format", "version", "trees", "sha256"}
    assert isinstance(data["trees"]["state"]["buffers/0"], torch.Tensor)


def test_errors_are_opake_errors():
    assert issubclass(CheckpointError, OpakeError) and issubclass(CheckpointError, ValueError)


def test_a_run_built_by_a_plan_resumes_bit_identically(tmp_path):
    from opake_fx.plan import DPPlan

    plan = DPPlan(dataset_size=40, batch_size=8, steps=6, noise_multiplier=1.0, delta=1e-5)
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    y = x.sum(1)

    def fresh():
        pipeline = plan.pipeline(lambda p, xi, yi: (xi @ p["w"] - yi) ** 2, adam(0.1), key=key(1))
        return plan.sampler(x, key(0)), pipeline, plan.accountant()

    def step(idx, params, state, pipeline, acct):
        acct.step(plan.step_cost)
        updates, state = pipeline.update((x[idx], y[idx]), state, params)
        return apply_updates(params, updates), state

    sampler, pipeline, acct = fresh()
    params, state = {"w": torch.zeros(3)}, pipeline.init({"w": torch.zeros(3)})
    batches = iter(sampler)
    for _ in range(2):
        params, state = step(next(batches), params, state, pipeline, acct)
    save_checkpoint(tmp_path / "c.pt", plan=plan, params=params, state=state, sampler=sampler, accountant=acct)
    s0, p0, a0 = fresh()
    ck = load_checkpoint(tmp_path / "c.pt", plan=plan, params={"w": torch.zeros(3)}, state=p0.init({"w": torch.zeros(3)}),
                         sampler=s0, accountant=a0)
    assert ck["plan"] == plan
    resumed = iter(ck["sampler"])
    pb, sb = ck["params"], ck["state"]
    for _ in range(2):  # 4 of the 6 planned steps in all
        ia, ib = next(batches), next(resumed)
        assert ia == ib
        params, state = step(ia, params, state, pipeline, acct)
        pb, sb = step(ib, pb, sb, p0, ck["accountant"])
    assert_trees_equal(pb, params)
    assert_trees_equal(state_dict(sb), state_dict(state))
    assert ck["accountant"].spent == acct.spent


def test_every_schedule_takes_its_parameters_from_the_checkpoint():
    saved = (scheduling.constant(0.3), scheduling.linear(1.0, 0.1, 50), scheduling.cosine(0.2, 40, alpha=0.1),
             scheduling.inverse_sqrt(0.5, warmup_steps=7), scheduling.with_warmup(scheduling.linear(0.4, 0.0, 9), 3))
    template = (scheduling.constant(1.0), scheduling.linear(0.0, 0.0, 1), scheduling.cosine(1.0, 1),
                scheduling.inverse_sqrt(1.0), scheduling.with_warmup(scheduling.linear(0.0, 0.0, 1), 1))
    back = _roundtrip(template, saved)
    assert back == saved and back != template
    assert [s(11) for s in back] == [s(11) for s in saved]

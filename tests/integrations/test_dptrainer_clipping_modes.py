"""DPTrainer's clipping modes: per-group norms (regex dict), AUTO-S and adaptive clipping, through one DPPlan."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import opake_fx.accounting as acc  # noqa: E402
import opake_fx.dpsgd.accounting as dpsgd_acc  # noqa: E402
from opake_fx.errors import CheckpointError, InputTypeError, InputValueError  # noqa: E402
from opake_fx.functional import make_functional  # noqa: E402
from opake_fx.plan import DPPlan  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from opake_fx.transformers.trainer import UNBOUNDED_CLIP  # noqa: E402
from opake_fx.types import PerGroup  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402

STEPS, EPS = 4, 4.0

MODES = {
    "per_group": dict(clipping_norm={r"\.h\.0\.": 0.3, "lora_B": 0.4, "fallback": 5.0}),  # fallback: the h.1 lora_A
    "auto": dict(clipping_mode="auto", clipping_norm=0.5, clipping_kwargs={"gamma": 0.01}),
    "adaptive": dict(clipping_mode="adaptive", clipping_norm=0.05,
                     clipping_kwargs={"count_noise_multiplier": 2.0, "learning_rate": 0.5, "target_quantile": 0.5}),
}


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=16, max_steps=STEPS, learning_rate=1e-2,
                privacy_target_epsilon=EPS, privacy_seed=0, privacy_accountant="rdp", logging_steps=1, **hf.COMMON)
    base.update(kw)
    return TrainingArguments(**base)


def _train(out, callbacks=(), resume=None, **kw):
    model = hf.gpt2_lora(seed=3)
    trainer = DPTrainer(model=model, args=_args(out, **kw), train_dataset=hf.counting_lm_data(96),
                        callbacks=list(callbacks))
    return trainer, model, hf.quiet_train(trainer, resume_from_checkpoint=resume)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_clipping_mode_trains_and_logs_the_epsilon_of_an_accountant_for_its_plan(tmp_path, mode):
    trainer, model, out = _train(tmp_path, **MODES[mode])
    plan = trainer.privacy_plan
    assert out.global_step == STEPS and plan.clipping_mode == MODES[mode].get("clipping_mode", "fixed")
    start = hf.trainable(hf.gpt2_lora(seed=3))
    moved = hf.trainable(model)
    assert max(float((moved[n] - start[n]).abs().max()) for n in moved) > 1e-4
    logs = [h for h in trainer.state.log_history if "epsilon" in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    reference = acc.Accountant(acc.epsilon_budget(EPS, plan.delta, accountant="rdp"))
    for step, h in enumerate(logs):
        reference.step(plan.step_cost_at(step))
        assert h["epsilon"] == pytest.approx(reference.spent_epsilon(plan.delta), rel=1e-9)
    assert 0 < out.metrics["privacy_epsilon"] <= EPS
    fixed = DPPlan(**{**plan.to_dict(), "clipping_norm": 1.0, "clipping_mode": "fixed", "clipping_kwargs": None,
                      "noise_multiplier": None})
    if mode == "per_group":  # the dict's regexes were matched against the trainable names; sensitivity is the total
        _, params = make_functional(model, trainable_only=True)
        names = make_functional(model, trainable_only=True)[0].param_names
        assert isinstance(plan.clipping_norm, PerGroup) and len(plan.clipping_norm.groups) == len(params) == 16
        norm_of = {n: plan.clipping_norm.for_path((i,)) for i, n in enumerate(names)}
        assert {norm_of[n] for n in names if ".h.0." in n} == {0.3}
        assert {norm_of[n] for n in names if ".h.1." in n and "lora_B" in n} == {0.4}
        assert {norm_of[n] for n in names if ".h.1." in n and "lora_A" in n} == {5.0}
        assert plan.sensitivity == pytest.approx(math.sqrt(0.3**2 + 0.4**2 + 5.0**2))
        assert plan.noise_multiplier == fixed.noise_multiplier  # the accounting reads sigma only
    if mode == "auto":
        assert plan.noise_multiplier == fixed.noise_multiplier and plan.epsilon() == fixed.epsilon()
    if mode == "adaptive":
        z, sb = plan.noise_multiplier, 2.0
        by_hand = dpsgd_acc.poisson(dpsgd_acc.adaptive_clipping_gaussian(z, sb), plan.sample_rate) * STEPS
        assert logs[-1]["epsilon"] == pytest.approx(by_hand.epsilon_at(plan.delta, accountant="rdp"), rel=1e-9)
        assert z > fixed.noise_multiplier  # calibrated for the gradient and the count together
        norms = [h["clipping_norm"] for h in logs]  # the released norm moves: it starts far below the gradients'
        assert norms[0] > 0.05 and all(b > a for a, b in zip(norms, norms[1:]))
        assert trainer._dp["state"]["clip"].clip_state.clipping_norm == norms[-1]  # inside the loss record


@pytest.mark.parametrize("mode", ["per_group", "adaptive"])
def test_a_resumed_run_continues_the_clip_state_and_the_plan(tmp_path, mode):
    ckpt = dict(save_strategy="steps", save_steps=2)
    _train(tmp_path / "cut", callbacks=[hf.StopAt(2)], **ckpt, **MODES[mode])
    saved = json.loads((tmp_path / "cut" / "checkpoint-2" / "accountant.json").read_text())["plan"]
    assert saved["clipping_mode"] == MODES[mode].get("clipping_mode", "fixed")
    _, full_model, full = _train(tmp_path / "full", **ckpt, **MODES[mode])
    trainer, model, rest = _train(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-2"), **ckpt,
                                  **MODES[mode])
    a, b = hf.trainable(full_model), hf.trainable(model)
    for n in a:
        torch.testing.assert_close(b[n], a[n], atol=1e-6, rtol=0)
    assert rest.metrics["privacy_epsilon"] == pytest.approx(full.metrics["privacy_epsilon"], rel=1e-9)
    assert DPPlan(**saved) == trainer.privacy_plan
    other = {**MODES[mode]}
    if mode == "per_group":
        other["clipping_norm"] = {**other["clipping_norm"], "fallback": 4.0}
    else:
        other["clipping_kwargs"] = {**other["clipping_kwargs"], "target_quantile": 0.7}
    with pytest.raises(CheckpointError, match=r"another privacy plan \(differs in \['clipping_"):
        _train(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-2"), **ckpt, **other)


def test_an_unbounded_clip_norm_is_still_the_non_private_baseline(tmp_path):
    with pytest.warns(UserWarning, match="NOT private"):
        trainer, _, out = _train(tmp_path, privacy_target_epsilon=None, privacy_noise_multiplier=0.0,
                                 clipping_norm=math.inf, max_steps=2)
    assert trainer.privacy_plan.clipping_norm == UNBOUNDED_CLIP and out.metrics["privacy_epsilon"] == math.inf


@pytest.mark.parametrize("fields, error, match", [
    ({"clipping_norm": {"wte": 1.0, "fallback": 1.0}}, InputValueError,  # the frozen embedding is not trainable
     r"clipping_norm: the regex 'wte' matches no trainable parameter.*lora_A"),
    ({"clipping_norm": {"lora_A": 1.0}}, InputValueError,
     r"clipping_norm: trainable parameter\(s\) \[.*lora_B.*\].* match no regex.*no 'fallback' entry. Add \"fallback\""),
    ({"clipping_norm": {"lora": 1.0, "lora_B": 1.0}}, InputValueError,
     r"'lora_B' matches only parameters an earlier regex took"),
])
def test_per_group_regexes_that_do_not_fit_the_trainable_parameters_are_errors_at_train(tmp_path, fields, error, match):
    with pytest.raises(error, match=match):
        _train(tmp_path, **fields)


@pytest.mark.parametrize("fields, error, match", [
    ({"clipping_norm": {"lora_A": 1.0, "fallback": 1.0}, "clipping_mode": "auto"}, InputValueError,
     "per-group clipping_norm \\(a dict\\) goes with clipping_mode='fixed' only"),
    ({"clipping_norm": {"lora_A": 1.0, "fallback": 1.0}, "clipping_mode": "adaptive"}, InputValueError,
     "per-group clipping_norm .*clipping_mode='adaptive' tracks one norm"),
    ({"clipping_norm": {"lora_A": math.inf, "fallback": 1.0}}, InputValueError,
     r"clipping_norm\['lora_A'\] must be finite and > 0.*math.inf"),
    ({"clipping_norm": {"(": 1.0}}, InputValueError, "clipping_norm key '\\(' is not a valid regular expression"),
    ({"clipping_norm": {}}, InputValueError, "clipping_norm=\\{\\} has no group"),
    ({"clipping_norm": {1: 1.0}}, InputTypeError, "clipping_norm's keys are parameter-name regexes"),
    ({"clipping_mode": "auto", "clipping_kwargs": {"target_quantile": 0.5}}, InputValueError,
     r"clipping_kwargs \['target_quantile'\] do not apply to clipping_mode='auto', which takes \['gamma'\]"),
    ({"clipping_kwargs": {"gamma": 0.1}}, InputValueError, "do not apply to clipping_mode='fixed', which takes none"),
    ({"clipping_mode": "adaptive", "privacy_noise_mechanism": "band_mf"}, InputValueError,
     "clipping_mode='adaptive' needs privacy_noise_mechanism='gaussian'.*Use clipping_mode='fixed' or 'auto'"),
    ({"clipping_mode": "auto", "clipping_norm": math.inf, "privacy_target_epsilon": None,
      "privacy_noise_multiplier": 0.0}, InputValueError, "clipping_norm=inf .* goes with clipping_mode='fixed' only"),
    ({"clipping_mode": "AUTO-S"}, InputValueError, "clipping_mode must be one of"),
])
def test_bad_clipping_fields_are_refused_naming_the_field_and_the_fix(tmp_path, fields, error, match):
    with pytest.raises(error, match=match):
        _args(tmp_path, **fields)


def test_the_arguments_still_build_a_command_line_parser_and_take_per_group_norms_as_json(tmp_path):
    parser = transformers.HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--privacy_target_epsilon", "3",
                                                  "--clipping_norm", "0.5", "--report_to", "none"])
    assert args.clipping_norm == 0.5
    as_json = _args(tmp_path, clipping_norm='{"lora_A": 0.5, "fallback": 1.0}')
    assert as_json.clipping_norm == {"lora_A": 0.5, "fallback": 1.0}
    with pytest.raises(InputValueError, match="clipping_norm='lora: 1' is a string but not JSON"):
        _args(tmp_path, clipping_norm="lora: 1")


def test_adaptive_clipping_kwargs_out_of_range_are_refused_by_the_plan_at_train(tmp_path):
    with pytest.raises(InputValueError, match=r"clipping_kwargs\['count_noise_multiplier'\]=0.01 is too small"):
        _train(tmp_path, clipping_mode="adaptive", clipping_kwargs={"count_noise_multiplier": 0.01})


_WORKER = '''
import os, sys, torch
sys.path.insert(0, {root!r})
from opake_fx.transformers import DPTrainer, TrainingArguments
from tests.integrations import _hf_trainer as hf
torch.set_num_threads(1)
out = sys.argv[1]
args = TrainingArguments(output_dir=os.path.join(out, "run"), per_device_train_batch_size=8, max_steps=4,
                         learning_rate=1e-2, privacy_target_epsilon=4.0, privacy_accountant="rdp", logging_steps=1,
                         ddp_backend="gloo", clipping_mode="adaptive", clipping_norm=0.05,
                         clipping_kwargs={{"count_noise_multiplier": 2.0, "learning_rate": 0.5}}, **hf.COMMON)
model = hf.gpt2_lora(seed=0)
trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(96))
result = hf.quiet_train(trainer)
torch.save({{"params": hf.trainable(model), "epsilon": result.metrics["privacy_epsilon"],
            "norms": [h["clipping_norm"] for h in trainer.state.log_history if "clipping_norm" in h]}},
           os.path.join(out, f"rank{{torch.distributed.get_rank()}}.pt"))
'''


@pytest.mark.slow
def test_adaptive_clipping_under_two_ranks_sums_the_count_and_keeps_one_norm(tmp_path):
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER.format(root=str(root)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(worker), str(tmp_path)]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["epsilon"] == r1["epsilon"] <= 4.0
    assert r0["norms"] == r1["norms"] and len(r0["norms"]) == 4 and r0["norms"][-1] > 0.05  # one synced norm
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name

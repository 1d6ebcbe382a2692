"""DPTrainer where it follows ``transformers.Trainer`` (issue 29's trainer parity).

* weight decay skips what Hugging Face's ``get_decay_parameter_names`` skips (biases, norm weights);
* ``max_grad_norm`` (Hugging Face's clip of the summed gradient) is refused unless it is the
  default or off: DP clips each example's gradient to ``clipping_norm`` instead;
* the logged loss is the clipping pass's own: no forward pass is added for logging.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from opake_fx.errors import InputValueError  # noqa: E402
from opake_fx.functional import make_functional  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from opake_fx.transformers.losses import per_example_loss_fn  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


def _dp_args(tmp_path, name, **kw):
    fields = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=8, max_steps=3, learning_rate=1e-2,
                  privacy_noise_multiplier=1.0, clipping_norm=1.0, privacy_seed=0, privacy_accountant="rdp", **hf.COMMON)
    return TrainingArguments(**{**fields, **kw})


# --- 1. weight decay: Hugging Face's split --------------------------------------------------


@pytest.mark.parametrize("make, data", [(hf.bert, hf.classification_data), (hf.llama, hf.counting_lm_data)],
                         ids=["bert", "llama"])
def test_weight_decay_skips_what_hugging_face_skips(tmp_path, make, data):
    # One step with weight_decay=0.1 and one with 0 from the same parameters, batch and noise (the same privacy seed):
    # the noised gradients and Adam's directions are the same, so a parameter differs iff it was decayed.
    after = {}
    for wd in (0.0, 0.1):
        model = make(seed=4)
        trainer = DPTrainer(model=model, args=_dp_args(tmp_path, f"wd{wd}", max_steps=1, weight_decay=wd),
                            train_dataset=data(32))
        hf.quiet_train(trainer)
        after[wd] = hf.trainable(model)
    start = hf.trainable(make(seed=4))
    assert all(not torch.equal(after[0.0][n], start[n]) for n in start if "position" not in n)  # every one moved
    decayed = {n for n in after[0.0] if not torch.equal(after[0.0][n], after[0.1][n])}

    oracle_model = make(seed=4)
    oracle = transformers.Trainer(model=oracle_model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), **hf.COMMON))
    hf_decayed = {n for n in oracle.get_decay_parameter_names(oracle_model)
                  if dict(oracle_model.named_parameters())[n].requires_grad}
    assert decayed == hf_decayed
    undecayed = set(start) - decayed
    assert any(n.endswith("bias") for n in undecayed) or make is hf.llama  # Llama has no biases
    assert any("norm" in n.lower() for n in undecayed)  # LayerNorm (BERT) / RMSNorm (Llama) weights
    assert any(n.endswith("proj.weight") or n.endswith("dense.weight") for n in decayed)  # Linear weights
    for n in undecayed:  # not decayed: bit for bit the weight_decay=0 step
        assert torch.equal(after[0.1][n], after[0.0][n]), n


# --- 2. max_grad_norm --------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, float("inf")])
def test_a_max_grad_norm_other_than_the_default_or_off_is_refused(tmp_path, value):
    with pytest.raises(InputValueError, match=r"max_grad_norm.*clipping_norm=") as caught:
        _dp_args(tmp_path, "args", max_grad_norm=value)
    assert "leave max_grad_norm at its default" in str(caught.value)


def test_max_grad_norm_set_after_construction_is_refused_before_the_trainer_changes_anything(tmp_path):
    args = _dp_args(tmp_path, "late")
    args.max_grad_norm = 0.5  # e.g. copied over from a Hugging Face script's arguments
    model, data = hf.gpt2_lora(seed=1), hf.counting_lm_data(16)
    rng = torch.random.get_rng_state()
    with pytest.raises(InputValueError, match=r"DPTrainer: max_grad_norm=0.5.*clipping_norm=0.5"):
        DPTrainer(model=model, args=args, train_dataset=data)
    assert torch.equal(torch.random.get_rng_state(), rng)  # refused before Hugging Face's __init__ (set_seed) ran
    args.max_grad_norm = 1.0
    DPTrainer(model=model, args=args, train_dataset=data)
    assert not torch.equal(torch.random.get_rng_state(), rng)  # (which would have changed it)


@pytest.mark.parametrize("value", [1.0, 0.0, None])
def test_the_default_max_grad_norm_and_off_train(tmp_path, value):
    args = _dp_args(tmp_path, "ok", max_steps=2, max_grad_norm=value)
    model = hf.gpt2_lora(seed=1)
    out = hf.quiet_train(DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(32)))
    assert out.global_step == 2
    start = hf.trainable(hf.gpt2_lora(seed=1))
    assert max(float((p - start[n]).abs().max()) for n, p in hf.trainable(model).items()) > 1e-4


# --- 3. the logged loss: the clipping pass's own -------------------------------------------


class _Snapshots(transformers.TrainerCallback):
    """The trainable parameters at the start of each step (those the step is computed at)."""

    def __init__(self, model):
        self.model, self.at = model, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.at[state.global_step] = hf.trainable(self.model)


def _counted_run(tmp_path, name, **kw):
    model = hf.gpt2_lora(seed=2)
    calls = [0]
    model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    snapshots = _Snapshots(model)
    data = hf.counting_lm_data(48)
    trainer = DPTrainer(model=model, args=_dp_args(tmp_path, name, max_steps=4, **kw), train_dataset=data,
                        callbacks=[snapshots])
    hf.quiet_train(trainer)
    return trainer, calls[0], snapshots, data


@pytest.mark.parametrize("kw", [{}, {"clip_backend": "vmap"},
                                {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}],
                         ids=["auto", "vmap", "accumulation"])
def test_logging_adds_no_forward_pass_and_logs_the_steps_loss(tmp_path, kw):
    logged, with_logs, snapshots, data = _counted_run(tmp_path, "logs", logging_steps=1, **kw)
    _, without_logs, _, _ = _counted_run(tmp_path, "nologs", logging_strategy="no", **kw)
    assert with_logs == without_logs
    losses = [(h["step"], h["loss"]) for h in logged.state.log_history if "epsilon" in h]
    assert [s for s, _ in losses] == [1, 2, 3, 4]
    # the oracle: the mean per-example loss of step s's batch at the parameters step s started from
    model = hf.gpt2_lora(seed=2)
    fmodel, _ = make_functional(model, trainable_only=True)
    per_example = per_example_loss_fn(model)
    sampler = logged._dp["sampler"]
    for step, loss in losses:
        indices = list(sampler.batch(step - 1))
        assert indices  # expected batch 8 of 48: every step has examples here
        batch = {k: v for k, v in logged.data_collator([data[i] for i in indices]).items() if torch.is_tensor(v)}
        params = tuple(snapshots.at[step - 1][n] for n in fmodel.param_names)
        with torch.no_grad():
            want = float(per_example(fmodel, params, batch).double().mean())
        assert loss == pytest.approx(want, abs=1e-6, rel=0)


def test_an_empty_batch_logs_the_last_non_empty_steps_loss(tmp_path):
    # expected batch 1 of 200: some steps draw no example, and log the loss of the latest step that had one
    args = _dp_args(tmp_path, "empty", per_device_train_batch_size=1, max_steps=8, logging_steps=1)
    trainer = DPTrainer(model=hf.gpt2_lora(seed=2), args=args, train_dataset=hf.counting_lm_data(200))
    hf.quiet_train(trainer)
    losses = [h["loss"] for h in trainer.state.log_history if "epsilon" in h]
    sizes = [len(trainer._dp["sampler"].batch(t)) for t in range(8)]
    followed = [t for t in range(1, 8) if sizes[t] == 0 and any(sizes[:t])]
    assert followed, sizes  # the case is exercised
    for t in followed:
        assert losses[t] == losses[t - 1]
    assert len(set(losses[t] for t in range(8) if sizes[t] > 0)) == sum(1 for s in sizes if s > 0)

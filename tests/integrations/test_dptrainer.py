"""DPTrainer: a Hugging Face Trainer script made private by its imports; epsilon, equivalence, exactness."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import opake_fx.accounting as acc  # noqa: E402
from opake_fx.errors import InputTypeError, InputValueError, SlowPathWarning  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402

# --- 1. the two-import change ---------------------------------------------------------------

SCRIPT = '''
from transformers import Trainer, TrainingArguments

args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=16, max_steps=6, learning_rate=1e-2,
                         logging_steps=3, **COMMON, **DP_FIELDS)
trainer = Trainer(model=MODEL, args=args, train_dataset=DATA)
result = quiet_train(trainer)
'''


def test_a_plain_trainer_script_becomes_private_by_changing_its_imports(tmp_path):
    env = dict(COMMON=hf.COMMON, quiet_train=hf.quiet_train, DATA=hf.counting_lm_data(128))
    plain = dict(env, OUT=str(tmp_path / "plain"), MODEL=hf.gpt2_lora(), DP_FIELDS={})
    exec(SCRIPT, plain)
    assert "privacy_epsilon" not in plain["result"].metrics

    private_script = SCRIPT.replace("from transformers import Trainer, TrainingArguments",
                                    "from opake_fx.transformers import DPTrainer as Trainer, TrainingArguments")
    assert private_script.count("\n") == SCRIPT.count("\n")  # one line changed, plus the DP fields
    private = dict(env, OUT=str(tmp_path / "dp"), MODEL=hf.gpt2_lora(),
                   DP_FIELDS=dict(privacy_target_epsilon=3.0, privacy_seed=0, privacy_accountant="rdp"))
    exec(private_script, private)
    metrics = private["result"].metrics
    assert 0 < metrics["privacy_epsilon"] <= 3.0
    assert metrics["privacy_delta"] == pytest.approx(1 / 128**1.1)
    assert private["result"].global_step == 6


# --- 2. GPT-2 + LoRA at epsilon 8 -----------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])
def test_gpt2_lora_learns_logs_the_accountants_epsilon_and_stays_within_budget(tmp_path, accountant):
    model = hf.gpt2_lora()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=64, max_steps=20, learning_rate=2e-2,
                             lr_scheduler_type="constant", logging_steps=2, privacy_target_epsilon=8.0, privacy_seed=0,
                             privacy_accountant=accountant,
                             **{**hf.COMMON, "save_strategy": "steps"}, save_steps=10)
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(512))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        out = hf.quiet_train(trainer)
    logs = [h for h in trainer.state.log_history if "epsilon" in h]
    assert [h["step"] for h in logs] == list(range(2, 21, 2))
    plan = trainer.privacy_plan
    reference = acc.Accountant(acc.epsilon_budget(8.0, plan.delta, accountant=accountant))
    for step in range(1, 21):
        reference.step(plan.step_cost)
        if step % 2 == 0:
            logged = next(h["epsilon"] for h in logs if h["step"] == step)
            assert logged == pytest.approx(reference.spent_epsilon(plan.delta), rel=1e-9)
    assert out.metrics["privacy_epsilon"] <= 8.0
    assert out.metrics["privacy_epsilon"] == pytest.approx(logs[-1]["epsilon"])
    losses = [h["loss"] for h in logs]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05  # it learns
    for step in (10, 20):  # every checkpoint holds the accountant
        doc = json.loads((tmp_path / f"checkpoint-{step}" / "accountant.json").read_text())
        assert doc["steps"] == step
        assert doc["epsilon"] == pytest.approx(next(h["epsilon"] for h in logs if h["step"] == step))
        assert doc["plan"]["noise_multiplier"] == plan.noise_multiplier
    for n, p in model.named_parameters():  # the frozen base never moved
        if not p.requires_grad:
            assert torch.equal(p, frozen[n])


def test_training_stops_when_the_budget_is_spent(tmp_path, monkeypatch):
    from opake_fx.plan import DPPlan

    # an accountant whose budget covers two of the plan's five steps (as a run resumed on a half-spent budget)
    monkeypatch.setattr(DPPlan, "accountant", lambda self: acc.Accountant(acc.epsilon_budget(self.epsilon(2) * 1.001, self.delta, accountant="rdp")))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=5,
                             privacy_target_epsilon=2.0, privacy_seed=0, privacy_accountant="rdp", **hf.COMMON)
    trainer = DPTrainer(model=hf.gpt2_lora(), args=args, train_dataset=hf.counting_lm_data(64))
    out = hf.quiet_train(trainer)
    assert out.global_step == 2
    assert out.metrics["privacy_budget_exhausted"] is True
    assert out.metrics["privacy_epsilon"] <= trainer.privacy_plan.epsilon(2) * 1.001


# --- 3. equivalence with Hugging Face's own Trainer ------------------------------------------


class _InOrderTrainer(transformers.Trainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


def test_without_noise_and_clipping_it_is_hugging_faces_trainer(tmp_path):
    data = hf.counting_lm_data(80)
    opts = dict(per_device_train_batch_size=8, max_steps=10, learning_rate=1e-2, warmup_steps=3, optim="adamw_torch",
                adam_beta2=0.99, max_grad_norm=0.0, **hf.COMMON)
    theirs = hf.gpt2_lora(seed=5)
    hf.quiet_train(_InOrderTrainer(model=theirs, args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **opts),
                                   train_dataset=data))
    ours = hf.gpt2_lora(seed=5)
    args = TrainingArguments(output_dir=str(tmp_path / "dp"), privacy_noise_multiplier=0.0, clipping_norm=math.inf,
                             sampling_mode="sequential", **opts)
    with pytest.warns(UserWarning, match="NOT private"):
        out = hf.quiet_train(DPTrainer(model=ours, args=args, train_dataset=data))
    assert out.metrics["privacy_epsilon"] == math.inf
    a, b = hf.trainable(theirs), hf.trainable(ours)
    assert a.keys() == b.keys() and len(a) > 0
    start = hf.trainable(hf.gpt2_lora(seed=5))
    assert max(float((a[n] - start[n]).abs().max()) for n in a) > 1e-3  # it did train
    for n in a:
        torch.testing.assert_close(b[n], a[n], atol=1e-5, rtol=0)


# --- 4. Llama- and BERT-style models: fast clipping, exact per-example gradients -------------


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_llama_and_bert_train_with_auto_clipping_and_no_slow_path(tmp_path, arch):
    model = hf.llama() if arch == "llama" else hf.bert()
    data = hf.padded_lm_data(48) if arch == "llama" else hf.classification_data(48)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=12, max_steps=3,
                             privacy_target_epsilon=8.0, privacy_seed=1, privacy_accountant="rdp", **hf.COMMON)
    before = hf.trainable(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        out = hf.quiet_train(DPTrainer(model=model, args=args, train_dataset=data))
    assert out.global_step == 3 and out.metrics["privacy_epsilon"] <= 8.0
    assert any(not torch.equal(before[n], p) for n, p in hf.trainable(model).items())


def _per_example_clipped_sum(model, examples, loss_of, clip):
    total = None
    for ex in examples:
        model.zero_grad()
        loss_of(model, ex).backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        scale = min(1.0, clip / float(norm))
        grads = [g * scale for g in grads]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return total


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_the_step_is_the_clipped_per_example_autograd_sum_in_float64(tmp_path, arch):
    import torch.nn.functional as F

    data = hf.padded_lm_data(8) if arch == "llama" else hf.classification_data(8)
    build = hf.llama if arch == "llama" else hf.bert
    model = build(seed=7).double()
    start = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    clip = 0.05  # below every example's gradient norm: each is clipped
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=1, learning_rate=1.0,
                             optim="sgd", lr_scheduler_type="constant", privacy_noise_multiplier=0.0,
                             clipping_norm=clip, sampling_mode="sequential", **hf.COMMON)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("error", SlowPathWarning)
        hf.quiet_train(DPTrainer(model=model, args=args, train_dataset=data))
    moved = [p.detach() - s for p, s in zip((p for p in model.parameters() if p.requires_grad), start)]

    reference_model = build(seed=7).double()

    def loss_of(m, ex):
        ids = ex["input_ids"][None]
        if arch == "llama":
            logits = m(input_ids=ids, attention_mask=ex["attention_mask"][None]).logits
            labels = ex["labels"][None, 1:]
            return F.cross_entropy(logits[0, :-1], labels[0], ignore_index=-100)
        return F.cross_entropy(m(input_ids=ids).logits, ex["labels"][None])

    expected = _per_example_clipped_sum(reference_model, data, loss_of, clip)
    for m, e in zip(moved, expected):
        torch.testing.assert_close(m, -e / 8, atol=1e-9, rtol=1e-5)  # the fast backend's certified norms: ~1e-6 relative


# --- errors ----------------------------------------------------------------------------------


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2, **hf.COMMON)
    base.update(kw)
    return TrainingArguments(**base)


@pytest.mark.parametrize("fields, match", [
    ({}, "neither was given"),
    ({"privacy_target_epsilon": 3.0, "privacy_noise_multiplier": 1.0}, "both were given"),
    ({"privacy_target_epsilon": 3.0, "clipping_norm": math.inf}, "clipping_norm=inf"),
    ({"privacy_target_epsilon": 3.0, "sampling_mode": "sequential"}, "sequential"),
    ({"privacy_target_epsilon": 3.0, "clipping_mode": "adaptive", "privacy_noise_mechanism": "band_mf"},
     "clipping_mode"),
    ({"privacy_target_epsilon": 3.0, "clipping_norm": {"fallback": math.inf}}, "clipping_norm"),
    ({"privacy_target_epsilon": -1.0}, "privacy_target_epsilon"),
    ({"privacy_target_epsilon": 3.0, "sampling_kwargs": {"nonsense": 1}}, "nonsense"),
])
def test_bad_dp_fields_are_clear_errors(tmp_path, fields, match):
    with pytest.raises(InputValueError, match=match):
        _args(tmp_path, **fields)


def test_from_hf_keeps_the_hugging_face_fields(tmp_path):
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-3, lr_scheduler_type="cosine",
                                           warmup_steps=5, report_to="none")
    args = TrainingArguments.from_hf(plain, privacy_noise_multiplier=1.0, clipping_norm=0.5)
    assert (args.learning_rate, str(args.lr_scheduler_type.value), args.warmup_steps) == (3e-3, "cosine", 5)
    assert (args.privacy_noise_multiplier, args.clipping_norm) == (1.0, 0.5)
    with pytest.raises(InputValueError, match="unknown DP field"):
        TrainingArguments.from_hf(plain, privacy_epsilon=1.0)


def test_plain_arguments_a_batch_averaged_loss_and_bad_models_are_refused(tmp_path):
    data = hf.counting_lm_data(32)
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(InputTypeError, match="from_hf"):
        DPTrainer(model=hf.gpt2_lora(), args=plain, train_dataset=data).train()
    args = _args(tmp_path, privacy_target_epsilon=3.0)
    with pytest.raises(InputValueError, match="per_example_loss_func"):
        DPTrainer(model=hf.gpt2_lora(), args=args, train_dataset=data,
                  compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss).train()

    class MyTrainer(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss

    with pytest.raises(InputValueError, match="overrides compute_loss"):
        MyTrainer(model=hf.gpt2_lora(), args=args, train_dataset=data).train()
    flash = hf.gpt2()
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(InputValueError, match="attn_implementation"):
        DPTrainer(model=flash, args=args, train_dataset=data).train()
    bn = hf.gpt2()
    bn.transformer.bn = torch.nn.BatchNorm1d(4)
    with pytest.raises(InputValueError, match="BatchNorm"):
        DPTrainer(model=bn, args=args, train_dataset=data).train()
    with pytest.raises(InputValueError, match="reentrant"):
        DPTrainer(model=hf.gpt2(), args=_args(tmp_path, privacy_target_epsilon=3.0, gradient_checkpointing=True),
                  train_dataset=data).train()
    with pytest.raises(InputValueError, match="map-style"):
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(data)

        stream = Stream()
        DPTrainer(model=hf.gpt2(), args=args, train_dataset=stream).train()


@pytest.mark.parametrize("backend", ["auto", "vmap"])
def test_empty_poisson_batches_are_normal_steps(tmp_path, backend):
    # expected batch 1 of 64: a third of the steps draw no example, and are noised and charged as any other
    data = hf.padded_lm_data(64)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=8, privacy_seed=0,
                             privacy_noise_multiplier=1.0, privacy_accountant="rdp", clip_backend=backend, **hf.COMMON)
    trainer = DPTrainer(model=hf.gpt2_lora(), args=args, train_dataset=data)
    model = trainer.model
    out = hf.quiet_train(trainer)
    sizes = [len(trainer._dp["sampler"].batch(t)) for t in range(8)]
    assert 0 in sizes and out.global_step == 8
    assert out.metrics["privacy_epsilon"] == pytest.approx(trainer.privacy_plan.epsilon(8), rel=1e-3)
    assert all(torch.isfinite(p).all() for p in hf.trainable(model).values())


def test_a_seq2seq_t5_trains_with_per_example_losses_from_its_labels(tmp_path):
    # T5's relative-attention bias tables are looked up without a batch axis: the shared-tensor
    # rule takes them where they meet the scores (no slow path any more)
    model = hf.t5()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2, learning_rate=1e-2,
                             privacy_target_epsilon=8.0, privacy_seed=0, privacy_accountant="rdp", **hf.COMMON)
    before = hf.trainable(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        out = hf.quiet_train(DPTrainer(model=model, args=args, train_dataset=hf.copy_seq2seq_data(32)))
    assert out.global_step == 2 and out.metrics["privacy_epsilon"] <= 8.0
    assert any(not torch.equal(before[n], p) for n, p in hf.trainable(model).items())
    from opake_fx.functional import make_functional
    from opake_fx.transformers import per_example_loss_fn

    batch = {k: torch.stack([ex[k] for ex in hf.copy_seq2seq_data(3)]) for k in ("input_ids", "attention_mask", "labels")}
    fmodel, params = make_functional(model, trainable_only=True)
    per_example = per_example_loss_fn(model)(fmodel, params, batch)
    with torch.no_grad():
        whole = model(**batch).loss  # HF's token mean: equal lengths, so the mean of the per-example means
    torch.testing.assert_close(per_example.mean(), whole, atol=1e-6, rtol=1e-6)

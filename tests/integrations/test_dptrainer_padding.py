"""Padding is the batch's business: an example's loss and gradient are those of the example alone.

Every test pads examples of random lengths to the longest of their batch, on the left or
the right, and compares each example with itself run alone without padding, in float64,
through an independent reference (the model called on the one unpadded sequence and
``F.cross_entropy``). Clip norms are set ABOVE every per-example norm where the loss
values matter (a clip below every norm rescales each gradient to C and would hide a loss
that counts padding in its per-token mean).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from opake_fx.errors import InputValueError, SlowPathWarning  # noqa: E402
from opake_fx.functional import make_functional  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments, per_example_loss_fn  # noqa: E402
from opake_fx.transformers.losses import check_padding_invariance, position_ids_from_mask  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


def _causal_lm(arch: str, seed: int = 7) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = hf.gpt2() if arch == "gpt2" else hf.llama(seed)
    return model.double().eval()


def _reference_loss(model: torch.nn.Module, ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The example alone, unpadded: token t predicts token t+1."""
    logits = model(input_ids=ids[None]).logits[0]
    return F.cross_entropy(logits[:-1], ids[1:], reduction=reduction)


def _reference_grads(model: torch.nn.Module, ids: torch.Tensor, reduction: str = "mean") -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(_reference_loss(model, ids, reduction), params))


def _norm(grads: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g * g).sum() for g in grads)))


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


# --- the per-example loss -------------------------------------------------------------------


def test_position_ids_count_from_each_examples_first_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    pos = position_ids_from_mask(mask)
    for row, m in zip(pos, mask):
        assert row[m.bool()].tolist() == list(range(int(m.sum())))  # the tokens: 0..L-1 whatever the side
    assert pos.min() >= 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("labels", [True, False], ids=["labels", "no-labels"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_each_examples_loss_and_gradient_are_those_of_the_example_alone(arch, side, labels, reduction):
    # kills: positions 0..T-1 for every example (left padding shifts them), a padding position predicting the
    # first token, labels derived from input_ids that keep the padding, padding counted in the per-token mean
    model = _causal_lm(arch)
    data = hf.variable_lm_data(5, seed=11, labels=labels)  # an odd batch of several lengths
    batch = hf.PadCollator(side)(data)
    assert (batch["attention_mask"] == 0).any()
    fmodel, params = make_functional(model, trainable_only=True)
    params = tuple(p.detach().requires_grad_() for p in params)
    losses = per_example_loss_fn(model, reduction=reduction)(fmodel, params, batch)
    assert losses.shape == (5,) and losses.dtype == torch.float64
    for i, ex in enumerate(data):
        ids = ex["input_ids"]
        with torch.no_grad():
            expected = _reference_loss(model, ids, reduction)
        torch.testing.assert_close(losses[i], expected, atol=1e-12, rtol=1e-10)
        got = torch.autograd.grad(losses[i], params, retain_graph=True)
        torch.testing.assert_close(_flat(list(got)), _flat(_reference_grads(model, ids, reduction)), atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_one_longer_example_moves_the_clipped_sum_by_its_own_clipped_gradient(arch, side):
    # The attack: with positions 0..T-1 for every example, left padding made each example's gradient depend on the
    # longest example of the batch, and adding one long example moved the clipped sum by 1.69 C (GPT-2), 1.24 C (Llama).
    model = _causal_lm(arch)
    short = [{"input_ids": ex["input_ids"][:5]} for ex in hf.variable_lm_data(5, seed=12, min_len=3, labels=False)]
    longer = {"input_ids": torch.randint(1, hf.VOCAB, (hf.T,), generator=torch.Generator().manual_seed(3))}
    fmodel, params = make_functional(model, trainable_only=True)
    params = tuple(p.detach().requires_grad_() for p in params)
    loss_fn = per_example_loss_fn(model)

    def per_example_grads(examples):
        losses = loss_fn(fmodel, params, hf.PadCollator(side)(examples))
        return [_flat(list(torch.autograd.grad(losses[i], params, retain_graph=True))) for i in range(len(examples))]

    without, with_longer = per_example_grads(short), per_example_grads(short + [longer])
    c = 0.5 * min(float(g.norm()) for g in without + with_longer)  # every example is clipped

    def clipped_sum(grads):
        return sum(g * min(1.0, c / float(g.norm())) for g in grads)

    moved = clipped_sum(with_longer) - clipped_sum(without)
    assert float(moved.norm()) <= c * (1 + 1e-9)
    torch.testing.assert_close(moved, with_longer[-1] * (c / float(with_longer[-1].norm())), atol=1e-12, rtol=1e-9)


def test_the_padding_check_refuses_a_loss_that_moves_with_the_padded_length():
    model = _causal_lm("gpt2")
    fmodel, params = make_functional(model, trainable_only=True)
    batch = hf.PadCollator("right")(hf.variable_lm_data(4, seed=13, labels=False))
    check_padding_invariance(per_example_loss_fn(model), fmodel, params, batch)  # the built-in loss passes
    counts_padding = per_example_loss_fn(model, custom=lambda out, b: out.logits.logsumexp(-1).mean(1))
    with pytest.raises(InputValueError, match="changes with the padding"):
        check_padding_invariance(counts_padding, fmodel, params, batch)
    base = per_example_loss_fn(model)

    def arange_positions(fm, p, b):  # the old numbering, 0..T-1 for every example: a left-padded example moves
        n, t = b["input_ids"].shape
        return base(fm, p, {**b, "position_ids": torch.arange(t).expand(n, t)})

    left = hf.PadCollator("left")(hf.variable_lm_data(4, seed=13, labels=False))
    check_padding_invariance(base, fmodel, params, left)
    with pytest.raises(InputValueError, match="Pad on the right"):
        check_padding_invariance(arange_positions, fmodel, params, left)
    assert model.training is False  # the model's mode is restored


# --- through DPTrainer, on the fast clipping backend ------------------------------------------


def _one_step(tmp_path, model, data, collator, clip, **kw):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=len(data), max_steps=1,
                             learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", privacy_noise_multiplier=0.0,
                             clipping_norm=clip, sampling_mode="sequential", **hf.COMMON, **kw)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=collator)
    start = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the non-private baseline says so
        warnings.simplefilter("error", SlowPathWarning)
        hf.quiet_train(trainer)
    return [p.detach() - s for p, s in zip((p for p in model.parameters() if p.requires_grad), start)]


@pytest.mark.parametrize("clip", ["above", "below"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_trainers_step_is_the_clipped_sum_of_the_examples_alone(tmp_path, arch, side, clip):
    # A causal-LM batch without labels (they come from input_ids, padding ignored), 7 examples padded on `side`.
    data = hf.variable_lm_data(7, seed=14, labels=False)
    reference_model = _causal_lm(arch)
    grads = [_reference_grads(reference_model, ex["input_ids"]) for ex in data]
    norms = [_norm(g) for g in grads]
    c = 10 * max(norms) if clip == "above" else 0.5 * min(norms)
    expected = [sum(g[k] * min(1.0, c / n) for g, n in zip(grads, norms)) for k in range(len(grads[0]))]
    moved = _one_step(tmp_path, _causal_lm(arch).train(), data, hf.PadCollator(side), c)
    for m, e in zip(moved, expected):
        torch.testing.assert_close(m, -e / len(data), atol=1e-10, rtol=1e-5)  # certified norms: ~1e-6 relative


@pytest.mark.parametrize("arch", ["bert", "llama-eager"])
def test_the_trainer_refuses_a_model_whose_loss_moves_with_left_padding(tmp_path, arch):
    # Refused before anything is charged: BERT's classifier reads position 0, a padding token under left padding;
    # a float64 Llama with eager attention gives a left-padded example a NaN loss (its fully masked padding rows are
    # NaN, and 0 * NaN reaches the tokens). Right padding trains.
    if arch == "bert":
        data = [{"input_ids": ex["input_ids"], "labels": torch.tensor(i % 2)}
                for i, ex in enumerate(hf.variable_lm_data(16, seed=15, labels=False))]
        model = hf.bert(seed=1)
    else:
        data = hf.variable_lm_data(16, seed=15, labels=False)
        model = hf.llama(seed=1).double()
        model.config._attn_implementation = "eager"
    before = hf.trainable(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2,
                             privacy_target_epsilon=8.0, privacy_seed=0, privacy_accountant="rdp", **hf.COMMON)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=hf.PadCollator("left"))
    with pytest.raises(InputValueError, match="Pad on the right"):
        hf.quiet_train(trainer)
    assert trainer.accountant is None and trainer.state.global_step == 0
    assert all(torch.equal(before[n], p) for n, p in hf.trainable(model).items())
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=hf.PadCollator("right"))
    assert hf.quiet_train(trainer).global_step == 2  # right padding trains


def _counts_padding(outputs, batch):
    return outputs.logits.logsumexp(-1).mean(1)  # a mean over every position, the padding included


def test_the_trainer_refuses_a_custom_loss_that_counts_padding_before_charging(tmp_path):
    # The first 8 examples (the probe train() runs before the first step) are unpadded; the first padded batch is
    # checked before its step is charged.
    full = [{"input_ids": ex["input_ids"]} for ex in hf.variable_lm_data(8, seed=16, min_len=hf.T, labels=False)]
    data = full + hf.variable_lm_data(40, seed=17, labels=False)
    model = hf.gpt2_lora()
    before = hf.trainable(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2,
                             privacy_target_epsilon=8.0, privacy_seed=0, privacy_accountant="rdp", **hf.COMMON)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=hf.PadCollator("right"),
                        per_example_loss_func=_counts_padding)
    with pytest.raises(InputValueError, match="changes with the padding"):
        hf.quiet_train(trainer)
    assert trainer._dp["charged"] == 0 and trainer.accountant.spent_epsilon(trainer.privacy_plan.delta) == 0
    assert all(torch.equal(before[n], p) for n, p in hf.trainable(model).items())


# --- a per-example loss that is not one loss per example ---------------------------------------


@pytest.mark.parametrize("backend", ["auto", "vmap"])
@pytest.mark.parametrize("returns", ["scalar", "tokens"])
def test_a_custom_loss_that_is_not_one_loss_per_example_is_a_clear_error_before_any_step(tmp_path, returns, backend):
    def custom(outputs, batch):
        token = outputs.logits.logsumexp(-1)  # [B, T]
        return token.mean() if returns == "scalar" else token

    model = hf.gpt2_lora()
    before = hf.trainable(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2, logging_steps=1,
                             privacy_target_epsilon=8.0, privacy_seed=0, privacy_accountant="rdp", clip_backend=backend,
                             **hf.COMMON)
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(32), per_example_loss_func=custom)
    with pytest.raises(InputValueError, match=r"one loss per example, a tensor of shape \[B\]") as err:
        hf.quiet_train(trainer)
    assert "reduction='none'" in str(err.value)  # the fix
    assert trainer.accountant is None and trainer.state.global_step == 0 and not trainer._dp
    assert all(torch.equal(before[n], p) for n, p in hf.trainable(model).items())
    fmodel, params = make_functional(model, trainable_only=True)
    ids = torch.randint(0, hf.VOCAB, (3, 5))
    with pytest.raises(InputValueError, match="shape"):
        per_example_loss_fn(model, custom=custom)(fmodel, params, {"input_ids": ids})

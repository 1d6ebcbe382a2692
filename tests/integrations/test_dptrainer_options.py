"""DPTrainer options that map onto the plan: micro-batching and gradient accumulation (memory only)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from opake_fx.errors import InputValueError  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


def _run(tmp_path, name, per_device_train_batch_size=10, **kw):
    model = hf.gpt2_lora(seed=3)
    seen = []  # the batch sizes the model is called on (the clipping's and the logged loss's)

    def record(module, args, kwargs):
        seen.append(int(kwargs["input_ids"].shape[0]))

    model.register_forward_pre_hook(record, with_kwargs=True)
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=3,
                             per_device_train_batch_size=per_device_train_batch_size,
                             learning_rate=1e-2, privacy_noise_multiplier=1.0, clipping_norm=0.1, privacy_seed=0,
                             privacy_accountant="rdp", logging_steps=1, **hf.COMMON, **kw)
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(40))
    out = hf.quiet_train(trainer)
    trainer.seen = seen
    return hf.trainable(model), out, trainer


@pytest.mark.parametrize("backend", ["auto", "vmap"])
def test_microbatch_size_changes_memory_only(tmp_path, backend):
    whole, out_whole, t_whole = _run(tmp_path, "whole", clip_backend=backend)
    chunked, out_chunked, t_chunked = _run(tmp_path, "chunked", clip_backend=backend, microbatch_size=3)
    sizes = [len(t_whole._dp["sampler"].batch(t)) for t in range(3)]
    assert max(sizes) > 3
    if backend == "auto":  # the model sees whole batches, or chunks of at most 3 (vmap's clipping sees one example)
        assert max(t_whole.seen) == max(sizes) and max(t_chunked.seen) <= 3
    assert whole.keys() == chunked.keys()
    start = hf.trainable(hf.gpt2_lora(seed=3))
    assert max(float((whole[n] - start[n]).abs().max()) for n in whole) > 1e-3  # it did move
    for n in whole:
        torch.testing.assert_close(chunked[n], whole[n], atol=1e-6, rtol=0)
    assert out_chunked.metrics["privacy_epsilon"] == out_whole.metrics["privacy_epsilon"]
    logged = [[h["loss"] for h in t.state.log_history if "epsilon" in h] for t in (t_whole, t_chunked)]
    assert len(logged[0]) == 3
    assert logged[1] == pytest.approx(logged[0], rel=1e-6)  # the logged loss is also computed in chunks
    assert t_chunked.privacy_plan == t_whole.privacy_plan


def test_gradient_accumulation_is_one_dp_step_per_logical_batch(tmp_path):
    # 2 x 5 accumulated is the step of 10 at once: the same plan (expected batch 10), the same batches, the noise once
    whole, out_whole, t_whole = _run(tmp_path, "whole")
    acc, out_acc, t_acc = _run(tmp_path, "acc", per_device_train_batch_size=5, gradient_accumulation_steps=2)
    assert t_acc.privacy_plan == t_whole.privacy_plan and t_acc.privacy_plan.batch_size == 10
    assert out_acc.global_step == 3 and out_acc.metrics["privacy_epsilon"] == out_whole.metrics["privacy_epsilon"]
    sizes = [len(t_acc._dp["sampler"].batch(t)) for t in range(3)]
    assert max(sizes) > 5 and max(t_acc.seen) <= 5  # computed in chunks of the per-device batch
    for n in whole:
        torch.testing.assert_close(acc[n], whole[n], atol=1e-6, rtol=0)
    assert t_acc.args.clipping_chunk_size == 5
    assert _run(tmp_path, "both", per_device_train_batch_size=5, gradient_accumulation_steps=2,
                microbatch_size=2)[2].args.clipping_chunk_size == 2


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_a_bad_microbatch_size_is_refused(tmp_path, bad):
    with pytest.raises(InputValueError, match="microbatch_size"):
        TrainingArguments(output_dir=str(tmp_path), privacy_target_epsilon=3.0, microbatch_size=bad, **hf.COMMON)


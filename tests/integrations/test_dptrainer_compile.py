"""``TrainingArguments(torch_compile=True)``: DPTrainer runs its DP step through ``opake_fx.compiled``.

Hugging Face's own ``torch_compile`` flag compiles the model inside ``accelerate``; DPTrainer
owns its step (clip, noise, update), so it compiles that step instead, with the Poisson
batches padded to the plan's buckets. The compiled run trains the same parameters as the
eager one (float32, 1e-6), with the same keys and data.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


def _run(out, compiled: bool, clip_backend: str):
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=4, learning_rate=1e-2,
                             privacy_target_epsilon=8.0, privacy_seed=3, privacy_accountant="rdp", logging_steps=2,
                             clip_backend=clip_backend, torch_compile=compiled, **hf.COMMON)
    torch.manual_seed(0)
    model = hf.gpt2()  # dropout 0: compiled code draws dropout masks from inductor's own generator
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(64))
    out = hf.quiet_train(trainer)
    return hf.trainable(model), trainer.state.log_history, out


@pytest.mark.slow
@pytest.mark.parametrize("clip_backend", ["auto", "vmap"])
def test_torch_compile_trains_what_the_eager_step_trains(tmp_path, clip_backend):
    eager, eager_log, _ = _run(tmp_path / "eager", False, clip_backend)
    compiled, compiled_log, out = _run(tmp_path / "compiled", True, clip_backend)
    assert out.global_step == 4
    if clip_backend == "vmap":
        for n in eager:
            torch.testing.assert_close(compiled[n], eager[n], rtol=1e-6, atol=1e-7)
    else:
        # Compiled "auto" takes the traced whole-loss path on this small model, the eager one the
        # layer rules: two exact computations whose float32 rounding AdamW amplifies on rarely
        # touched embedding rows (eager "auto" and eager "vmap" differ by 8e-6 of wte's largest
        # entry). The compiled run must agree with eager "auto" as closely as the two eager
        # backends agree with each other, within 3x (relative to each tensor's largest entry).
        reference, _, _ = _run(tmp_path / "vmap", False, "vmap")
        rel = lambda a, b, n: float((a[n] - b[n]).abs().max() / b[n].abs().max())
        for n in eager:
            spread = max(rel(eager, reference, n), 1e-6)
            assert rel(compiled, eager, n) <= 3 * spread, (n, rel(compiled, eager, n), spread)
    assert [e.get("epsilon") for e in compiled_log] == [e.get("epsilon") for e in eager_log]


def test_torch_compile_with_adaptive_clipping_is_refused_before_any_step(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=4, learning_rate=1e-2,
                             privacy_target_epsilon=8.0, privacy_seed=3, privacy_accountant="rdp",
                             clipping_mode="adaptive", torch_compile=True, **hf.COMMON)
    torch.manual_seed(0)
    model = hf.gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(64))
    with pytest.raises(Exception, match="every step would compile again"):
        hf.quiet_train(trainer)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert trainer.accountant is None or trainer.accountant.steps in (0, None)

"""DPTrainer with Hugging Face's own FSDP arguments (issue 32): FSDP2-sharded DP training.

Under torchrun on 2 gloo ranks, the run with ``fsdp`` equals the same run without it
(data-parallel, same seed and data): the noise is the same by construction, so only float
summation order may differ. The options the sharded DP step cannot honour are refused when
the arguments or the trainer are made.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from opake_fx.errors import InputValueError  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.distributed.test_tutorial import _free_port  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402

ROOT = Path(__file__).parents[2]
WORKER = ROOT / "tests" / "integrations" / "_dptrainer_fsdp_worker.py"


def _launch(out: Path, mode: str, arch: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(WORKER), str(out), mode, arch]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out / f"{mode}-{arch}.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["llama", "lora", "users", "ftrl", "groups", "adaptive"])
def test_fsdp_run_equals_the_data_parallel_run(tmp_path, arch):
    """llama: every parameter trained, fsdp="full_shard" + transformer_layer_cls_to_wrap; lora: peft adapters on
    a sharded frozen base, fsdp=True (layers from _no_split_modules); users: privacy_unit="user",
    fsdp=["shard_grad_op", "auto_wrap"]; ftrl: DP-FTRL (band_mf, cyclic Poisson); groups: per-group clip norms; adaptive: adaptive
    clipping. Each evaluates mid-run (eval_steps=2) and after."""
    sharded, ddp = _launch(tmp_path, "fsdp", arch), _launch(tmp_path, "ddp", arch)
    # the sharded path really ran: DTensor parameters, half of them on each rank, FSDP2's DP step state
    assert sharded["all_dtensors"] and sharded["local_numel"] * 2 >= sharded["total_numel"] > sharded["local_numel"]
    assert sharded["groups"] == 3  # two decoder layers and the root
    assert sharded["state"] == "FSDPStepState" and ddp["state"] == "dict"
    want_noise = "MfNoiseState" if arch == "ftrl" else "GaussianNoiseState"  # ftrl: band_mf's correlated noise
    assert sharded["noise_state"] == ddp["noise_state"] == want_noise
    if arch == "adaptive":  # the noised count summed over the ranks: the same moving clip norm as data-parallel
        assert sharded["clip_norms"] == pytest.approx(ddp["clip_norms"], rel=1e-12) and len(set(ddp["clip_norms"])) > 1
    assert sharded["steps"] == ddp["steps"] == 4 and sharded["epsilon"] == ddp["epsilon"] < math.inf
    assert sorted(sharded["params"]) == sorted(ddp["params"])
    if arch == "lora":
        assert len(sharded["params"]) == 8 and all("lora_" in n for n in sharded["params"])
        assert all(torch.equal(sharded["frozen"][n], ddp["frozen"][n]) for n in ddp["frozen"])  # the base never moved
    moved = max(float((ddp["params"][n] - ddp["init"][n]).abs().max()) for n in ddp["init"])
    assert moved > 1e-3  # the runs trained: equal parameters are not the initial ones
    for name, want in ddp["params"].items():
        torch.testing.assert_close(sharded["params"][name], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert sharded["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    assert len(sharded["eval_losses"]) == 3 and sharded["eval_losses"] == pytest.approx(ddp["eval_losses"], rel=1e-5)
    # save_model gathered the shards: the full trained parameters (a PEFT model's adapters), loadable without FSDP
    saved = sharded["saved"]
    assert len(saved) == len(sharded["params"])
    for name, value in saved.items():
        key = name.replace(".weight", ".default.weight") if arch == "lora" else name
        assert torch.equal(value, sharded["params"][key]), name


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_with_fsdp_computes_in_bfloat16_and_keeps_float32_parameters(tmp_path):
    """bf16=True with fsdp: FSDP2's MixedPrecisionPolicy; the trained parameters stay float32 and end near the
    float32 sharded run's (the same noise: only the bf16 rounding of the per-example gradients differs)."""
    bf16, fp32 = _launch(tmp_path, "fsdp", "bf16"), _launch(tmp_path, "fsdp", "llama")
    assert bf16["compute_dtype"] == "torch.bfloat16" and fp32["compute_dtype"] == "None"
    assert all(p.dtype == torch.float32 for p in bf16["params"].values())
    assert bf16["epsilon"] == fp32["epsilon"] and bf16["steps"] == 4
    diff = max(float((bf16["params"][n] - w).abs().max()) for n, w in fp32["params"].items())
    moved = max(float((fp32["params"][n] - fp32["init"][n]).abs().max()) for n in fp32["init"])
    assert 0 < diff < 0.05 * moved, (diff, moved)  # bf16 did run, and the runs agree to bf16 precision
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=2e-2)


# --- refusals: at construction, naming the option and the fix ------------------------------

def _args(**kw):
    base = dict(output_dir="/tmp/opake-fsdp-test", privacy_noise_multiplier=1.0, per_device_train_batch_size=4,
                max_steps=1, **hf.COMMON)
    base.update(kw)
    if isinstance(base.get("fsdp_config"), dict):  # Hugging Face writes into the dict it is given
        base["fsdp_config"] = dict(base["fsdp_config"])
    return TrainingArguments(**base)


V2 = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


@pytest.mark.parametrize("kw,needle", [
    (dict(fsdp="full_shard", fsdp_config={"fsdp_version": 1}), "fsdp_version']=1 (FSDP1)"),
    (dict(fsdp="full_shard offload", fsdp_config=V2), "'offload'"),
    (dict(fsdp=True, fsdp_config={**V2, "cpu_offload": True}), "'offload'"),
    (dict(fsdp="hybrid_shard", fsdp_config=V2), "hybrid_shard (HSDP"),
    (dict(fsdp=["hybrid_shard_zero2", "auto_wrap"], fsdp_config={"fsdp_version": 1}), "hybrid_shard_zero2 (HSDP"),
    (dict(fsdp="no_shard"), "no_shard is data parallelism"),
    (dict(fsdp=True, fsdp_config={**V2, "cpu_ram_efficient_loading": True}), "cpu_ram_efficient_loading"),
    (dict(fsdp=True, fsdp_config={**V2, "activation_checkpointing": True}), "activation_checkpointing"),
    (dict(fsdp=True, fsdp_config={**V2, "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 100}),
     "SIZE_BASED_WRAP"),
    (dict(fsdp=True, fsdp_config={**V2, "state_dict_type": "SHARDED_STATE_DICT"}), "SHARDED_STATE_DICT"),
    (dict(fsdp=True, fsdp_config=V2, eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True),
     "load_best_model_at_end=True with fsdp"),
    (dict(fsdp=True, fsdp_config=V2, torch_compile=True), "torch_compile=True with fsdp"),
    (dict(fsdp=True, fsdp_config=V2, fp16=True), "fp16 mixed precision is not supported"),
])
def test_fsdp_options_the_sharded_step_cannot_honour_are_refused(kw, needle):
    with pytest.raises(InputValueError, match="TrainingArguments: ") as err:
        _args(**kw)
    assert needle in str(err.value)


def test_the_supported_fsdp_arguments_are_accepted():
    for kw in (dict(fsdp="full_shard", fsdp_config=V2), dict(fsdp=["shard_grad_op", "auto_wrap"], fsdp_config=V2),
               dict(fsdp=True, fsdp_config={"version": 2, "auto_wrap_policy": "NO_WRAP"}),
               dict(fsdp=True, fsdp_config=V2, privacy_unit="user", privacy_max_examples_per_user=2),
               dict(fsdp=True, fsdp_config=V2, save_strategy="steps", save_steps=2),  # sharded checkpoints
               dict(fsdp=True, fsdp_config=V2, bf16=True)):  # FSDP2's MixedPrecisionPolicy
        assert _args(**kw).fsdp is True


def test_fsdp_in_one_process_is_refused_before_hugging_face_builds_anything():
    args = _args(fsdp="full_shard", fsdp_config=V2)
    with pytest.raises(InputValueError, match=r"fsdp shards the model over the ranks .* this is 1 process\. "
                                              r"Launch the script with torchrun"):
        DPTrainer(model=hf.llama(), args=args, train_dataset=hf.counting_lm_data(8))


def test_a_layer_class_the_model_lacks_is_named():
    from opake_fx.transformers.sharding import layer_classes

    args = _args(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})
    with pytest.raises(InputValueError, match=r"names \['GPT2Block'\], which the model has no module of; its "
                                              r"no-split layer classes are \['LlamaDecoderLayer'\]"):
        layer_classes(hf.llama(), args)
    model = hf.gpt2_lora()  # a PEFT model: the base model's _no_split_modules
    assert [c.__name__ for c in layer_classes(model, _args(fsdp=True, fsdp_config={"version": 2}))] == ["GPT2Block"]
    assert layer_classes(model, _args(fsdp=True, fsdp_config={"version": 2, "auto_wrap_policy": "NO_WRAP"})) == ()


def test_bf16_without_fsdp_and_fp16_are_refused_naming_where_bf16_is_honoured():
    with pytest.raises(InputValueError, match=r"bf16 mixed precision is not supported by DPTrainer .*with fsdp under "
                                              r"torchrun, bf16=True is honoured"):
        _args(bf16=True)
    with pytest.raises(InputValueError, match="fp16 mixed precision is not supported"):
        _args(fp16=True, use_cpu=True)

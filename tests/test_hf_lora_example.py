"""examples/hf_lora.py (on DPTrainer) at a tiny budget: DP LoRA fine-tuning of a GPT-2 runs, learns and
spends at most its privacy budget."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.mark.slow  # ~40 s on a loaded 2-core machine (Hugging Face pre-training, PLD calibration and accounting)
def test_dp_lora_example_learns_within_its_budget():
    spec = importlib.util.spec_from_file_location("hf_lora", Path(__file__).parents[1] / "examples" / "hf_lora.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(["--private-examples", "1000", "--epochs", "2", "--batch-size", "100",
                        "--pretrain-steps", "30", "--epsilon", "4"])
    assert out["epsilon"] <= 4.0 + 1e-9
    assert out["after"] < out["before"] - 0.5  # the adapters learned the private chain
    assert out["after"] > out["floor"]  # and, of course, not beyond its entropy rate

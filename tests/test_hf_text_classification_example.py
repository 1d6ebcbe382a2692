"""examples/hf_text_classification.py at a small budget: after public pre-training, the DP fine-tuned tiny BERT
beats chance on the held-out private test split by a margin a chance-level model would almost never reach, and
spends at most its epsilon."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

N_TEST = 1000


def _example():
    path = Path(__file__).parents[1] / "examples" / "hf_text_classification.py"
    spec = importlib.util.spec_from_file_location("hf_text_classification", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_dp_finetuning_after_public_pretraining_beats_chance_within_epsilon_8():
    example = _example()
    out = example.main(["--skip-scratch", "--test-examples", str(N_TEST), "--epsilon", "8",
                        "--privacy-seed", "0"])
    assert out["pretrained_dp_epsilon"] <= 8.0 + 1e-9
    # Chance: the best constant guess on this test split. A model at chance scores a Binomial(n, p) fraction;
    # 5 standard deviations above p (one-sided tail < 3e-7) is the margin.
    assert out["test_examples"] == N_TEST
    p = out["chance"]
    margin = 5 * math.sqrt(p * (1 - p) / N_TEST)
    assert out["pretrained_dp_accuracy"] > p + margin, (out, p, margin)

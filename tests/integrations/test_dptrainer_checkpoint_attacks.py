"""DPTrainer checkpoints altered by someone who can write them (checksums recomputed) are refused on resume.

Each attack edits ``dp_state.rank0.pt`` through the public reader and writer
(``read_checkpoint`` / ``save_checkpoint``), so its SHA-256 is valid: only the consistency
checks of the resume can tell. A refused resume leaves the model as it was.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from opake_fx.errors import CheckpointError, InputValueError  # noqa: E402
from opake_fx.serialization import read_checkpoint, save_checkpoint  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=16, max_steps=6, learning_rate=1e-2,
                privacy_target_epsilon=4.0, privacy_seed=5, privacy_accountant="rdp", logging_steps=1,
                save_steps=2, **{**hf.COMMON, "save_strategy": "steps"})
    return TrainingArguments(**{**base, **kw})


def _trainer(out, callbacks=(), **kw):
    return DPTrainer(model=hf.gpt2_lora(seed=3), args=_args(out, **kw), train_dataset=hf.counting_lm_data(96),
                     callbacks=list(callbacks))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """checkpoint-2 and checkpoint-4 of a fixed-clipping run and of an adaptive-clipping run."""
    out = {}
    for name, kw in (("fixed", {}), ("adaptive", {"clipping_mode": "adaptive"})):
        directory = tmp_path_factory.mktemp(name)
        hf.quiet_train(_trainer(directory, callbacks=[hf.StopAt(4)], **kw))
        out[name] = directory
    return out


def _copy(runs, name, tmp_path):
    shutil.copytree(runs[name], tmp_path, dirs_exist_ok=True)
    return tmp_path


def _unflatten(flat):
    tree: dict = {}
    for path, value in flat.items():
        *parents, last = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def _rewrite(path, edit):
    """What anyone who can write the file can do: edit its entries and save it with a fresh checksum."""
    flats = {name: dict(flat) for name, flat in read_checkpoint(path).items()}
    edit(flats)
    save_checkpoint(path, **{name: _unflatten(flat) for name, flat in flats.items()})


def _resume(directory, checkpoint, **kw):
    trainer = _trainer(directory, **kw)
    before = hf.trainable(trainer.model)
    try:
        return hf.quiet_train(trainer, resume_from_checkpoint=str(directory / checkpoint))
    finally:
        after = hf.trainable(trainer.model)
        trainer._refused_model_unchanged = all(torch.equal(before[n], after[n]) for n in before)
        _resume.last = trainer


def _refused(directory, checkpoint, match, error=CheckpointError, **kw):
    with pytest.raises(error, match=match) as info:
        _resume(directory, checkpoint, **kw)
    assert _resume.last._refused_model_unchanged, "a refused resume changed the model"
    return str(info.value)


def test_an_intact_checkpoint_resumes(runs, tmp_path):
    d = _copy(runs, "fixed", tmp_path)
    out = _resume(d, "checkpoint-4")
    assert out.global_step == 6


def test_a_rewound_noise_step_is_refused(runs, tmp_path):
    # resumed, steps 4-5 would draw steps 0-1's noise, which cancels against the released checkpoint-4
    d = _copy(runs, "fixed", tmp_path)
    _rewrite(d / "checkpoint-4" / "dp_state.rank0.pt", lambda f: f["state"].update({"noise/step": 0}))
    _refused(d, "checkpoint-4", r"state/noise\.step is 0, the run's step is 4")


def test_an_earlier_accountant_spliced_into_a_later_checkpoint_is_refused(runs, tmp_path):
    d = _copy(runs, "fixed", tmp_path)
    early = read_checkpoint(d / "checkpoint-2" / "dp_state.rank0.pt")["accountant"]  # genuine, from step 2
    _rewrite(d / "checkpoint-4" / "dp_state.rank0.pt", lambda f: f.update(accountant=dict(early)))
    message = _refused(d, "checkpoint-4", "the accountant recorded 2 steps, the run's step is 4")
    assert "is not the plan's first 4 steps" in message


def test_adaptive_count_noise_multiplier_set_to_zero_is_refused(runs, tmp_path):
    d = _copy(runs, "adaptive", tmp_path)
    path = d / "checkpoint-4" / "dp_state.rank0.pt"
    entry = next(k for k in read_checkpoint(path)["state"] if k.endswith("count_noise_multiplier"))
    assert read_checkpoint(path)["state"][entry] > 0
    _rewrite(path, lambda f: f["state"].update({entry: 0.0}))
    _refused(d, "checkpoint-4", r"count_noise_multiplier=0\.0 \(the pipeline has", clipping_mode="adaptive")


def test_another_plan_is_refused_without_accountant_json(runs, tmp_path):
    d = _copy(runs, "fixed", tmp_path)
    (d / "checkpoint-4" / "accountant.json").unlink()  # the report is not what the check relies on
    _refused(d, "checkpoint-4", r"another privacy plan \(differs in \['noise_multiplier', 'target_epsilon'\]",
             privacy_target_epsilon=2.0)


def test_a_trainer_step_that_disagrees_is_refused(runs, tmp_path):
    d = _copy(runs, "fixed", tmp_path)
    _rewrite(d / "checkpoint-4" / "dp_state.rank0.pt", lambda f: f["meta"].update({"step": 2}))
    _refused(d, "checkpoint-4", "the trainer's step is 2, the run's step is 4")


def test_a_hugging_face_global_step_that_disagrees_is_refused(runs, tmp_path):
    d = _copy(runs, "fixed", tmp_path)
    state_file = d / "checkpoint-4" / "trainer_state.json"
    doc = json.loads(state_file.read_text())
    doc["global_step"] = 2
    state_file.write_text(json.dumps(doc))
    _refused(d, "checkpoint-4", r"trainer_state\.json has global_step=2, the DP state's step is 4")


def test_accountant_json_stays_a_report(runs, tmp_path):
    d = _copy(runs, "fixed", tmp_path)
    doc = json.loads((d / "checkpoint-4" / "accountant.json").read_text())
    assert doc["steps"] == 4 and doc["plan"]["target_epsilon"] == 4.0 and 0 < doc["epsilon"] <= 4.0


def test_a_tiny_noise_multiplier_gives_an_epsilon_or_a_clear_error_not_an_overflow(tmp_path):
    # PLD: epsilon is infinite (was: OverflowError), so there is no budget: refused before any step
    trainer = _trainer(tmp_path, privacy_target_epsilon=None, privacy_noise_multiplier=1e-8, save_strategy="no",
                       privacy_accountant="pld")
    with pytest.raises(InputValueError, match=r"noise_multiplier=1e-08.*infinite"):
        hf.quiet_train(trainer)
    assert math.isinf(trainer.privacy_plan.epsilon())
    # RDP: a finite, astronomical epsilon, reported as such
    out = hf.quiet_train(_trainer(tmp_path, privacy_target_epsilon=None, privacy_noise_multiplier=1e-8,
                                  save_strategy="no", max_steps=2))
    assert out.metrics["privacy_epsilon"] >= 1e15

"""DPTrainer with ``privacy_unit="user"``: a user-id column, user-level (ULS) or capped example-level (ELS)
sampling, every epsilon named by its unit, and the refusals."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import opake_fx.transformers.trainer as trainer_module  # noqa: E402
from opake_fx.errors import InputTypeError, InputValueError  # noqa: E402
from opake_fx.functional import make_functional  # noqa: E402
from opake_fx.random import key  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from opake_fx.users import UserIndex  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402

K = 3
HEAVY = "heavy"  # the user with many examples


def user_data(n: int = 80, heavy: int = 20, others: int = 10) -> list[dict]:
    """Right-padded LM examples; the first ``heavy`` belong to one user, the rest to ``others`` users."""
    data = hf.padded_lm_data(n)
    for i, ex in enumerate(data):
        ex["user_id"] = HEAVY if i < heavy else f"u{i % others}"
    return data


def user_args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2,
                logging_steps=3, privacy_target_epsilon=4.0, privacy_target_delta=1e-3, privacy_seed=0,
                privacy_unit="user", privacy_max_examples_per_user=K, **hf.COMMON)
    return TrainingArguments(**{**base, **kw})


class Record:
    """What the model received (its keyword arguments) and the users' groups of each step."""

    def __init__(self, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inputs: set[str] = set()
        self.groups: list[list[list[int]]] = []
        model.register_forward_pre_hook(lambda m, a, kw: self.inputs.update(kw), with_kwargs=True)
        checked = trainer_module._checked_groups

        def spy(*args, **kwargs):
            out = checked(*args, **kwargs)
            self.groups.append(out)
            return out

        monkeypatch.setattr(trainer_module, "_checked_groups", spy)


def quiet(trainer: DPTrainer, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SlowPathWarning, NOT private, Hugging Face's own
        return hf.quiet_train(trainer, **kwargs)


# --- ULS ------------------------------------------------------------------------------------


def test_uls_trains_reports_per_user_epsilon_and_the_model_never_sees_the_user_id(tmp_path, monkeypatch):
    data = user_data()
    users = UserIndex([ex["user_id"] for ex in data])
    model = hf.gpt2_lora()
    record = Record(model, monkeypatch)
    args = user_args(tmp_path, save_strategy="steps", save_steps=6)
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    out = quiet(trainer)

    plan = trainer.privacy_plan
    assert (plan.privacy_unit, plan.user_sampling, plan.max_examples_per_user) == ("user", "users", K)
    assert plan.dataset_size == users.n_users == 11 and plan.batch_size == 4.0  # users, not examples
    m = out.metrics
    assert m["privacy_unit"] == "user" and "privacy_epsilon_per_example" not in m
    assert m["privacy_epsilon"] == m["privacy_epsilon_per_user"] <= 4.0
    assert m["privacy_epsilon"] > 3.9  # calibrated for the run: the whole budget is spent
    assert out.global_step == 6 and math.isfinite(m["train_loss"])
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [3, 6]
    assert all(h["epsilon_per_user"] == h["epsilon"] and "epsilon_per_example" not in h for h in logs)
    doc = json.loads((tmp_path / "checkpoint-6" / "accountant.json").read_text())
    assert (doc["privacy_unit"], doc["epsilon_unit"]) == ("user", "per user")
    assert doc["epsilon"] == doc["epsilon_per_user"] == pytest.approx(m["privacy_epsilon"])

    # the model never receives the user-id column
    assert "user_id" not in record.inputs and "input_ids" in record.inputs
    # each group is one user's, at most k examples; the heavy user (20 examples) brings exactly k when drawn
    assert len(record.groups) == 6
    heavy = set(users.examples_of(0))
    drawn = 0
    for groups in record.groups:
        for g in groups:
            assert 1 <= len(g) <= K and len({data[i]["user_id"] for i in g}) == 1
            if set(g) <= heavy:
                assert len(g) == K
                drawn += 1
    assert drawn >= 1


def _user_mean_grads(model: torch.nn.Module, data: list[dict], groups: list[list[int]]) -> list[torch.Tensor]:
    """Each user's mean example-loss gradient (trainable parameters, flattened): each example alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for g in groups:
        loss = sum(model(**{k: v[None] for k, v in data[i].items() if k != "user_id"}).loss for i in g) / len(g)
        out.append(torch.cat([x.reshape(-1) for x in torch.autograd.grad(loss, params)]))
    return out


@pytest.mark.parametrize("memory", [{}, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
                                    {"microbatch_size": 1}], ids=["whole", "accumulation", "microbatch"])
def test_a_uls_step_is_the_sum_of_each_users_clipped_mean_gradient(tmp_path, monkeypatch, memory):
    data, clip = user_data(), 0.05
    model, reference = hf.gpt2_lora(seed=3), hf.gpt2_lora(seed=3)
    before = torch.cat([p.detach().reshape(-1).clone() for p in reference.parameters() if p.requires_grad])
    record = Record(model, monkeypatch)
    args = user_args(tmp_path, max_steps=1, privacy_target_epsilon=None, privacy_noise_multiplier=0.0,
                     clipping_norm=clip, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", **memory)
    quiet(DPTrainer(model=model, args=args, train_dataset=data))
    (groups,) = record.groups
    assert len(groups) >= 2 and any(len(g) > 1 for g in groups)  # several users, some with several examples
    grads = _user_mean_grads(reference, data, groups)
    assert all(float(g.norm()) > clip for g in grads)  # every user is clipped: the unit is what is clipped
    step = sum(g * min(1.0, clip / float(g.norm())) for g in grads) / 4.0  # / the expected users per step
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(after, before - step, atol=2e-6, rtol=0)


def test_a_uls_run_resumed_from_its_checkpoint_is_the_uninterrupted_run(tmp_path):
    data = user_data()
    whole = hf.gpt2_lora()
    quiet(DPTrainer(model=whole, args=user_args(tmp_path / "a", max_steps=4, save_strategy="steps", save_steps=2),
                    train_dataset=data))
    resumed = hf.gpt2_lora()  # the same frozen base (a LoRA checkpoint holds the adapters)
    trainer = DPTrainer(model=resumed, args=user_args(tmp_path / "b", max_steps=4), train_dataset=data)
    out = quiet(trainer, resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert out.global_step == 4 and out.metrics["privacy_unit"] == "user"
    a, b = hf.trainable(whole), hf.trainable(resumed)
    for n in a:
        torch.testing.assert_close(b[n], a[n], atol=1e-6, rtol=0)


def test_under_two_ranks_each_rank_draws_whole_users_and_no_user_is_on_both(tmp_path):
    data = user_data()
    trainer = DPTrainer(model=hf.gpt2_lora(), args=user_args(tmp_path, per_device_train_batch_size=3), train_dataset=data)
    dataset, users = trainer._training_set()
    fmodel, params = make_functional(trainer.model, trainable_only=True)
    plan = trainer._build_plan(len(dataset), 2, params, fmodel.param_names, users)
    assert plan.dataset_size == users.n_users and plan.batch_size == 6.0  # both ranks' expected users
    owner = [ex["user_id"] for ex in data]
    ranks = [trainer._sampler(plan, dataset, key(1), rank, 2, users) for rank in (0, 1)]
    seen = [set(), set()]
    for step in range(plan.steps):
        for rank, sampler in enumerate(ranks):
            for g in trainer_module._checked_groups(sampler.batch(step), users, K, step):
                seen[rank].add(owner[g[0]])
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    with pytest.raises(InputValueError, match="step 1's user groups are not whole users"):  # a group of two users
        trainer_module._checked_groups([[0, 25]], users, K, 0)
    with pytest.raises(InputValueError, match="step 3's user groups"):  # one user split into two units
        trainer_module._checked_groups([[0], [1]], users, K, 2)


# --- ELS ------------------------------------------------------------------------------------


def test_els_reports_both_units_and_keeps_at_most_k_examples_of_a_user_for_the_run(tmp_path, monkeypatch):
    data = user_data()
    users = UserIndex([ex["user_id"] for ex in data])
    model = hf.gpt2_lora()
    record = Record(model, monkeypatch)
    args = user_args(tmp_path, privacy_user_sampling="examples", per_device_train_batch_size=8,
                     save_strategy="steps", save_steps=6)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, eval_dataset=user_data(8))
    out = quiet(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.evaluate()  # Hugging Face's remove_unused_columns drops the column from evaluation batches
    plan = trainer.privacy_plan
    assert plan.user_sampling == "examples" and plan.dataset_size == users.capped_size(K) == 3 + 10 * 3
    m = out.metrics
    assert m["privacy_unit"] == "user"
    assert m["privacy_epsilon"] == m["privacy_epsilon_per_user"] <= 4.0
    assert 0 < m["privacy_epsilon_per_example"] < m["privacy_epsilon_per_user"]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(0 < h["epsilon_per_example"] < h["epsilon_per_user"] == h["epsilon"] for h in logs)
    doc = json.loads((tmp_path / "checkpoint-6" / "accountant.json").read_text())
    assert doc["epsilon_per_user"] > doc["epsilon_per_example"] > 0 and doc["privacy_unit"] == "user"
    assert "user_id" not in record.inputs and not record.groups  # example batches: no user groups
    used: dict[str, set[int]] = {}
    for step in range(plan.steps):
        for i in trainer._dp["sampler"].batch(step):
            used.setdefault(data[i]["user_id"], set()).add(i)
    assert len(used[HEAVY]) <= K and all(len(v) <= K for v in used.values())


# --- example-level runs: the same metrics, plus the unit ------------------------------------


def test_an_example_level_run_keeps_its_metrics_and_adds_the_unit(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3, logging_steps=3,
                             privacy_target_epsilon=4.0, privacy_seed=0, privacy_accountant="rdp",
                             **{**hf.COMMON, "save_strategy": "steps"}, save_steps=3)
    trainer = DPTrainer(model=hf.bert(), args=args, train_dataset=hf.classification_data(32))
    out = quiet(trainer)
    m = out.metrics
    assert {"train_loss", "privacy_epsilon", "privacy_delta", "privacy_noise_multiplier", "privacy_steps",
            "privacy_budget_exhausted"} <= set(m)
    assert {k for k in m if k.startswith("privacy")} == {
        "privacy_epsilon", "privacy_delta", "privacy_noise_multiplier", "privacy_steps", "privacy_budget_exhausted",
        "privacy_unit", "privacy_epsilon_per_example"}
    assert m["privacy_unit"] == "example" and m["privacy_epsilon_per_example"] == m["privacy_epsilon"] <= 4.0
    plan = trainer.privacy_plan
    assert m["privacy_epsilon"] == pytest.approx(plan.epsilon(3), rel=1e-6) and "privacy_unit" not in plan.to_dict()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert set(log) == {"loss", "learning_rate", "epsilon", "delta", "epsilon_per_example", "epoch", "step"}
    doc = json.loads((tmp_path / "checkpoint-3" / "accountant.json").read_text())
    assert (doc["privacy_unit"], doc["epsilon_unit"]) == ("example", "per example")


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, match", [
    ({"privacy_max_examples_per_user": None}, "privacy_unit='user' needs privacy_max_examples_per_user"),
    ({"privacy_unit": "example"}, "privacy_max_examples_per_user=3 applies to privacy_unit='user' only"),
    ({"privacy_unit": "example", "privacy_max_examples_per_user": None, "privacy_user_sampling": "examples"},
     "privacy_user_sampling='examples' applies to privacy_unit='user' only"),
    ({"privacy_unit": "person"}, r"privacy_unit must be one of \['example', 'user'\]"),
    ({"privacy_user_sampling": "both"}, r"privacy_user_sampling must be one of \['users', 'examples'\]"),
    ({"privacy_max_examples_per_user": 0}, "privacy_max_examples_per_user must be an int >= 1"),
    ({"sampling_mode": "cyclic_poisson", "privacy_noise_mechanism": "band_mf"}, "built for sampling_mode='poisson'"),
    ({"clip_backend": "vmap"}, "clip_backend='vmap' is not supported with privacy_unit='user'"),
    ({"torch_compile": True}, "torch_compile=True is not supported with privacy_unit='user'"),
    ({"privacy_user_sampling": "examples", "clipping_mode": "adaptive"}, "takes clipping_mode='fixed' or 'auto'"),
])
def test_bad_user_settings_are_refused_by_the_arguments(tmp_path, fields, match):
    with pytest.raises(InputValueError, match=match):
        user_args(tmp_path, **fields)


def test_from_hf_carries_the_user_fields(tmp_path):
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    args = TrainingArguments.from_hf(hf_args, privacy_target_epsilon=2.0, privacy_unit="user",
                                     privacy_max_examples_per_user=5, privacy_user_id_column="author")
    assert (args.privacy_unit, args.privacy_max_examples_per_user, args.privacy_user_id_column,
            args.privacy_user_sampling) == ("user", 5, "author", "users")
    with pytest.raises(InputValueError, match="needs privacy_max_examples_per_user"):
        TrainingArguments.from_hf(hf_args, privacy_target_epsilon=2.0, privacy_unit="user")
    # a second train() of a finished user-level run names the unit of the epsilon it reports
    trainer = DPTrainer(model=hf.gpt2_lora(), args=user_args(tmp_path, max_steps=1), train_dataset=user_data())
    quiet(trainer)
    with pytest.raises(InputValueError, match=r"run is complete: .* per user at delta"):
        quiet(trainer)


def test_a_missing_or_unusable_user_id_column_is_refused_before_anything_is_charged(tmp_path):
    model = hf.gpt2_lora()
    start = hf.trainable(model)
    for data, error, match in [
        (hf.padded_lm_data(16), InputValueError, "privacy_user_id_column='user_id', but example 0"),
        ([{**ex, "author": i % 3} for i, ex in enumerate(hf.padded_lm_data(16))], InputValueError,
         r"has no such field \(it has \['attention_mask', 'author', 'input_ids', 'labels'\]\)"),
        ([{**ex, "user_id": float(i % 3)} for i, ex in enumerate(hf.padded_lm_data(16))], InputTypeError,
         "ids must be hashable and not floats"),
        ([{**ex, "user_id": torch.tensor([i, i])} for i, ex in enumerate(hf.padded_lm_data(16))], InputTypeError,
         "give one int or string per example"),
    ]:
        trainer = DPTrainer(model=model, args=user_args(tmp_path), train_dataset=data)
        with pytest.raises(error, match=match):
            quiet(trainer)
        assert trainer.accountant is None and trainer.state.global_step == 0
    for n, p in hf.trainable(model).items():
        assert torch.equal(p, start[n])
    # a tensor id is its int: the same user whatever the tensor object
    data = [{**ex, "user_id": torch.tensor(i % 4)} for i, ex in enumerate(hf.padded_lm_data(16))]
    dataset, users = DPTrainer(model=model, args=user_args(tmp_path), train_dataset=data)._training_set()
    assert users.n_users == 4 and "user_id" not in dataset[0]


def test_the_recorded_loss_of_a_uls_run_is_the_mean_over_users_of_their_mean_example_loss(tmp_path, monkeypatch):
    """The logged loss under ULS is the objective ULS trains: each drawn user's mean example loss,
    averaged over the drawn users (not over examples)."""
    data = user_data()
    model, reference = hf.gpt2_lora(seed=4), hf.gpt2_lora(seed=4)
    record = Record(model, monkeypatch)
    args = user_args(tmp_path, max_steps=1, logging_steps=1)
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    quiet(trainer)
    (groups,) = record.groups
    with torch.no_grad():
        per_user = [sum(float(reference(**{k: v[None] for k, v in data[i].items() if k != "user_id"}).loss)
                        for i in g) / len(g) for g in groups]
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["loss"] == pytest.approx(sum(per_user) / len(per_user), rel=1e-5)


def test_empty_uls_steps_are_normal_steps_and_log_the_first_users_loss(tmp_path, monkeypatch):
    """privacy_seed=4 draws no user at steps 1 and 2: the steps are taken (noise only), and the loss
    logged before any user was drawn is the first users' (each their first k examples), averaged per user."""
    data = user_data()
    users = UserIndex([ex["user_id"] for ex in data])
    model, reference = hf.gpt2_lora(seed=5), hf.gpt2_lora(seed=5)
    record = Record(model, monkeypatch)
    args = user_args(tmp_path, per_device_train_batch_size=1, max_steps=4, logging_steps=1, privacy_seed=4)
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    out = quiet(trainer)
    assert [len(g) for g in record.groups] == [0, 0, 1, 1] and out.global_step == 4
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2, 3, 4] and all(math.isfinite(h["loss"]) for h in logs)
    first = [users.examples_of(u)[:K] for u in range(8)]
    with torch.no_grad():
        per_user = [sum(float(reference(**{k: v[None] for k, v in data[i].items() if k != "user_id"}).loss)
                        for i in g) / len(g) for g in first]
    assert logs[0]["loss"] == pytest.approx(sum(per_user) / len(per_user), rel=1e-5)
    assert out.metrics["privacy_epsilon_per_user"] <= 4.0

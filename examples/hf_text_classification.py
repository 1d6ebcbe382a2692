"""Private text classification with a tiny BERT and ``DPTrainer``: from scratch, and after public pre-training.

A generated task (nothing is downloaded): sequences of 16 random tokens from a 64-token
vocabulary, token 1 first (a [CLS]); a PRIVATE sequence is positive when it holds one of
four keywords (ids 2..5). The script trains a tiny BERT (built from a config) three ways
and reports the accuracy on a held-out private test split and the epsilon spent:

1. ``[non-private]``: Hugging Face's ``Trainer`` on the private data, from scratch.
2. ``[private, scratch]``: ``opake_fx.transformers.DPTrainer`` on the same data, from
   scratch (the same code; the arguments gain the DP fields).
3. ``[private, pretrained]``: the recipe of private learning in practice. The BERT is
   first pre-trained WITHOUT privacy on PUBLIC data: another generator seed and a related
   but different distribution and task (background tokens drawn from a skewed, not a
   uniform, distribution over ids 10..63; a 9-way label: which of EIGHT keywords, ids
   2..9, the sequence holds, or none). Then a fresh 2-way head is put on the public
   encoder and ``DPTrainer`` fine-tunes only part of the model (``--trainable``: the
   head, the head + last layer, or all) on the private data, at the same epsilon. Public
   and private data share no example (different seeds and distributions); the test split
   is private and never trained on.

The private task is not the public one: in the private data ids 6..9 are ordinary
background tokens (most private negatives hold one), so the private fine-tuning has to
learn which keywords count. Few trainable parameters and public features are what beat
DP's noise here: the gradient signal is the same, but the noise (one draw per trainable
parameter) is spread over far fewer directions.

    python examples/hf_text_classification.py                  # epsilon 8
    python examples/hf_text_classification.py --epsilon 3 --trainable top

Needs the ``hf`` extra (transformers).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time

import numpy as np
import torch

VOCAB, SEQ = 64, 16
PRIVATE_KEYWORDS = range(2, 6)  # the private task: does the sequence hold one of these?
PUBLIC_KEYWORDS = range(2, 10)  # the public task: which of these does it hold (or none)?


def make_private_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Uniform background over ids 6..63; label 1 iff one private keyword (ids 2..5) is inserted."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(PRIVATE_KEYWORDS.stop, VOCAB, (n, SEQ), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    where = torch.randint(1, SEQ, (n,), generator=g)
    word = torch.randint(PRIVATE_KEYWORDS.start, PRIVATE_KEYWORDS.stop, (n,), generator=g)
    ids[labels == 1, where[labels == 1]] = word[labels == 1]  # a positive sequence holds one keyword
    ids[:, 0] = 1  # a [CLS]-like first token
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]


def make_public_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Skewed background over ids 10..63; each public keyword (ids 2..9) present with probability 0.3.

    The label is multi-label: one 0/1 entry per public keyword (does the sequence hold it?).
    """
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(VOCAB - PUBLIC_KEYWORDS.stop, generator=g) ** 3 + 0.01  # a skewed background
    ids = PUBLIC_KEYWORDS.stop + torch.multinomial(weights, n * SEQ, replacement=True, generator=g).view(n, SEQ)
    labels = (torch.rand(n, len(PUBLIC_KEYWORDS), generator=g) < 0.3).float()
    where = 1 + torch.argsort(torch.rand(n, SEQ - 1, generator=g), dim=1)[:, : len(PUBLIC_KEYWORDS)]
    for k, word in enumerate(PUBLIC_KEYWORDS):  # keyword k at its own (distinct) random position
        rows = labels[:, k] == 1
        ids[rows, where[rows, k]] = word
    ids[:, 0] = 1
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]


def build_bert(seed: int, num_labels: int = 2, problem_type: str | None = None):
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=SEQ, num_labels=num_labels,
                                     problem_type=problem_type, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def private_model_from(public_model, seed: int, trainable: str):
    """A 2-way classifier on the public model's encoder (a fresh head); freeze all but ``trainable``."""
    model = build_bert(seed, num_labels=2)
    model.bert.load_state_dict(public_model.bert.state_dict())
    last = f"bert.encoder.layer.{model.config.num_hidden_layers - 1}."
    keep = {"head": ("classifier.", "bert.pooler."), "top": ("classifier.", "bert.pooler.", last),
            "all": ("",)}[trainable]
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(keep))
    return model


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}


def multi_label_accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float(((prediction.predictions > 0) == (prediction.label_ids > 0.5)).mean())}


def run(trainer_cls, args_cls, model, train, test, out_dir: str, seed: int, metric=accuracy,
        **fields) -> tuple[float, dict]:
    """One training run and its test accuracy: the same code for the private and the non-private runs."""
    args = args_cls(output_dir=out_dir, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
                    per_device_eval_batch_size=512, logging_steps=20, seed=seed, **fields)
    trainer = trainer_cls(model=model, args=args, train_dataset=train, eval_dataset=test, compute_metrics=metric)
    with contextlib.redirect_stdout(io.StringIO()):
        result = trainer.train()
        metrics = trainer.evaluate()
    return metrics["eval_accuracy"], result.metrics


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--epochs", type=float, default=10.0, help="expected passes over the private data")
    parser.add_argument("--batch-size", type=int, default=512, help="expected (Poisson) private batch size")
    parser.add_argument("--train-examples", type=int, default=8000, help="private training examples")
    parser.add_argument("--test-examples", type=int, default=2000, help="private test examples")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate of the from-scratch runs")
    parser.add_argument("--finetune-lr", type=float, default=1e-2, help="learning rate of the private fine-tuning")
    parser.add_argument("--trainable", choices=("head", "top", "all"), default="head",
                        help="what the private fine-tuning trains: head (pooler + classifier), top (+ last layer), all")
    parser.add_argument("--public-examples", type=int, default=20000)
    parser.add_argument("--public-epochs", type=float, default=3.0)
    parser.add_argument("--public-lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-scratch", action="store_true", help="only the public-pretraining recipe")
    a = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    import transformers

    import opake_fx.transformers as dp

    train, test = make_private_data(a.train_examples, seed=1), make_private_data(a.test_examples, seed=2)
    public = make_public_data(a.public_examples, seed=3)
    out = tempfile.mkdtemp(prefix="hf_text_classification_")
    common = dict(per_device_train_batch_size=a.batch_size, num_train_epochs=a.epochs, lr_scheduler_type="constant")
    dp_fields = dict(privacy_target_epsilon=a.epsilon, clipping_norm=a.clip)
    result: dict[str, float] = {}

    def report(tag: str, acc: float, seconds: float, m: dict | None) -> None:
        line = f"{tag:<22} test accuracy {acc:.3f} ({seconds:.0f}s)"
        if m is not None:
            line += (f", epsilon {m['privacy_epsilon']:.3f} at delta {m['privacy_delta']:.2g}, noise multiplier "
                     f"{m['privacy_noise_multiplier']:.3f}, {m['privacy_steps']} steps")
        print(line)

    if not a.skip_scratch:
        t0 = time.perf_counter()
        acc, _ = run(transformers.Trainer, transformers.TrainingArguments, build_bert(a.seed), train, test,
                     out + "/plain", a.seed, learning_rate=a.lr, **common)
        report("[non-private]", acc, time.perf_counter() - t0, None)
        result["plain_accuracy"] = acc
        t0 = time.perf_counter()
        acc, m = run(dp.DPTrainer, dp.TrainingArguments, build_bert(a.seed), train, test, out + "/dp", a.seed,
                     learning_rate=a.lr, **common, **dp_fields)
        report("[private, scratch]", acc, time.perf_counter() - t0, m)
        result.update(dp_accuracy=acc, dp_epsilon=m["privacy_epsilon"])

    t0 = time.perf_counter()
    public_model = build_bert(a.seed, num_labels=len(PUBLIC_KEYWORDS), problem_type="multi_label_classification")
    public_acc, _ = run(transformers.Trainer, transformers.TrainingArguments, public_model, public,
                        make_public_data(2000, seed=4), out + "/public", a.seed, multi_label_accuracy, per_device_train_batch_size=128,
                        num_train_epochs=a.public_epochs, learning_rate=a.public_lr)
    pre_seconds = time.perf_counter() - t0
    model = private_model_from(public_model, a.seed + 1, a.trainable)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    acc, m = run(dp.DPTrainer, dp.TrainingArguments, model, train, test, out + "/dp_pretrained", a.seed,
                 learning_rate=a.finetune_lr, **common, **dp_fields)
    print(f"[public pre-training]  public test accuracy (per keyword) {public_acc:.3f} ({pre_seconds:.0f}s); private "
          f"fine-tuning trains {a.trainable!r}: {n_trainable} of {n_total} parameters")
    report("[private, pretrained]", acc, time.perf_counter() - t0, m)
    result.update(pretrained_dp_accuracy=acc, pretrained_dp_epsilon=m["privacy_epsilon"], public_accuracy=public_acc)
    return result


if __name__ == "__main__":
    main()

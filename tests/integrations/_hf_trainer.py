"""Tiny Hugging Face models and data sets for the DPTrainer tests (configs only, nothing downloaded)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch

import transformers
import peft

VOCAB, T = 32, 10


def gpt2(n_embd: int = 16) -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=n_embd, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_lora(seed: int = 0, n_embd: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                           lora_dropout=0.0)
    model = peft.get_peft_model(gpt2(n_embd), lora)
    with torch.no_grad():  # LoRA's B starts at zero: make the adapters nonzero so they matter from step 1
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model


def llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def bert(seed: int = 0, num_labels: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=T, num_labels=num_labels,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def counting_lm_data(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Sequences ``s, s+1, s+2, ... (mod VOCAB)``: learnable from one token of context."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(T)) % VOCAB
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def padded_lm_data(n: int, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """Right-padded sequences of random lengths, labels -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(T // 2, T + 1, (1,), generator=g))
        ids = torch.zeros(T, dtype=torch.int64)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = (torch.arange(T) < length).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def classification_data(n: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """Label 1 iff token 1 appears in the sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, T), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    ids[labels == 1, 3] = 1
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]


def quiet_train(trainer: Any, **kwargs: Any) -> Any:
    """``trainer.train(**kwargs)`` without Hugging Face's printed logs."""
    with contextlib.redirect_stdout(io.StringIO()):
        return trainer.train(**kwargs)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


COMMON = dict(report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True, dataloader_num_workers=0)


def t5(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                                num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg)


def copy_seq2seq_data(n: int, seed: int = 4) -> list[dict[str, torch.Tensor]]:
    """Source ``x``, target ``x`` reversed (labels; no padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, 6), generator=g)
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.flip(0)} for x in ids]


class StopAt(transformers.TrainerCallback):
    """Ends the run after step ``n`` (as a kill right after the checkpoint of step ``n`` would)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_training_stop = True
        return control


def variable_lm_data(n: int, seed: int = 5, min_len: int = 2, labels: bool = True) -> list[dict[str, torch.Tensor]]:
    """Unpadded token sequences of random lengths in ``[min_len, T]`` (``labels`` = the inputs, if asked)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (int(torch.randint(min_len, T + 1, (1,), generator=g)),), generator=g)
        out.append({"input_ids": ids, **({"labels": ids.clone()} if labels else {})})
    return out


class PadCollator:
    """Pads a list of unpadded examples to the longest of the batch on ``side``: pad token 0,
    ``attention_mask`` 0 and label -100 on the padding (as a tokenizer's padding does)."""

    def __init__(self, side: str) -> None:
        self.side = side

    def __call__(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(len(ex["input_ids"]) for ex in examples)
        out: dict[str, list[torch.Tensor]] = {"input_ids": [], "attention_mask": []}
        for ex in examples:
            n = len(ex["input_ids"])
            rows = {"input_ids": (ex["input_ids"], 0), "attention_mask": (torch.ones(n, dtype=torch.int64), 0)}
            if "labels" in ex and ex["labels"].dim() == 1:  # token labels; a sequence label is stacked as it is
                rows["labels"] = (ex["labels"], -100)
            elif "labels" in ex:
                out.setdefault("labels", []).append(ex["labels"])
            for k, (v, fill) in rows.items():
                pad = torch.full((width - n,), fill, dtype=v.dtype)
                out.setdefault(k, []).append(torch.cat([pad, v] if self.side == "left" else [v, pad]))
        return {k: torch.stack(v) for k, v in out.items()}

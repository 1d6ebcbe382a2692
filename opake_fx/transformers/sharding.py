"""FSDP2 sharding of a ``DPTrainer``'s model from Hugging Face's own ``fsdp`` arguments.

``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap":
[...]})`` (or the legacy ``fsdp="full_shard"`` / ``["full_shard", "auto_wrap"]``) under
``torchrun`` makes ``DPTrainer`` shard the model with ``torch.distributed.fsdp.fully_shard``
when it is constructed: every module of the named layer classes (default: the model's
``_no_split_modules``, as Hugging Face's own FSDP does), then the root, over the 1-D mesh
of all ranks. The DP step then runs through
:func:`opake_fx.distributed.fsdp.make_functional_fsdp` and ``DPPlan.pipeline(model=fmodel)``
(gather, clip each rank's examples, reduce-scatter, noise this rank's rows of the unsharded
noise, update the local shards), never through FSDP's own backward and gradient reduction.
The options that step cannot honour are refused by ``TrainingArguments`` (see
``docs/huggingface.md``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from opake_fx.errors import CheckpointError, InputValueError

__all__ = ["shard_model", "layer_classes", "load_frozen_weights"]

# the full-model weight files Hugging Face's save_pretrained writes (save_model of a sharded model writes them too)
_FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def shard_model(model: nn.Module, args: Any) -> nn.Module:
    """Shards ``model`` in place with FSDP2 as ``args`` (Hugging Face's ``fsdp`` fields) ask.

    Each module whose class is one of :func:`layer_classes` becomes its own FSDP group
    (``reshard_after_forward`` from ``fsdp_config``: ``"full_shard"`` reshards after the
    forward, ``"shard_grad_op"`` keeps the gathered layer), then the root holds the rest
    (embeddings, final norm, head: a tied head stays in one group with its embedding).
    With ``args.bf16`` every group gets ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``:
    the DP step computes in bfloat16 and keeps norms, sums, noise and parameters float32.
    ``auto_wrap_policy="NO_WRAP"`` shards the root only. A model that is already sharded
    with ``fully_shard`` is returned as it is.

    Args:
        model: the trainer's model (a ``PreTrainedModel`` or a PEFT model around one), the
            same initial weights on every rank.
        args: :class:`opake_fx.transformers.TrainingArguments` with ``fsdp`` on (already
            checked: FSDP2, no offload, full state dicts).

    Returns:
        ``model``, its parameters now ``DTensor`` s sharded on their first axis over all ranks.

    Raises:
        InputValueError: a class of ``transformer_layer_cls_to_wrap`` that the model does not have.

    Privacy: none (placement only; which rank holds which rows changes no value the DP
    step computes, releases or accounts).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from opake_fx.distributed.fsdp import is_fsdp_model

    if is_fsdp_model(model):
        return model
    mesh = init_device_mesh(args.device.type, (dist.get_world_size(),))
    plugin = args.fsdp_plugin_args or {}
    reshard = bool(plugin.get("reshard_after_forward", True))
    classes = layer_classes(model, args)
    # bf16=True: bf16 compute; the sharded DP step keeps the clipped sums, the noise and the parameters float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None)
    if classes:
        for module in list(model.modules()):
            if module is not model and isinstance(module, classes):
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def layer_classes(model: nn.Module, args: Any) -> tuple[type, ...]:
    """The module classes that :func:`shard_model` gives a group each.

    ``fsdp_config["transformer_layer_cls_to_wrap"]`` (class names) if given, else the
    names in the model's ``_no_split_modules`` that it has (Hugging Face's default); none
    with ``auto_wrap_policy="NO_WRAP"``.

    Raises:
        InputValueError: a name in ``transformer_layer_cls_to_wrap`` that is no module class of the model.

    Example:
        >>> import transformers
        >>> from opake_fx.transformers import TrainingArguments
        >>> cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...                                num_attention_heads=2, num_key_value_heads=1)
        >>> args = TrainingArguments(output_dir="/tmp/opake-doc", privacy_target_epsilon=8.0, report_to="none")
        >>> [c.__name__ for c in layer_classes(transformers.LlamaForCausalLM(cfg), args)]
        ['LlamaDecoderLayer']
    """
    config = getattr(args, "fsdp_config", None) or {}
    if (getattr(args, "fsdp_plugin_args", None) or {}).get("auto_wrap_policy") == "NO_WRAP":
        return ()
    by_name: dict[str, type] = {}
    for m in model.modules():  # the whole MRO: fully_shard makes a sharded module's class FSDP<Name>(<Name>)
        for cls in type(m).__mro__:
            by_name.setdefault(cls.__name__, cls)
    named = config.get("transformer_layer_cls_to_wrap")
    if named is not None:
        missing = [n for n in named if n not in by_name]
        if missing:
            raise InputValueError(
                f"DPTrainer: fsdp_config['transformer_layer_cls_to_wrap'] names {missing}, which the model has no "
                f"module of; its no-split layer classes are {_no_split(model)}. Name the model's decoder (or encoder) "
                "layer class, e.g. ['LlamaDecoderLayer'], or leave the key out to use the model's own."
            )
        return tuple(by_name[n] for n in named)
    return tuple(by_name[n] for n in _no_split(model) if n in by_name)


def load_frozen_weights(model: nn.Module, directory: str) -> None:
    """Copies the frozen parameters (``requires_grad=False``) of a sharded ``model`` from a checkpoint's full weights.

    A ``DPTrainer`` resuming under ``fsdp`` takes the trained parameters from the sharded
    DP state (``dp_state/``); the frozen ones are what Hugging Face's resume would load
    from the weights ``save_model`` wrote: ``model.safetensors`` (or its index, or
    ``pytorch_model.bin``) of a full model, each rank keeping its rows. An adapter
    checkpoint (``adapter_model.*``) holds no frozen parameter: the base is the model's
    own, as with Hugging Face's resume of a PEFT model. Every rank calls it together; a
    refusal is raised on every rank, and nothing is copied unless every tensor was read.

    Args:
        model: the ``fully_shard`` ed model (its parameters ``DTensor`` s).
        directory: a checkpoint directory (``checkpoint-N``).

    Raises:
        CheckpointError: the model has frozen parameters and the directory has no weights
            file, or the full weights lack one of them or give it another shape.

    Privacy: none (frozen parameters are not trained; the released ones are in the DP state).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    from opake_fx.serialization import refuse_together

    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    error, values = None, {}
    try:
        values = _read_full_weights(directory, frozen) if frozen else {}
    except CheckpointError as exc:
        error = exc
    refuse_together(error, directory)
    with torch.no_grad():
        for name, full in values.items():
            p = frozen[name]
            if isinstance(p, DTensor):  # this rank's rows of the full tensor, sliced locally (no collective)
                full = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)


def _read_full_weights(directory: str, wanted: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``{name: full tensor}`` for the ``wanted`` parameters from the checkpoint's full-model weights (``{}`` for an adapter checkpoint)."""
    present = [name for name in _FULL_WEIGHTS if os.path.isfile(os.path.join(directory, name))]
    if not present:
        if any(os.path.isfile(os.path.join(directory, name)) for name in _ADAPTER_WEIGHTS):
            return {}
        raise CheckpointError(
            f"DPTrainer: {directory} has no model weights ({', '.join(_FULL_WEIGHTS + _ADAPTER_WEIGHTS)}), and the "
            f"model has {len(wanted)} frozen parameter(s) (e.g. {next(iter(wanted))}) that the DP state does not hold. "
            "Resume from a complete DPTrainer checkpoint (save_model writes the weights into each checkpoint)."
        )
    found: dict[str, torch.Tensor] = {}
    source = os.path.join(directory, present[0])
    try:
        if present[0] == "pytorch_model.bin":
            state = torch.load(source, map_location="cpu", weights_only=True)
            found = {n: state[n] for n in wanted if n in state}
        else:
            from safetensors import safe_open

            if present[0].endswith(".index.json"):
                with open(source) as f:
                    files = json.load(f)["weight_map"]
            else:
                files = dict.fromkeys(wanted, present[0])
            for name in wanted:
                if name not in files:
                    continue
                with safe_open(os.path.join(directory, files[name]), framework="pt", device="cpu") as f:
                    if name in f.keys():
                        found[name] = f.get_tensor(name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"DPTrainer: cannot read the model weights {source} ({type(exc).__name__}: {exc}).") from None
    missing = sorted(set(wanted) - set(found))
    wrong = sorted(n for n, t in found.items() if tuple(t.shape) != tuple(wanted[n].shape))
    if missing or wrong:
        raise CheckpointError(
            f"DPTrainer: {source} does not hold the model's frozen parameters"
            + (f"; missing: {missing[:5]}" if missing else "") + (f"; other shapes: {wrong[:5]}" if wrong else "")
            + ". The checkpoint is of another model: resume with the model it was saved from."
        )
    return found


def _no_split(model: nn.Module) -> list[str]:
    """The model's ``_no_split_modules`` (a PEFT model's: its base model's)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(getattr(inner, "_no_split_modules", None) or [])

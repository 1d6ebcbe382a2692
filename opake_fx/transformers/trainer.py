"""``DPTrainer``: a ``transformers.Trainer`` whose ``train()`` is a DP-SGD / DP-FTRL run.

Change the two imports of a Trainer script and add the DP fields::

    -from transformers import Trainer, TrainingArguments
    +from opake_fx.transformers import DPTrainer as Trainer, TrainingArguments

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=64, num_train_epochs=3,
                             privacy_target_epsilon=8.0)          # + the DP fields

``train()`` builds one :class:`opake_fx.plan.DPPlan` from the arguments and the training
set, draws the batches with the plan's sampler, computes the clipped per-example
gradients of the trainable parameters, sums them over ranks, adds the plan's noise, steps
a functional optimizer, writes the parameters back into the model, and charges the plan's
accountant; everything else (evaluation, callbacks, logging, ``save_model``, checkpoint
rotation) is Hugging Face's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import transformers
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

from opake_fx.compiled import compile_step
from opake_fx.distributed import all_reduce, get_rank, get_world_size, is_distributed
from opake_fx.distributed.fsdp import FSDPFunctionalModel, FSDPStepState, is_fsdp_model, make_functional_fsdp
from opake_fx.errors import BudgetExceededError, InputTypeError, InputValueError
from opake_fx.functional import FunctionalModel, make_functional, with_batch_dim
from opake_fx.plan import DPPlan, per_group_by_regex
from opake_fx.random import fold_in, key
from opake_fx.transforms import apply_updates
from opake_fx.transformers import checkpoint as ckpt
from opake_fx.transformers.arguments import TrainingArguments, check_max_grad_norm
from opake_fx.transformers.losses import check_model, check_padding_invariance, per_example_loss_fn
from opake_fx.transformers.optim import optimizer_from_args
from opake_fx.transformers.sharding import load_frozen_weights, shard_model
from opake_fx.users import UserIndex, collate_users

__all__ = ["DPTrainer", "UNBOUNDED_CLIP"]

logger = logging.getLogger(__name__)

UNBOUNDED_CLIP = 1e30
"""The clip norm that stands for ``clipping_norm=math.inf`` (non-private baseline only): no
gradient reaches it, so nothing is clipped, and it stays finite in float32 arithmetic."""

TRAINER_STATE_NAME = ckpt.TRAINER_STATE_NAME


class DPTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains with differential privacy.

    The constructor is Hugging Face's, plus ``per_example_loss_func``; ``args`` must be
    :class:`opake_fx.transformers.TrainingArguments` (convert existing ones with
    ``TrainingArguments.from_hf``).

    Args:
        *args, **kwargs: those of ``transformers.Trainer``. ``optimizers`` and
            ``compute_loss_func`` are refused: the optimizer is functional (from
            ``args.optim``), and a loss averaged over the batch cannot be clipped per example.
        per_example_loss_func: ``f(outputs, batch) -> [B]``, one loss per example, for a
            model whose task DPTrainer does not know (it knows causal LMs, seq2seq LMs,
            sequence and token classifiers). ``outputs`` is the model's output on the
            batch without its labels.

    Attributes:
        privacy_plan: the :class:`~opake_fx.plan.DPPlan` of the run.
        accountant: its accountant (``None`` for the non-private baseline).

    One trainer, one run, one budget: a second ``train()`` on a run that stopped early (a
    callback's ``should_training_stop``, an interrupt, an error) continues it from where
    it stopped, with the same plan, accountant, noise and batches, and never takes more
    than the plan's steps or spends past its target; once the run has taken all its steps
    or spent its budget, a second ``train()`` is an error (a fresh budget on a model that
    already depends on the data would under-report epsilon). ``resume_from_checkpoint``
    continues the run saved in a checkpoint instead.

    ``train()`` logs ``loss``, ``epsilon`` and ``delta`` whenever Hugging Face's control asks
    for a log (``logging_steps``, a callback) and at the run's end, stops when the next step
    would exceed the budget, and adds ``train_loss``, ``privacy_epsilon``, ``privacy_delta``
    and ``privacy_noise_multiplier`` to the final metrics. The logged ``loss`` is the mean
    per-example loss of the logged step's batch (all ranks, every gradient-accumulation
    chunk, padding rows left out) that the clipping pass itself computed, at the parameters
    the step was computed at: logging adds no forward pass. A step whose batch is empty logs
    the loss of the most recent step that had examples (each rank's; only before any example
    was drawn is the loss of the first training examples computed for it); never ``nan``;
    NOT private, like any training loss.

    Where Hugging Face's ``Trainer`` and DPTrainer meet: weight decay applies to the
    parameters of ``get_decay_parameter_names`` only (Hugging Face's split: not biases, not
    norm weights); ``max_grad_norm`` (Hugging Face's clip of the summed gradient) is not
    applied, per-example clipping to ``clipping_norm`` replaces it, and a value other than
    its default ``1.0`` or ``0`` / ``None`` is refused at construction. Each checkpoint also holds ``accountant.json`` and
    ``dp_state.rank{r}.pt`` (parameters, clip/noise/optimizer state, sampler position,
    accountant, privacy seed; under ``fsdp`` the sharded directory ``dp_state/``) next to Hugging Face's ``rng_state*.pth``;
    ``train(resume_from_checkpoint=...)`` continues the run exactly, dropout included.

    User-level DP (``privacy_unit="user"``, ``privacy_max_examples_per_user=k``): each example's
    user id is read once from ``privacy_user_id_column`` (a ``datasets.Dataset`` column or
    each example's dict key; an error naming the column if it is missing) and removed from
    the model's inputs; the plan counts users. With ``privacy_user_sampling="users"`` (ULS)
    the sampler draws users (whole users per rank under ``torchrun``, never re-sharded
    here) with up to ``k`` examples each; the step's examples are collated as one flat
    batch by the data collator, stacked into user blocks ``[U, k, ...]`` with a mask, and
    each user's mean example loss is clipped as one unit; a step whose groups are not
    whole users' is refused; the logged ``loss`` is the mean over the step's users of their
    mean example loss. With ``"examples"`` (ELS) the batches are example batches over the
    examples a per-user cap of ``k`` keeps, and the per-user epsilon is the group-privacy
    conversion of the per-example one. ``torch_compile`` and ``clip_backend="vmap"`` are
    refused with ULS. Every epsilon names its unit: the final metrics hold
    ``privacy_epsilon`` (in the plan's unit), ``privacy_unit`` (``"example"`` / ``"user"``)
    and ``privacy_epsilon_per_example`` and/or ``privacy_epsilon_per_user`` (both for ELS);
    the logs ``epsilon_per_example`` / ``epsilon_per_user`` next to ``epsilon``; and
    ``accountant.json`` the unit.

    Sharded training: with Hugging Face's FSDP2 arguments (``fsdp=True`` / ``"full_shard"``,
    ``fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": [...]}``, under
    ``torchrun``) the constructor shards the model with ``fully_shard``
    (:func:`opake_fx.transformers.sharding.shard_model`: each layer of those classes, then
    the root) and ``train()`` runs the sharded DP step
    (:func:`opake_fx.distributed.fsdp.make_functional_fsdp` and ``DPPlan.pipeline(model=fmodel)``:
    gather, clip each rank's examples, reduce-scatter, this rank's rows of the unsharded noise,
    local shard updates), never FSDP's own backward; the parameters equal the data-parallel
    run's up to float summation order (``tests/integrations/test_dptrainer_fsdp.py``).
    ``evaluate`` reshards the model after its forward; ``save_model`` (on every rank) gathers
    the full state dict and the main process writes it. Its checkpoints (every rank saves
    together) hold the full weights and, instead of ``dp_state.rank{r}.pt``, ONE directory
    ``dp_state/`` (:mod:`opake_fx.distributed.fsdp_checkpoint`: the parameters and the
    optimizer's shards through ``torch.distributed.checkpoint``, each rank's run file, written
    atomically); ``train(resume_from_checkpoint=...)`` with the same ``fsdp`` arguments on the
    same number of ranks continues the run bit for bit, with every check of the unsharded
    resume, and refuses on every rank (``CheckpointError``) another number of ranks or a
    checkpoint of the other layout (``tests/integrations/test_dptrainer_fsdp_resume.py``; see
    :meth:`~opake_fx.transformers.TrainingArguments.check_fsdp_fields` for every refused option).

    ``torch_compile=True`` (Hugging Face's own flag; ``torch_compile_mode`` too) compiles
    the DP step -- clip, noise, optimizer update -- with :func:`opake_fx.compiled.compile_step`
    (the model is not compiled separately): the Poisson batches are padded to the plan's
    :meth:`~opake_fx.plan.DPPlan.padding_buckets` and the padding is masked out of the clip,
    so the parameters are those of the eager step (``tests/integrations/test_dptrainer_compile.py``).
    With dropout, compiled code draws its masks from the compiler's own generator, so a
    compiled run with dropout is not the eager run bit for bit (it is as private).

    Privacy contract: only the trainable parameters (``requires_grad``; the adapters of a
    PEFT model) are clipped, noised and released; each example's loss depends on that
    example only; the batches come from the plan's sampler (each rank its disjoint shard,
    ``fold_in(key, rank)``), the clipped gradients are summed over ranks and the same
    noise is added on every rank; the accountant charges the plan's cost for every step
    taken, so the logged epsilon is the run's. Under ``fsdp`` the clipped sums are
    reduce-scattered instead of summed whole, and each coordinate's noise is drawn once, by
    the rank that holds it, from the same key as the unsharded draw: the same mechanism and
    the same accounting. A sharded checkpoint holds the noise keys as the unsharded one does
    (keep it as private as the data); a resume continues the noise after the saved step with
    every step taken still charged, and one that cannot (another number of ranks, whose
    sampler shards would differ) is refused. With ``privacy_unit="user"`` the unit of all
    of this is the user of ``privacy_user_id_column``: ULS clips each drawn user's mean
    gradient (at most ``k`` examples) as one unit and shards whole users over ranks; ELS
    clips examples of a run capped at ``k`` per user and reports the per-user epsilon by
    group privacy.

    Example:
        >>> import contextlib, io, torch, transformers
        >>> from opake_fx.transformers import DPTrainer, TrainingArguments
        >>> cfg = transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...                               intermediate_size=8, max_position_embeddings=8, num_labels=2)
        >>> data = [{"input_ids": torch.randint(0, 20, (6,)), "labels": torch.tensor(i % 2)} for i in range(64)]
        >>> args = TrainingArguments(output_dir="/tmp/opake-doc", per_device_train_batch_size=16, max_steps=4,
        ...                          privacy_target_epsilon=8.0, privacy_seed=0, report_to="none",
        ...                          save_strategy="no", logging_steps=2, disable_tqdm=True)
        >>> trainer = DPTrainer(model=transformers.BertForSequenceClassification(cfg), args=args, train_dataset=data)
        >>> with contextlib.redirect_stdout(io.StringIO()):  # Hugging Face prints the logs
        ...     out = trainer.train()
        >>> 0 < out.metrics["privacy_epsilon"] <= 8.0, out.global_step
        (True, 4)
    """

    def __init__(self, *args: Any, per_example_loss_func: Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
                 **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if isinstance(training_args, TrainingArguments):  # before Hugging Face seeds or creates anything
            check_max_grad_norm(training_args.max_grad_norm, "DPTrainer")
            _check_fsdp_world(training_args)
        super().__init__(*args, **kwargs)
        if isinstance(self.args, TrainingArguments) and self.args.fsdp and self.model is not None:
            shard_model(self.model, self.args)  # in place: evaluation and save_model see the sharded model too
        self.per_example_loss_func = per_example_loss_func
        self.privacy_plan: DPPlan | None = None
        self.accountant: Any = None
        self._dp: dict[str, Any] = {}

    # --- the private training loop -----------------------------------------------------

    def train(  # type: ignore[override]
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Trains with DP; see the class docstring. Arguments as ``transformers.Trainer.train``.

        Before anything is charged, the loss runs on the first examples of the training set
        (no gradient, eval mode): a ``per_example_loss_func`` must return shape ``[B]``, and
        an example's loss must not change with its batch's padding (left padding works: the
        position ids count from each example's first token; a model or loss for which it
        does not is refused). In one process the first padded training batch is checked too.

        Raises:
            InputTypeError / InputValueError: arguments, model, loss or dataset that cannot be
                trained privately or exactly (the message names the setting to change); a
                second ``train()`` once the run is complete, or under arguments that make
                another plan.
            CheckpointError: a checkpoint that does not hold a DP state fitting this run.
        """
        if kwargs:
            raise InputValueError(f"DPTrainer.train got unexpected arguments {sorted(kwargs)}.")
        if trial is not None:
            raise InputValueError("DPTrainer does not support hyperparameter search trials: each trial spends privacy.")
        args = self.args
        if not isinstance(args, TrainingArguments):
            raise InputTypeError(
                "DPTrainer needs opake_fx.transformers.TrainingArguments (the DP fields); got "
                f"{type(args).__module__}.{type(args).__name__}. Convert with TrainingArguments.from_hf(args, "
                "privacy_target_epsilon=...)."
            )
        self._refuse_unsupported()
        if isinstance(resume_from_checkpoint, bool):
            resume_from_checkpoint = get_last_checkpoint(args.output_dir) if resume_from_checkpoint else None
            if resume_from_checkpoint is None:
                raise InputValueError(f"DPTrainer: train(resume_from_checkpoint=True) found no checkpoint in {args.output_dir}.")
        # a run that has taken (or been charged for) a step is continued, never restarted on a fresh budget
        previous = self._dp if resume_from_checkpoint is None and max(self._dp.get("step", 0), self._dp.get("charged", 0)) > 0 else None
        if previous is not None:
            self._refuse_finished_run(previous)
        model = self.model
        check_model(model, args)
        dataset, users = self._training_set()
        uls = users is not None and args.privacy_user_sampling == "users"
        rank, world = get_rank(), get_world_size()
        sharded = is_fsdp_model(model)
        # FSDP2: the DP step gathers the full parameters, clips, reduce-scatters, noises this rank's rows and
        # updates the local shards (DPPlan.pipeline(model=fmodel)); FSDP's own backward and reduction never run
        if sharded:  # a forward outside the DP step (the user's, an evaluation) may have left a group gathered
            _reshard(model)
        fmodel, params = (make_functional_fsdp if sharded else make_functional)(model, trainable_only=True)
        losses = per_example_loss_fn(model, reduction=args.per_example_loss_reduction,
                                     label_smoothing=args.label_smoothing_factor,
                                     label_names=tuple(args.label_names or ("labels",)),
                                     custom=self.per_example_loss_func)
        collate = _EmptyAwareCollate(self.data_collator, dataset)
        # before any state changes: one loss per example, and none that moves with its batch's padding
        padding_checked = self._check_losses(losses, fmodel, params, collate, len(dataset))
        self.is_in_train = True
        self._memory_tracker.start()
        model.train()

        resumed_meta = None if resume_from_checkpoint is None else ckpt.read_dp_meta(
            resume_from_checkpoint, rank, meta=_META_TEMPLATE, sharded=sharded)
        if previous is not None:
            seed = previous["seed"]
        else:
            seed = resumed_meta["seed"] if resumed_meta is not None else self._privacy_seed()
        plan = self._build_plan(len(dataset), world, params, fmodel.param_names, users)
        if previous is not None:
            plan = _same_plan(previous["plan"], plan)
        self.privacy_plan = plan
        noise_key, sampler_key = fold_in(key(seed), 0), fold_in(key(seed), 1)
        # adaptive clipping's count noise: its own key, the same on every rank
        pipeline_keys = {"count_key": fold_in(key(seed), 2)} if plan.clipping_mode == "adaptive" else {}
        sampler = previous["sampler"] if previous is not None else self._sampler(plan, dataset, sampler_key, rank, world,
                                                                                  users)
        # Hugging Face's weight-decay split (no decay for biases and norm weights), over the trainable parameters
        decayed = set(self.get_decay_parameter_names(model))
        optimizer = optimizer_from_args(args, plan.steps, decay_mask=[n in decayed for n in fmodel.param_names])
        pipelines: dict[tuple[str, ...], Any] = {}
        compiled_steps: dict[tuple[str, ...], Any] = {}

        def pipeline_for(keys: tuple[str, ...]) -> Any:
            if keys not in pipelines:
                pipelines[keys] = plan.pipeline(_loss_over(losses, fmodel, keys, plan.clip_backend), optimizer,
                                                key=noise_key, model=fmodel, batch_argnums=tuple(range(1, len(keys) + 1)),
                                                microbatch_size=args.clipping_chunk_size, record_loss=True,
                                                **pipeline_keys)
            return pipelines[keys]

        def step_with(keys: tuple[str, ...], tensors: tuple[torch.Tensor, ...], state: Any, params: Any) -> tuple[Any, Any]:
            """One step: the pipeline's update and apply_updates, compiled with ``torch_compile=True``
            (Poisson batches padded to the plan's buckets, the padding masked out of the clip)."""
            if not args.torch_compile:
                updates, new_state = pipeline_for(keys).update(tensors, state, params)
                return apply_updates(params, updates), new_state
            if keys not in compiled_steps:
                compiled_steps[keys] = compile_step(pipeline_for(keys), buckets=plan.padding_buckets(),
                                                    mode=args.torch_compile_mode)
            return compiled_steps[keys](params, state, tensors)

        if args.torch_compile:  # refused before anything is charged or changed (e.g. adaptive clipping)
            compile_step(pipeline_for(("input_ids",)), buckets=plan.padding_buckets(), mode=args.torch_compile_mode)

        non_private = plan.noise_multiplier == 0
        accountant = None if non_private else plan.accountant()
        if non_private:
            msg = ("DPTrainer: privacy_noise_multiplier=0 -- this run is NOT private (epsilon = inf); it is the "
                   "non-private baseline.")
            warnings.warn(msg, UserWarning, stacklevel=2)
            logger.warning(msg)
        state = pipeline_for(("input_ids",)).init(params)  # the state does not depend on the batch's keys
        start_step = 0
        if previous is not None:  # the same run, from where it stopped: its parameters, state and accountant
            params, state, start_step = previous["params"], previous["state"], previous["step"]
            accountant = self.accountant
            fmodel.load_into_model(params)
        elif resume_from_checkpoint is not None:
            inner = getattr(sampler, "inner", sampler)
            # checked in full (plan identity, every counter, keys, privacy parameters) before anything changes:
            # a refused checkpoint leaves the model as it was
            # (fsdp: the sharded dp_state/ directory, every rank together, on the number of ranks that saved it)
            restored = ckpt.load_dp_state(resume_from_checkpoint, rank, plan=plan, params=params, state=state,
                                          sampler=inner, accountant=accountant, meta=_META_TEMPLATE, sharded=sharded)
            self._load_hf_checkpoint(resume_from_checkpoint)
            params, state = restored["params"], restored["state"]
            inner.load_state_dict(restored["sampler"].state_dict())
            if accountant is not None:
                accountant = restored["accountant"]
            start_step = restored["step"]
            fmodel.load_into_model(params)
        else:  # make_functional's tensors are the model's own, which load_into_model overwrites after each step:
            # the first step's parameters (its logged loss's fallback) are kept in a copy of their own
            params = tuple(p.detach().clone() for p in params)
        self.accountant = accountant
        # "charged": the steps the accountant has paid for; one more than "step" while a step is being computed
        charged = previous["charged"] if previous is not None else start_step
        self._dp = {"plan": plan, "seed": seed, "rank": rank, "sampler": sampler, "params": params, "state": state,
                    "step": start_step, "charged": charged, "exhausted": False, "sharded": sharded}

        # Hugging Face's state and callbacks
        if resume_from_checkpoint is not None and os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)):
            self.state = TrainerState.load_from_json(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME))
        elif previous is None:
            self.state = TrainerState(stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)])
        self.state.train_batch_size = args.per_device_train_batch_size
        self.state.compute_steps(args, plan.steps)
        self.state.init_training_references(self, plan.steps, plan.epochs, trial)
        self.state.global_step = start_step
        steps_per_epoch = 1.0 / plan.sample_rate if args.sampling_mode != "sequential" else sampler.steps_per_pass
        self.callback_handler.train_dataloader = None
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and start_step == 0:
            self._evaluate(trial, ignore_keys_for_eval, skip_scheduler=True)
        self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
        start_time = time.time()
        stopped_by_budget = False
        logging_on = _strategy(args.logging_strategy) != "no"
        logged_step = start_step  # the last step whose loss, epsilon and delta are in the log
        # the per-example losses (sum, count) that the clipping pass of this rank's most recent non-empty batch
        # recorded (a batch empty here keeps the previous one's): the logged loss, with no forward pass of its own
        last_record = (_clip_state(state).loss_sum, _clip_state(state).loss_count)
        first_examples = list(range(min(len(dataset), _PROBE_EXAMPLES)))
        # ULS: the fallback loss is that of the first users (each their first k examples), averaged per user
        first_users = [users.examples_of(u)[:plan.max_examples_per_user]
                       for u in range(min(users.n_users, _PROBE_EXAMPLES))] if uls else None

        def fallback_loss(at_params: Any) -> tuple[float, int]:
            with _callable_params(fmodel, at_params) as full:  # every rank takes this branch together
                if first_users is None:
                    return _loss_sum(losses, fmodel, full, self._collated_tensors(collate, first_examples),
                                     args.clipping_chunk_size)
                flat = self._collated_tensors(collate, [i for g in first_users for i in g])
                return _user_loss_sum(losses, fmodel, full, flat, [len(g) for g in first_users])

        def log_step(at_params: Any, lr_step: int) -> None:
            """Logs the recorded loss (``at_params``: the parameters of the step, for the fallback only),
            the learning rate of step ``lr_step`` (from 0), the epsilon spent (in the plan's unit, and
            per unit) and the plan's delta."""
            logs = {"loss": self._logged_loss(last_record, lambda: fallback_loss(at_params)),
                    "learning_rate": float(optimizer_lr(args, plan, lr_step)),
                    "epsilon": self._spent_epsilon(), "delta": float(plan.delta)}
            logs.update({f"epsilon_{unit}": value for unit, value in self._spent_epsilons().items()})
            if plan.clipping_mode == "adaptive":  # a function of the noised counts: released and accounted
                logs["clipping_norm"] = float(_clip_state(state).clip_state.clipping_norm)
            self.log(logs, start_time)

        if resume_from_checkpoint is not None:  # last: nothing of the set-up draws from the restored streams
            self._restore_random_streams(resume_from_checkpoint)
        for step in range(start_step, plan.steps):
            if uls:  # one group per drawn user (whole users of this rank's shard), at most k examples each
                groups = _checked_groups(sampler.batch(step), users, plan.max_examples_per_user, step)
                indices = [i for g in groups for i in g]
            else:
                indices = list(sampler.batch(step))  # indices of the whole data set (the plan's sampler offsets shards)
            collated = collate(indices)  # on the host: looking for padding in it syncs no device
            if not padding_checked and world == 1 and _has_padding(collated):  # one rank: no collective to strand
                check_padding_invariance(losses, fmodel, params, self._prepare_inputs(collated))
                padding_checked = True
            if uls:  # the flat batch, collated as the examples it is, stacked into user blocks [U, k, ...] + mask
                collated = _user_blocks(collated, groups, plan.max_examples_per_user)
            batch = self._prepare_inputs(collated)
            if accountant is not None and step >= self._dp["charged"]:
                try:  # charged before the step is computed; refused (and not recorded) beyond the budget
                    accountant.step(plan.step_cost_at(step))
                except BudgetExceededError:
                    logger.warning("DPTrainer: stopping before step %d: it would exceed the privacy budget.", step + 1)
                    stopped_by_budget = self._dp["exhausted"] = True
                    if logging_on and logged_step < step:  # the run's end is logged: the last step's loss
                        log_step(params, max(step - 1, 0))
                    break
                self._dp["charged"] = step + 1
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            model.train()  # an evaluation in between leaves the model in eval mode
            user_mask = batch.pop(_USER_MASK) if uls else None
            keys = tuple(sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor)))
            tensors = tuple(batch[k] for k in keys) + ((user_mask,) if uls else ())
            before = params  # the parameters the step is computed at (the logged loss's, and its fallback's)
            params, state = step_with(keys, tensors, state, params)
            if indices:  # known on the host: no device read
                last_record = (_clip_state(state).loss_sum, _clip_state(state).loss_count)
            fmodel.load_into_model(params)
            self._dp.update(params=params, state=state, step=step + 1, charged=max(self._dp["charged"], step + 1))
            self.state.global_step = step + 1
            self.state.epoch = (step + 1) / steps_per_epoch
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if logging_on and (step + 1 == plan.steps or self.control.should_training_stop):
                self.control.should_log = True  # the run's last step always reports its loss, epsilon and delta
            if self.control.should_log:  # whoever asked (logging_steps, a callback): the recorded loss is read now
                log_step(before, step)
                logged_step = step + 1
            before = None  # not held into the next step (a full model's parameters)
            if self.control.should_evaluate:
                metrics = self._evaluate(trial, ignore_keys_for_eval)
                is_best = self._determine_best_metric(metrics=metrics, trial=trial)
                if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
                    self.control.should_save = is_best
            if self.control.should_save:  # fsdp: every rank saves together (the full weights, the sharded DP state)
                self._save_checkpoint(model, trial)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
        return self._finish(plan, start_step, start_time, stopped_by_budget)

    # --- pieces of train() -------------------------------------------------------------

    def _refuse_unsupported(self) -> None:
        if type(self).compute_loss is not DPTrainer.compute_loss:
            raise InputValueError(
                f"{type(self).__name__} overrides compute_loss, which returns one loss for the whole batch; DP needs "
                "each example's loss. Pass per_example_loss_func=lambda outputs, batch: <[B] losses> instead."
            )
        if self.compute_loss_func is not None:
            raise InputValueError(
                "DPTrainer: compute_loss_func returns a loss averaged over the whole batch, which cannot be clipped per "
                "example. Pass per_example_loss_func=lambda outputs, batch: <one loss per example, [B]> instead."
            )
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise InputValueError(
                "DPTrainer: optimizers=(optimizer, scheduler) are torch objects that the private step cannot use; "
                "choose the optimizer with TrainingArguments.optim / learning_rate / lr_scheduler_type instead."
            )
        if self.model_init is not None:
            raise InputValueError("DPTrainer does not support model_init; pass the model.")
        if getattr(self, "neftune_noise_alpha", None):
            raise InputValueError("DPTrainer: NEFTune noise is not supported (neftune_noise_alpha must be None).")
        args = self.args
        args._check_privacy_unit()  # again: the arguments may have been changed since they were made
        args.check_fsdp_fields()
        if is_fsdp_model(self.model) and not args.fsdp:
            raise InputValueError(
                "DPTrainer: the model is already sharded with fully_shard, but the arguments do not set fsdp. Pass the "
                "unsharded model with TrainingArguments(fsdp=True, fsdp_config={'fsdp_version': 2, "
                "'transformer_layer_cls_to_wrap': [...]}): DPTrainer shards it and Hugging Face's evaluation and "
                "save_model then know it is sharded."
            )
        if args.privacy_unit == "user" and args.privacy_user_sampling == "users" and args.torch_compile:
            raise InputValueError(
                "DPTrainer: torch_compile=True is not supported with privacy_unit='user' and "
                "privacy_user_sampling='users' yet: the compiled step pads batches of examples, not blocks of users. "
                "Set torch_compile=False, or privacy_user_sampling='examples'."
            )

    def _refuse_finished_run(self, previous: dict[str, Any]) -> None:
        """Refuses a second ``train()`` once this trainer's run has taken all its steps or spent its budget."""
        plan = previous["plan"]
        if previous["step"] < plan.steps and not previous.get("exhausted", False):
            return
        why = "spent its budget" if previous.get("exhausted", False) else f"taken all {plan.steps} steps of its plan"
        raise InputValueError(
            f"DPTrainer.train(): this trainer's private run is complete: it has {why} (epsilon "
            f"{self._spent_epsilon():.4g} {plan.epsilon_unit} at delta {plan.delta:.3g}). A second train() would "
            "train the same model on the same data under a fresh budget, and the two runs' epsilons would add up "
            "unreported. To train longer, plan it as one run (a larger max_steps or num_train_epochs under one privacy_target_epsilon) and train a "
            "fresh model with a new DPTrainer. (A second train() on a run stopped early, by a callback or an error, "
            "continues it; a new DPTrainer on this trained model is a second run whose epsilon composes with this one's.)"
        )

    def _check_losses(self, losses: Callable[..., torch.Tensor], fmodel: FunctionalModel, params: Any,
                      collate: Callable[[list[int]], dict[str, Any]], n: int) -> bool:
        """Runs the per-example loss on the first examples of the training set, before anything
        is charged: a custom loss must return one loss per example, and an example's loss must
        not change with its batch's padding (:func:`check_padding_invariance`). The same
        examples on every rank, so every rank raises or none. Returns whether the probe had
        padding (then the padding was checked)."""
        if n == 0:
            return False
        with _callable_params(fmodel, params) as full:  # an FSDP model: its gathered parameters (every rank at once)
            return self._check_losses_at(losses, fmodel, full, collate, n)

    def _check_losses_at(self, losses: Callable[..., torch.Tensor], fmodel: FunctionalModel, params: Any,
                         collate: Callable[[list[int]], dict[str, Any]], n: int) -> bool:
        batch = self._prepare_inputs(collate(list(range(min(n, _PROBE_EXAMPLES)))))
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if self.per_example_loss_func is not None:
            was_training = fmodel.model.training
            fmodel.model.eval()  # no dropout: the probe draws nothing from the RNGs the training uses
            try:
                with torch.no_grad():
                    losses(fmodel, params, tensors)  # raises unless the custom loss returns shape [B]
            finally:
                fmodel.model.train(was_training)
        config = getattr(getattr(fmodel.model, "get_base_model", lambda: fmodel.model)(), "config", None)
        if getattr(config, "is_encoder_decoder", False) or not _has_padding(tensors):
            return False
        check_padding_invariance(losses, fmodel, params, tensors)
        return True

    def _training_set(self) -> tuple[Any, _UserColumn | None]:
        """The training set as the model sees it, and with ``privacy_unit="user"`` its
        :class:`~opake_fx.users.UserIndex` (read from ``privacy_user_id_column``, which the
        returned dataset no longer has); ``None`` for an example-level run."""
        dataset = self.train_dataset
        if dataset is None:
            raise InputValueError("DPTrainer.train needs a train_dataset.")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise InputValueError(
                "DPTrainer needs a map-style train_dataset (with __len__ and indexing): Poisson sampling draws each "
                "example independently, which a stream cannot do."
            )
        users = None
        if self.args.privacy_unit == "user":  # before Hugging Face drops the column the model does not take
            users, dataset = _split_user_ids(dataset, self.args.privacy_user_id_column)
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset) and self.args.remove_unused_columns:
                dataset = self._remove_unused_columns(dataset, description="training")
        except ImportError:  # pragma: no cover - datasets is optional
            pass
        return dataset, users

    def _privacy_seed(self) -> int:
        seed = self.args.privacy_seed
        if seed is None:
            seed = secrets.randbits(62) if get_rank() == 0 else 0
            if is_distributed() and get_world_size() > 1:
                seed = int(all_reduce(torch.tensor([seed], dtype=torch.int64), "sum")[0])
        return int(seed)

    def _build_plan(self, n: int, world: int, params: Any, names: tuple[str, ...], users: _UserColumn | None = None,
                    ) -> DPPlan:
        """The run's plan; a per-group ``clipping_norm`` dict is matched against the trainable ``names``.

        With ``privacy_unit="user"`` (``users`` given) the plan counts users (``"users"``:
        ``dataset_size`` the number of users, the batch the expected users per step) or the
        examples a cap of ``k`` per user keeps (``"examples"``), and the default delta is
        ``1 / U**1.1`` for ``U`` users."""
        args = self.args
        unit: dict[str, Any] = {}
        if users is not None:
            k = int(args.privacy_max_examples_per_user)
            unit = dict(privacy_unit="user", max_examples_per_user=k, user_sampling=args.privacy_user_sampling)
            n_units, n = users.n_users, (users.n_users if args.privacy_user_sampling == "users" else users.capped_size(k))
        else:
            n_units = n
        length: dict[str, Any] = {"steps": int(args.max_steps)} if args.max_steps > 0 else {"epochs": float(args.num_train_epochs)}
        if isinstance(args.clipping_norm, dict):
            clip: Any = per_group_by_regex(params, names, args.clipping_norm)
        else:
            clip = args.clipping_norm if math.isfinite(args.clipping_norm) else UNBOUNDED_CLIP
        extra = {**(args.sampling_kwargs or {}), **(args.privacy_noise_mechanism_kwargs or {})}
        sequential = args.sampling_mode == "sequential"
        if sequential and world > 1:
            raise InputValueError("DPTrainer: sampling_mode='sequential' runs in one process only.")
        return DPPlan(
            dataset_size=n,
            batch_size=float(args.logical_batch_size * world),
            clipping_norm=clip,
            target_epsilon=args.privacy_target_epsilon,
            delta=args.privacy_target_delta if args.privacy_target_delta is not None else 1.0 / n_units**1.1,
            noise_multiplier=args.privacy_noise_multiplier,
            sampling="poisson" if sequential else args.sampling_mode,
            mechanism=args.privacy_noise_mechanism,
            clip_backend=args.clip_backend,
            accountant_kind=args.privacy_accountant,
            clipping_mode=args.clipping_mode,
            clipping_kwargs=args.clipping_kwargs,
            **unit,
            **length,
            **extra,
        )

    def _sampler(self, plan: DPPlan, dataset: Any, sampler_key: Any, rank: int, world: int,
                 users: _UserColumn | None = None) -> Any:
        """This rank's batch sampler: the plan's (with ``users``: over whole users of this rank,
        :meth:`DPPlan.sampler`'s ``user_ids``; nothing here re-shards examples)."""
        if self.args.sampling_mode == "sequential":
            from opake_fx.dpsgd.sampling import SequentialBatchSampler

            return SequentialBatchSampler(len(dataset), batch_size=self.args.logical_batch_size,
                                          n_steps=plan.steps, drop_last=self.args.dataloader_drop_last)
        if users is not None:
            return plan.sampler(dataset, sampler_key, rank=rank, world_size=world, user_ids=users.ids)
        return plan.sampler(dataset, sampler_key, rank=rank, world_size=world)

    def _collated_tensors(self, collate: Callable[[list[int]], dict[str, Any]], indices: list[int]) -> dict[str, torch.Tensor]:
        batch = self._prepare_inputs(collate(list(indices)))
        return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}

    def _logged_loss(self, record: tuple[torch.Tensor, torch.Tensor], fallback: Callable[[], tuple[float, int]]) -> float:
        """The mean per-example loss, over every rank, that the clipping passes recorded: ``record`` is
        this rank's (sum, count) of its most recent non-empty batch (:class:`~opake_fx.plan.RecordedLossState`).

        No forward pass of its own, except when no rank has drawn an example yet in this ``train()``
        (every batch so far empty): then ``fallback()``, the (sum, count) of the first training
        examples at the step's parameters, on private copies of the random streams (it draws nothing
        the training draws, so logging more or less often trains the same). Every rank takes the same
        branch (the decision reads the global count)."""
        local = torch.stack([record[0].detach().double(), record[1].detach().double()]).cpu()
        total = _global_sum(local)
        if total[1] > 0:
            return float(total[0] / total[1])
        with _private_random_streams():
            first = fallback()
        total = _global_sum(torch.tensor([first[0], float(first[1])], dtype=torch.float64))
        if total[1] > 0:
            return float(total[0] / total[1])
        raise InputValueError("DPTrainer: no training example to compute the logged loss on.")  # pragma: no cover

    def _restore_random_streams(self, directory: str) -> None:
        """Restores the random streams that the step draws from outside the privacy keys (dropout,
        a data collator's masking: python ``random``, numpy, torch's CPU generator and the CUDA
        generators) from the checkpoint's ``rng_state.pth`` / ``rng_state_{rank}.pth``, which
        Hugging Face's ``_save_checkpoint`` writes next to the DP state. The noise and the batches
        come from the privacy keys in ``dp_state`` and do not depend on these."""
        name = f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth"
        if not os.path.isfile(os.path.join(directory, name)):
            logger.warning(
                "DPTrainer: %s has no %s, so dropout and the data collator's randomness do not continue the saved "
                "run's (the resumed run is private and continues the noise and batches, but does not equal the "
                "uninterrupted run bit for bit).", directory, name)
            return
        self._load_rng_state(directory)

    def _spent_epsilon(self) -> float:
        """The epsilon spent so far in the plan's unit (``plan.epsilon_unit``: per example or per user)."""
        plan = self.privacy_plan
        return self._spent_epsilons()[plan.epsilon_unit.replace(" ", "_")]

    def _spent_epsilons(self) -> dict[str, float]:
        """The epsilon spent so far in every unit that applies (:meth:`DPPlan.spent_epsilons`):
        ``{"per_example"}``, ``{"per_user"}`` (ULS) or both (ELS)."""
        plan = self.privacy_plan
        if self.accountant is None:
            spent = math.inf if self.state.global_step > 0 else 0.0
            units = ("per_example", "per_user") if plan.user_sampling == "examples" else (
                plan.epsilon_unit.replace(" ", "_"),)
            return {u: spent for u in units}
        return {u: float(e) for u, e in plan.spent_epsilons(self.accountant).items()}

    def _finish(self, plan: DPPlan, start_step: int, start_time: float, stopped_by_budget: bool) -> TrainOutput:
        from transformers.trainer_utils import speed_metrics

        steps = self.state.global_step - start_step
        metrics = speed_metrics("train", start_time, num_steps=steps)
        train_loss = float("nan")
        losses = [h["loss"] for h in self.state.log_history if "loss" in h and h.get("step", 0) > start_step]
        if not losses:  # no step taken by this train() (resumed at the run's end): the run's logged losses
            losses = [h["loss"] for h in self.state.log_history if "loss" in h]
        if losses:
            train_loss = sum(losses) / len(losses)
        metrics["train_loss"] = train_loss
        spent = self._spent_epsilons()
        metrics["privacy_epsilon"] = spent[plan.epsilon_unit.replace(" ", "_")]  # in the plan's unit
        metrics["privacy_unit"] = plan.privacy_unit
        for unit, value in spent.items():
            metrics[f"privacy_epsilon_{unit}"] = value
        metrics["privacy_delta"] = plan.delta
        metrics["privacy_noise_multiplier"] = plan.noise_multiplier
        metrics["privacy_steps"] = self.state.global_step
        metrics["privacy_budget_exhausted"] = stopped_by_budget
        self._memory_tracker.stop_and_update_metrics(metrics)
        self.log(dict(metrics))
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        self.is_in_train = False
        return TrainOutput(self.state.global_step, train_loss, metrics)

    # --- checkpoints: Hugging Face's, with the DP state in place of the torch optimizer ---

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        dp = self._dp
        if not dp:
            return
        os.makedirs(output_dir, exist_ok=True)
        inner = getattr(dp["sampler"], "inner", dp["sampler"])
        ckpt.save_dp_state(output_dir, dp["rank"], plan=dp["plan"], params=dp["params"], state=dp["state"],
                           sampler=inner, accountant=self.accountant, meta={"seed": dp["seed"], "step": dp["step"]},
                           sharded=dp.get("sharded", False))
        if self.args.should_save:
            ckpt.write_accountant_json(output_dir, plan=dp["plan"], steps=dp["step"], epsilon=self._spent_epsilon(),
                                       accountant=self.accountant, epsilons=self._spent_epsilons())

    def _save_scaler(self, output_dir: str) -> None:
        return None

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Hugging Face's (``evaluate``, ``predict``); a model sharded by ``fsdp`` is resharded after it.

        An FSDP2 forward outside training leaves some groups gathered (the root's, and each
        layer's with ``reshard_after_forward=False``); the DP step needs the sharded parameters back.
        """
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            if is_fsdp_model(self.model):
                _reshard(self.model)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Hugging Face's ``save_model``; a model sharded by ``fsdp`` is saved whole.

        Under ``fsdp`` every rank must call it (the full state dict is gathered from the
        shards with ``torch.distributed.checkpoint``'s ``get_model_state_dict``); the main
        process writes it as Hugging Face does (``save_pretrained``: a PEFT model's
        adapters, or the whole model), loadable with ``from_pretrained`` without FSDP.

        Privacy: the trained parameters are the DP run's release (post-processing).
        """
        if not is_fsdp_model(self.model):
            super().save_model(output_dir, _internal_call)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # every rank gathers (a collective); with cpu_offload only rank 0 keeps the tensors
        state_dict = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.args.should_save:
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _load_hf_checkpoint(self, directory: str) -> None:
        """The model's weights from a checkpoint, after its DP state was accepted.

        Under ``fsdp`` Hugging Face's loader is not used (it reads FSDP's own checkpoint
        files, which DPTrainer does not write): the trained parameters come from the
        sharded DP state, and the frozen ones from the full weights ``save_model`` wrote
        (:func:`~opake_fx.transformers.sharding.load_frozen_weights`; an adapter checkpoint
        holds none: the base is the model's own, as with Hugging Face's resume).
        """
        if is_fsdp_model(self.model):
            load_frozen_weights(self.model, directory)
            return
        self._load_from_checkpoint(directory)

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """Hugging Face's loss (used by ``evaluate``/``predict``; training uses per-example losses)."""
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


# --- helpers -----------------------------------------------------------------------------

_META_TEMPLATE = {"seed": 0, "step": 0}
_USER_MASK = "__opake_user_mask__"  # the key of the user blocks' mask in a ULS batch (popped before the model)
_PROBE_EXAMPLES = 8  # the examples train() runs the loss on before the first step (checks only)


def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value))


def _check_fsdp_world(args: TrainingArguments) -> None:
    """Refuses ``fsdp`` in one process (before Hugging Face's own, less specific, refusal)."""
    if args.fsdp and args.world_size < 2:
        raise InputValueError(
            f"DPTrainer: fsdp shards the model over the ranks of a distributed launch, but this is {args.world_size} "
            "process. Launch the script with torchrun --nproc_per_node N (N >= 2, ddp_backend='gloo' on CPU), or leave "
            "fsdp out to train in one process."
        )


def _reshard(model: torch.nn.Module) -> None:
    """Frees every gathered FSDP2 group of ``model``: its parameters are the sharded ``DTensor`` s again (local, no collective)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _clip_state(state: Any) -> Any:
    """The clip stage's state in the pipeline's state (``named_chain``'s ``state["clip"]``; FSDP2's ``state.clip``)."""
    return state.clip if isinstance(state, FSDPStepState) else state["clip"]


@contextlib.contextmanager
def _callable_params(fmodel: FunctionalModel, params: Any) -> Any:
    """``params`` as ``fmodel`` takes them outside the DP step: unchanged, or for an FSDP2 model
    the gathered full parameters (in its mixed-precision compute dtype), with its frozen base
    gathered for the block (collectives: every rank enters together)."""
    if not isinstance(fmodel, FSDPFunctionalModel):
        yield params
        return
    with fmodel.gathered(params) as full:
        yield full


def _private_random_streams() -> Any:
    """Runs the body on copies of torch's CPU generator (and the current CUDA device's, if in use),
    restored afterwards."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


def _has_padding(batch: Mapping[str, Any]) -> bool:
    mask = batch.get("attention_mask")
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel() > 0 and not bool((mask != 0).all())


def _same_plan(previous: DPPlan, plan: DPPlan) -> DPPlan:
    """``previous``, the plan a continued run keeps, if the arguments still make it; else an error."""
    mine, theirs = plan.to_dict(), previous.to_dict()
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if diff:
        raise InputValueError(
            f"DPTrainer.train(): a second train() continues this trainer's private run, but its arguments or training "
            f"set now make another privacy plan (differs in {diff}), which would change the mechanism mid-run. Restore "
            "the run's arguments and training set to continue it; a new run needs a new DPTrainer (and its epsilon "
            "composes with this run's, since the model already depends on the data)."
        )
    return previous


def _loss_over(losses: Callable[..., torch.Tensor], fmodel: FunctionalModel, keys: tuple[str, ...], backend: str) -> Callable[..., Any]:
    def batched(params: Any, *tensors: torch.Tensor) -> torch.Tensor:
        return losses(fmodel, params, dict(zip(keys, tensors)))

    if backend != "vmap":
        return batched

    def one(params: Any, *tensors: torch.Tensor) -> torch.Tensor:  # one example, no batch axis
        return with_batch_dim(lambda *t: batched(params, *t))(*tensors)

    return one


def _loss_sum(losses: Callable[..., torch.Tensor], fmodel: FunctionalModel, params: Any, batch: dict[str, torch.Tensor],
              chunk: int | None = None) -> tuple[float, int]:
    """Sum and count of the per-example losses (``chunk`` examples at a time, as the clipping)."""
    n = next(iter(batch.values())).shape[0]
    total, count = 0.0, 0
    step = chunk or max(n, 1)
    with torch.no_grad():
        for start in range(0, n, step):
            values = losses(fmodel, params, {k: v[start:start + step] for k, v in batch.items()})
            total, count = total + float(values.detach().double().sum()), count + int(values.shape[0])
    return total, count


def _user_loss_sum(losses: Callable[..., torch.Tensor], fmodel: FunctionalModel, params: Any,
                   batch: dict[str, torch.Tensor], sizes: list[int]) -> tuple[float, int]:
    """ULS: sum and count over users of each user's mean example loss; ``batch`` holds the users'
    examples in order, ``sizes`` how many each (what the clipping pass records with users as units)."""
    with torch.no_grad():
        values = losses(fmodel, params, batch).detach().double()
    total, start = 0.0, 0
    for s in sizes:
        total += float(values[start:start + s].mean())
        start += s
    return total, len(sizes)


def _split_user_ids(dataset: Any, column: str) -> tuple[_UserColumn, Any]:
    """The :class:`UserIndex` of ``dataset``'s ``column`` and the dataset without that column.

    A ``datasets.Dataset`` column is read whole and removed (``remove_columns``); any other
    map-style dataset must give a dict per example, read once, and is viewed without the key."""
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            if column not in dataset.column_names:
                raise InputValueError(
                    f"DPTrainer: privacy_unit='user' reads each example's user id from the column "
                    f"privacy_user_id_column={column!r}, but the train_dataset has no such column; its columns are "
                    f"{dataset.column_names}. Add the column, or set privacy_user_id_column."
                )
            return _UserColumn([_user_id(v, column, i) for i, v in enumerate(dataset[column])]), \
                dataset.remove_columns([column])
    except ImportError:  # pragma: no cover - datasets is optional
        pass
    ids = []
    for i in range(len(dataset)):
        example = dataset[i]
        if not isinstance(example, Mapping) or column not in example:
            got = sorted(example) if isinstance(example, Mapping) else type(example).__name__
            raise InputValueError(
                f"DPTrainer: privacy_unit='user' reads each example's user id from privacy_user_id_column={column!r}, "
                f"but example {i} of the train_dataset has no such field (it has {got}). Give every example its "
                "user's id under that key, or set privacy_user_id_column."
            )
        ids.append(_user_id(example[column], column, i))
    return _UserColumn(ids), _WithoutColumn(dataset, column)


def _user_id(value: Any, column: str, i: int) -> Any:
    """A user id as a plain hashable: a one-element integer tensor becomes its int (a tensor hashes by identity)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex():
            raise InputTypeError(
                f"DPTrainer: the user id of example {i} (column {column!r}) is a tensor of shape "
                f"{tuple(value.shape)} and dtype {value.dtype}; give one int or string per example."
            )
        return int(value.item())
    return value


class _UserColumn(UserIndex):
    """The :class:`UserIndex` of the user-id column, keeping the ids (``ids``, for the plan's sampler)
    and each example's user number (``owner``, for the per-step check)."""

    def __init__(self, ids: list[Any]) -> None:
        super().__init__(ids)
        self.ids = ids
        self.owner = [0] * self.n_examples
        for u in range(self.n_users):
            for i in self.examples_of(u):
                self.owner[i] = u


class _WithoutColumn(torch.utils.data.Dataset):
    """``dataset`` whose examples (dicts) lack ``column``: the model and the collator never see it."""

    def __init__(self, dataset: Any, column: str) -> None:
        self.dataset, self.column = dataset, column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v for k, v in self.dataset[i].items() if k != self.column}


def _checked_groups(groups: Any, users: _UserColumn, k: int, step: int) -> list[list[int]]:
    """A ULS step's groups, refused unless each is at most ``k`` examples of one user and no user is
    drawn twice (the unit the clip bounds is exactly one user's contribution)."""
    out = [list(g) for g in groups]
    owner = users.owner
    seen: set[int] = set()
    for g in out:
        who = {owner[i] for i in g}
        if len(g) > k or len(who) != 1 or who & seen:
            raise InputValueError(
                f"DPTrainer: step {step + 1}'s user groups are not whole users' examples (at most "
                f"privacy_max_examples_per_user={k} of one user per group, each user once); the step is refused, as "
                "clipping such a group would not bound one user's contribution."
            )
        seen |= who
    return out


def _user_blocks(collated: dict[str, Any], groups: list[list[int]], k: int) -> dict[str, Any]:
    """The collated flat batch of a ULS step (the groups' examples in order) as user blocks
    ``[U, k, ...]`` (rows past a user's examples zero), with the bool mask ``[U, k]`` under ``_USER_MASK``."""
    keys = [name for name, v in collated.items() if isinstance(v, torch.Tensor)]
    renumbered, start = [], 0
    for g in groups:
        renumbered.append(list(range(start, start + len(g))))
        start += len(g)
    blocks, mask = collate_users(tuple(collated[name] for name in keys), renumbered, max_examples=k)
    out = {name: v for name, v in collated.items() if not isinstance(v, torch.Tensor)}
    out.update(zip(keys, blocks))
    out[_USER_MASK] = mask
    return out


def _global_sum(t: torch.Tensor) -> torch.Tensor:
    if is_distributed() and get_world_size() > 1:
        return all_reduce(t, "sum")
    return t


def optimizer_lr(args: Any, plan: DPPlan, step: int) -> float:
    """The learning rate the optimizer used at ``step`` (from 0)."""
    from opake_fx.transformers.optim import learning_rate_schedule

    return float(learning_rate_schedule(args, plan.steps)(step))


class _EmptyAwareCollate:
    """``collate(indices)``: the data collator on the examples, or correctly shaped empty tensors for ``[]``."""

    def __init__(self, collate: Callable[[list[Any]], Any], dataset: Any) -> None:
        self.collate, self.dataset = collate, dataset
        self._empty: Any = None

    def __call__(self, indices: list[int]) -> dict[str, Any]:
        if indices:
            return dict(self.collate([self.dataset[i] for i in indices]))
        if self._empty is None:
            one = dict(self.collate([self.dataset[0]]))
            self._empty = {k: (v[:0] if isinstance(v, torch.Tensor) else v) for k, v in one.items()}
        return dict(self._empty)

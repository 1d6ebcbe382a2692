"""DP ``TrainingArguments``: Hugging Face's own, plus the fields that describe the private run.

The DP fields map onto one :class:`opake_fx.plan.DPPlan` when ``DPTrainer.train()``
starts (the dataset size is known only then): the expected batch, the length of the run,
the clip norm, the noise (calibrated for a target epsilon or given), the sampler and the
mechanism. Everything that can be checked without the data is checked here, with errors
that name the field to change.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import transformers

from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["TrainingArguments", "SAMPLING_MODES", "CLIP_BACKENDS", "CLIPPING_MODES", "PRIVACY_UNITS", "USER_SAMPLINGS"]

SAMPLING_MODES = ("poisson", "cyclic_poisson", "b_min_sep", "balls_in_bins", "sequential")
"""``poisson`` (DP-SGD's default), the DP-FTRL samplers, and ``sequential`` (a fixed
in-order batch order: only for the non-private baseline ``privacy_noise_multiplier=0``)."""

CLIP_BACKENDS = ("auto", "vmap", "ghost")
CLIPPING_MODES = ("fixed", "adaptive", "auto")
PRIVACY_UNITS = ("example", "user")
"""What one neighbouring data set adds or removes: one example, or all of one user's examples."""
USER_SAMPLINGS = ("users", "examples")
"""With ``privacy_unit="user"``: sample users (ULS) or capped examples (ELS, group privacy)."""
# The plan fields DPTrainer sets from the arguments; sampling_kwargs and the mechanism's kwargs may set the others
# (today: bands, max_batch_size; whatever DPPlan grows later passes through).
MAPPED_PLAN_FIELDS = ("dataset_size", "batch_size", "sample_rate", "steps", "epochs", "clipping_norm", "target_epsilon",
                      "delta", "noise_multiplier", "sampling", "mechanism", "clip_backend", "accountant_kind",
                      "clipping_mode", "clipping_kwargs", "privacy_unit", "max_examples_per_user", "user_sampling")


def _plan_options() -> list[str]:
    from opake_fx.plan import DPPlan

    return sorted(f.name for f in dataclasses.fields(DPPlan) if f.name not in MAPPED_PLAN_FIELDS)


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` with the fields of a differentially private run.

    Every Hugging Face field keeps its meaning, except these, which DP changes:

    * ``per_device_train_batch_size`` is the EXPECTED batch per rank: under Poisson
      sampling each step's batch has a random size (empty batches are normal steps).
      With ``gradient_accumulation_steps = k > 1`` the expected logical batch per rank is
      ``k * per_device_train_batch_size``: each DP step draws one logical batch, clips
      and sums it in chunks of ``per_device_train_batch_size`` examples (memory only), and
      adds the noise once; there are no noised micro-steps.
    * ``num_train_epochs`` / ``max_steps`` fix the length of the run, which the privacy
      budget is calibrated for; the run stops when the budget is spent.
    * ``max_grad_norm`` is not applied: DP clips each example's gradient to
      ``clipping_norm`` before the sum, which replaces Hugging Face's global-norm clipping
      of the summed gradient. Its default (``1.0``) and ``0`` / ``None`` (Hugging Face's
      "no clipping") are accepted and ignored; any other value is an error naming
      ``clipping_norm``, since a ported script that sets it expects a clip it would not get.
    * ``seed`` seeds the model's initialisation and the evaluation, never the privacy
      randomness (see ``privacy_seed``).
    * ``fsdp`` / ``fsdp_config`` (FSDP2 only, under ``torchrun``): ``DPTrainer`` shards
      the model itself and trains it through the sharded DP step; the options that step
      cannot honour are refused (:meth:`check_fsdp_fields`).

    DP fields:
        privacy_target_epsilon: the epsilon the whole run may spend; the noise multiplier
            is calibrated for it when ``train()`` starts. Give this *or*
            ``privacy_noise_multiplier``.
        privacy_target_delta: delta; default ``1 / N**1.1`` with ``N`` the training set size.
        privacy_noise_multiplier: sigma, given instead of a target. ``0`` is the explicit
            non-private baseline: epsilon = inf, reported as such.
        clipping_norm: the per-example L2 clip norm C (``math.inf``: no clipping, only
            with ``privacy_noise_multiplier=0``), or a dict of per-group norms
            ``{regex: C_g, ..., "fallback": C}``: each TRAINABLE parameter (the names of
            ``make_functional(model, trainable_only=True)``, e.g.
            ``base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight``) goes to
            the first regex, in the dict's order, that ``re.search``-es its name, else to
            ``"fallback"``; group g is clipped to ``C_g``. The noise is scaled to the total
            sensitivity ``sqrt(sum_g C_g**2)`` over the groups that have parameters (an
            unused ``"fallback"`` does not count); the accounting is that of the noise
            multiplier, as for one norm. A regex that takes no trainable parameter, or a
            parameter no regex matches without a ``"fallback"``, is an error at ``train()``.
            Per-group norms go with ``clipping_mode="fixed"`` only. A string is read as JSON
            (a number, or the dict), as a config file or ``HfArgumentParser`` gives it.
        clipping_mode: ``"fixed"`` (default), ``"auto"`` (AUTO-S, Bu et al. 2023: every
            gradient is scaled to norm just under ``clipping_norm``; same sensitivity and
            accounting as fixed clipping) or ``"adaptive"`` (Andrew et al. 2021: the norm
            tracks a quantile of the gradient norms, starting at ``clipping_norm``; each
            step also releases a noised clipped count, which the accountant charges with the
            gradient as one Gaussian of effective multiplier
            ``(sigma**-2 + (2 * count_noise_multiplier)**-2)**-1/2``; a target epsilon
            calibrates sigma for both). Adaptive clipping needs
            ``privacy_noise_mechanism="gaussian"`` (DP-FTRL's noise is scaled to one fixed
            sensitivity for the run).
        clipping_kwargs: the mode's options (``DPPlan``'s ``CLIPPING_KWARGS``): ``"auto"``:
            ``gamma`` (default 0.01); ``"adaptive"``: ``target_quantile`` (0.5),
            ``learning_rate`` (0.2, of the geometric norm update) and
            ``count_noise_multiplier`` (the std of the count's noise in counts; default the
            expected global batch / 20). ``"fixed"`` takes none.
        clip_backend: ``"auto"`` (default: exact fast clipping from layer activations where
            rules exist, an exact fallback elsewhere), ``"vmap"`` or ``"ghost"``.
        sampling_mode: ``"poisson"`` (default, for ``gaussian``), ``"cyclic_poisson"`` (for
            ``band_mf`` and ``bsr``), ``"b_min_sep"``, ``"balls_in_bins"`` (for ``band_mf``,
            ``bsr`` and ``blt``; the plan refuses a pair it has no accounting for), or
            ``"sequential"`` (non-private baseline only).
        sampling_kwargs: extra plan fields of the sampler (e.g. ``{"min_sep": 4}``).
        privacy_noise_mechanism: ``"gaussian"`` (DP-SGD) or a DP-FTRL strategy:
            ``"band_mf"``, ``"bsr"`` or ``"blt"``.
        privacy_noise_mechanism_kwargs: extra plan fields of the mechanism (``{"bands": 4}``).
        privacy_accountant: ``"pld"`` (default) or ``"rdp"``.
        privacy_seed: the seed of the noise and sampling keys. ``None`` (default) draws
            one from the operating system's CSPRNG at ``train()`` (shared by all ranks);
            it is saved in the checkpoints, so a resumed run continues exactly. A known
            seed lets anyone recompute the noise and the batches: set it only for tests.
        per_example_loss_reduction: ``"mean"`` (default; each example's loss is the mean
            over its own non-padding tokens) or ``"sum"``.
        microbatch_size: memory only (privacy-neutral): the clipped per-example gradients
            of a batch are computed this many examples at a time and summed (``None``:
            the whole batch at once). The batch, the clipping, the noise and the
            accounting are the same with or without it.
        privacy_unit: ``"example"`` (default: add-or-remove-one-example neighbours, every
            epsilon per example) or ``"user"`` (add-or-remove-one-user: all of a user's
            examples present or absent; every epsilon per user). With ``"user"`` each
            example of the train dataset must carry its user's id in
            ``privacy_user_id_column``; the plan is ``DPPlan(privacy_unit="user")`` and
            ``privacy_target_epsilon`` / ``privacy_target_delta`` are per user (default
            delta ``1 / U**1.1``, ``U`` the number of users). ``sampling_mode="poisson"``
            and ``privacy_noise_mechanism="gaussian"`` only.
        privacy_user_id_column: the column (a ``datasets.Dataset`` column, or the key of
            each example's dict) holding the user id (an int or a string; not a float).
            ``DPTrainer`` reads it once and removes it from the model's inputs. Two ids for
            one person are two users: the guarantee is per id.
        privacy_max_examples_per_user: ``k``, required with ``privacy_unit="user"`` and
            refused otherwise: the most examples of one user in a step (``"users"``), or in
            the whole run (``"examples"``); a user with more contributes a keyed random
            subset of ``k``.
        privacy_user_sampling: with ``privacy_unit="user"``: ``"users"`` (default; ULS:
            each user joins a step with probability ``q`` with up to ``k`` examples, and the
            mean of their examples' losses is clipped as ONE unit;
            ``per_device_train_batch_size`` then counts expected USERS per step and rank,
            ``num_train_epochs`` passes over users) or ``"examples"`` (ELS: each user keeps a
            keyed subset of at most ``k`` examples for the whole run, the kept examples are
            Poisson-sampled and clipped one by one, and the per-user epsilon is the
            example-level one by group privacy for ``k``; both epsilons are reported).
            ``"examples"`` is refused with ``privacy_unit="example"``.

    Raises:
        InputValueError / InputTypeError: a missing, contradictory or unsupported DP
            setting, naming the field(s) to change.

    Privacy contract: the fields above are the whole privacy configuration of the run;
    ``DPTrainer`` builds exactly one ``DPPlan`` from them, whose sampler, noise and
    accountant read the same values. With ``privacy_unit="user"`` the unit of that plan,
    and of every epsilon the trainer logs or returns, is the user as
    ``privacy_user_id_column`` defines it.

    Example:
        >>> args = TrainingArguments(output_dir="/tmp/opake-doc", privacy_target_epsilon=8.0,
        ...                          per_device_train_batch_size=16, report_to="none")
        >>> args.clip_backend, args.sampling_mode, args.privacy_noise_mechanism, args.privacy_unit
        ('auto', 'poisson', 'gaussian', 'example')
        >>> users = TrainingArguments(output_dir="/tmp/opake-doc", privacy_target_epsilon=8.0, report_to="none",
        ...                           privacy_unit="user", privacy_max_examples_per_user=4)
        >>> users.privacy_user_id_column, users.privacy_user_sampling
        ('user_id', 'users')
    """

    privacy_target_epsilon: float | None = field(default=None, metadata={"help": "Target epsilon of the whole run."})
    privacy_target_delta: float | None = field(default=None, metadata={"help": "Delta (default 1 / N**1.1)."})
    privacy_noise_multiplier: float | None = field(
        default=None, metadata={"help": "Noise multiplier instead of a target (0: non-private baseline)."}
    )
    # float first: HfArgumentParser parses the command line's value as a float (it accepts a Union with str)
    clipping_norm: float | str | dict = field(
        default=1.0,
        metadata={"help": "Per-example L2 clip norm, or a dict (or its JSON) regex -> norm with 'fallback' (per group)."},
    )
    clipping_mode: str = field(default="fixed", metadata={"help": "fixed, auto (AUTO-S) or adaptive."})
    clipping_kwargs: dict | None = field(default=None, metadata={"help": "Options of the clipping mode."})
    clip_backend: str = field(default="auto", metadata={"help": "auto, vmap or ghost."})
    sampling_mode: str = field(default="poisson", metadata={"help": "poisson, cyclic_poisson, b_min_sep, balls_in_bins, sequential."})
    sampling_kwargs: dict | None = field(default=None, metadata={"help": "Options of the sampler (e.g. bands)."})
    privacy_noise_mechanism: str = field(default="gaussian", metadata={"help": "gaussian or a DP-FTRL strategy (band_mf, bsr, blt)."})
    privacy_noise_mechanism_kwargs: dict | None = field(default=None, metadata={"help": "Options of the mechanism."})
    privacy_accountant: str = field(default="pld", metadata={"help": "pld or rdp."})
    privacy_seed: int | None = field(default=None, metadata={"help": "Seed of noise and sampling (None: OS CSPRNG)."})
    per_example_loss_reduction: str = field(default="mean", metadata={"help": "mean or sum over each example's tokens."})
    microbatch_size: int | None = field(default=None, metadata={"help": "Memory only: examples per clipping chunk."})
    privacy_unit: str = field(default="example", metadata={"help": "example or user: the unit every epsilon is per."})
    privacy_user_id_column: str = field(default="user_id", metadata={"help": "The column of each example's user id."})
    privacy_max_examples_per_user: int | None = field(
        default=None, metadata={"help": "k: the most examples of one user (per step for users, per run for examples)."}
    )
    privacy_user_sampling: str = field(default="users", metadata={"help": "users (ULS) or examples (ELS)."})

    def __post_init__(self) -> None:
        check_max_grad_norm(self.max_grad_norm)
        self._check_privacy_fields()
        self._check_fsdp_strategy()  # before Hugging Face translates (or refuses) the legacy fsdp strings
        super().__post_init__()
        self._check_training_fields()

    # --- conversion ---------------------------------------------------------------------

    @property
    def logical_batch_size(self) -> int:
        """The expected batch of one DP step per rank: ``per_device_train_batch_size *
        gradient_accumulation_steps``."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def clipping_chunk_size(self) -> int | None:
        """How many examples the clipping computes at once (memory only): ``microbatch_size``,
        and at most ``per_device_train_batch_size`` under gradient accumulation; ``None``:
        the whole batch."""
        chunks = [c for c in (self.microbatch_size,
                              self.per_device_train_batch_size if self.gradient_accumulation_steps > 1 else None)
                  if c is not None]
        return min(chunks) if chunks else None

    @classmethod
    def from_hf(cls, hf_args: transformers.TrainingArguments, **dp_fields: Any) -> TrainingArguments:
        """DP arguments with every field of ``hf_args`` and the given DP fields.

        Example:
            >>> import transformers
            >>> hf = transformers.TrainingArguments(output_dir="/tmp/opake-doc", learning_rate=1e-3, report_to="none")
            >>> args = TrainingArguments.from_hf(hf, privacy_target_epsilon=3.0)
            >>> args.learning_rate, args.privacy_target_epsilon
            (0.001, 3.0)
        """
        if not isinstance(hf_args, transformers.TrainingArguments):
            raise InputTypeError(
                f"TrainingArguments.from_hf needs a transformers.TrainingArguments; got {type(hf_args).__name__}."
            )
        ours = {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
        unknown = sorted(set(dp_fields) - ours)
        if unknown:
            raise InputValueError(
                f"TrainingArguments.from_hf: unknown DP field(s) {unknown}; the DP fields are {sorted(ours)}."
            )
        values = {f.name: getattr(hf_args, f.name) for f in dataclasses.fields(hf_args) if f.init}
        for name in ours:  # a DP TrainingArguments converted again keeps its DP fields
            if name in values and name not in dp_fields:
                dp_fields[name] = values.pop(name)
            values.pop(name, None)
        values = {k: (v.value if hasattr(v, "value") and type(v).__module__.startswith("transformers") else v)
                  for k, v in values.items()}
        return cls(**values, **dp_fields)

    # --- validation ---------------------------------------------------------------------

    def _check_privacy_fields(self) -> None:
        eps, nm = self.privacy_target_epsilon, self.privacy_noise_multiplier
        if (eps is None) == (nm is None):
            which = "neither was given" if eps is None else "both were given"
            raise InputValueError(
                f"TrainingArguments: give exactly one of privacy_target_epsilon (the noise is calibrated for it) and "
                f"privacy_noise_multiplier (sigma; 0 for a non-private baseline); {which}."
            )
        if eps is not None and not (_is_real(eps) and 0 < eps < math.inf):
            raise InputValueError(f"TrainingArguments: privacy_target_epsilon must be finite and > 0; got {eps!r}.")
        if nm is not None and not (_is_real(nm) and 0 <= nm < math.inf):
            raise InputValueError(
                f"TrainingArguments: privacy_noise_multiplier must be finite and >= 0 (0: non-private); got {nm!r}."
            )
        d = self.privacy_target_delta
        if d is not None and not (_is_real(d) and 0 < d < 1):
            raise InputValueError(f"TrainingArguments: privacy_target_delta must be in (0, 1); got {d!r}.")
        c = self.clipping_norm
        if isinstance(c, str):  # JSON, as a config file or a command line gives it
            try:
                c = json.loads(c)
            except ValueError:
                raise InputValueError(
                    f"TrainingArguments: clipping_norm={c!r} is a string but not JSON; give a number, or "
                    "'{\"regex\": norm, ..., \"fallback\": norm}' for per-group norms."
                ) from None
            self.clipping_norm = c
        non_private = nm is not None and nm == 0
        _choice(self.clipping_mode, "clipping_mode", CLIPPING_MODES)
        if isinstance(c, dict):
            self._check_per_group_norms(c)
        elif not (_is_real(c) and c > 0):
            raise InputValueError(
                f"TrainingArguments: clipping_norm must be > 0 (or math.inf), or a dict of parameter-name regex -> norm "
                f"with a 'fallback' entry; got {c!r}."
            )
        elif math.isinf(c) and not non_private:
            raise InputValueError(
                "TrainingArguments: clipping_norm=inf bounds nothing, so no noise makes the run private; it is only "
                "allowed with privacy_noise_multiplier=0 (the non-private baseline)."
            )
        elif math.isinf(c) and self.clipping_mode != "fixed":
            raise InputValueError(
                f"TrainingArguments: clipping_norm=inf (no clipping) goes with clipping_mode='fixed' only; "
                f"clipping_mode={self.clipping_mode!r} needs a finite clipping_norm (AUTO-S's scale, or adaptive "
                "clipping's initial norm)."
            )
        self._check_clipping_mode()
        _choice(self.clip_backend, "clip_backend", CLIP_BACKENDS)
        _choice(self.sampling_mode, "sampling_mode", SAMPLING_MODES)
        if self.sampling_mode == "sequential" and not non_private:
            raise InputValueError(
                "TrainingArguments: sampling_mode='sequential' is a fixed batch order with no amplification, which the "
                "accounting does not cover; it is only allowed with privacy_noise_multiplier=0 (the non-private "
                "baseline). Use sampling_mode='poisson'."
            )
        for name in ("sampling_kwargs", "privacy_noise_mechanism_kwargs"):
            extra = getattr(self, name) or {}
            if not isinstance(extra, dict):
                raise InputTypeError(f"TrainingArguments: {name} must be a dict; got {type(extra).__name__}.")
            bad = sorted(set(extra) - set(_plan_options()))
            if bad:
                raise InputValueError(
                    f"TrainingArguments: {name} has unknown option(s) {bad}; the DPPlan options it may set are "
                    f"{_plan_options()}."
                )
        if not isinstance(self.privacy_noise_mechanism, str):
            raise InputTypeError("TrainingArguments: privacy_noise_mechanism must be a string, e.g. 'gaussian'.")
        _choice(self.privacy_accountant, "privacy_accountant", ("pld", "rdp"))
        _choice(self.per_example_loss_reduction, "per_example_loss_reduction", ("mean", "sum"))
        if self.privacy_seed is not None and (isinstance(self.privacy_seed, bool) or not isinstance(self.privacy_seed, int)):
            raise InputTypeError(f"TrainingArguments: privacy_seed must be an int or None; got {self.privacy_seed!r}.")
        mb = self.microbatch_size
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            raise InputValueError(
                f"TrainingArguments: microbatch_size must be a positive int (examples per chunk of the clipped "
                f"gradient) or None (the whole batch at once); got {mb!r}."
            )
        self._check_privacy_unit()

    def _check_privacy_unit(self) -> None:
        _choice(self.privacy_unit, "privacy_unit", PRIVACY_UNITS)
        _choice(self.privacy_user_sampling, "privacy_user_sampling", USER_SAMPLINGS)
        col = self.privacy_user_id_column
        if not isinstance(col, str) or not col:
            raise InputTypeError(
                f"TrainingArguments: privacy_user_id_column must be a non-empty string (a column name); got {col!r}."
            )
        k = self.privacy_max_examples_per_user
        if self.privacy_unit == "example":
            if k is not None:
                raise InputValueError(
                    f"TrainingArguments: privacy_max_examples_per_user={k!r} applies to privacy_unit='user' only; with "
                    "privacy_unit='example' every epsilon is per example and no user cap is applied. Set "
                    "privacy_unit='user' (and privacy_user_id_column) for a per-user guarantee, or leave it out."
                )
            if self.privacy_user_sampling != "users":
                raise InputValueError(
                    f"TrainingArguments: privacy_user_sampling={self.privacy_user_sampling!r} applies to "
                    "privacy_unit='user' only; set privacy_unit='user' and privacy_max_examples_per_user, or leave it "
                    "at its default."
                )
            return
        if k is None:
            raise InputValueError(
                "TrainingArguments: privacy_unit='user' needs privacy_max_examples_per_user (k): the most examples of "
                "one user in a step (privacy_user_sampling='users') or in the run ('examples'), e.g. 8; a user with more "
                "contributes a random subset of k."
            )
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InputValueError(f"TrainingArguments: privacy_max_examples_per_user must be an int >= 1; got {k!r}.")
        unsupported = [f"{name}={value!r}" for name, value, ok in (
            ("sampling_mode", self.sampling_mode, "poisson"),
            ("privacy_noise_mechanism", self.privacy_noise_mechanism, "gaussian")) if value != ok]
        if unsupported:
            raise InputValueError(
                f"TrainingArguments: privacy_unit='user' is built for sampling_mode='poisson' and "
                f"privacy_noise_mechanism='gaussian' (Poisson sampling accounted as DP-SGD over users, or over capped "
                f"examples); got {', '.join(unsupported)}."
            )
        if self.privacy_user_sampling == "users" and self.clip_backend == "vmap":
            raise InputValueError(
                "TrainingArguments: clip_backend='vmap' is not supported with privacy_unit='user' and "
                "privacy_user_sampling='users': a user's loss would vmap over their examples inside the clip's vmap "
                "over users, and Hugging Face models' mask code does not run under two vmaps. Use clip_backend='auto' "
                "(default) or 'ghost' (the same clipped sum, exact)."
            )
        if self.privacy_user_sampling == "examples" and self.clipping_mode == "adaptive":
            raise InputValueError(
                "TrainingArguments: privacy_user_sampling='examples' takes clipping_mode='fixed' or 'auto': adaptive "
                "clipping's noised count is accounted per example and its per-user (group) conversion is not built. "
                "Use privacy_user_sampling='users'."
            )

    def _check_per_group_norms(self, norms: dict) -> None:
        from opake_fx.plan import regex_norms

        regex_norms(norms, "TrainingArguments",
                    "(For no clipping at all, give clipping_norm=math.inf with privacy_noise_multiplier=0.)")
        if self.clipping_mode != "fixed":
            raise InputValueError(
                f"TrainingArguments: per-group clipping_norm (a dict) goes with clipping_mode='fixed' only; "
                f"clipping_mode={self.clipping_mode!r} "
                + ("scales every gradient to one norm" if self.clipping_mode == "auto" else "tracks one norm")
                + ". Give one float clipping_norm, or clipping_mode='fixed'."
            )

    def _check_clipping_mode(self) -> None:
        from opake_fx.plan import check_clipping_kwargs

        mode = self.clipping_mode
        check_clipping_kwargs(mode, self.clipping_kwargs, "TrainingArguments")
        if mode == "adaptive" and self.privacy_noise_mechanism != "gaussian":
            raise InputValueError(
                f"TrainingArguments: clipping_mode='adaptive' needs privacy_noise_mechanism='gaussian'; DP-FTRL "
                f"({self.privacy_noise_mechanism!r}) scales its correlated noise to one fixed sensitivity for the whole "
                "run, and there is no accounting for the noised count released next to it. Use clipping_mode='fixed' "
                "or 'auto' with DP-FTRL."
            )

    def _check_training_fields(self) -> None:
        g = self.gradient_accumulation_steps
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise InputValueError(f"TrainingArguments: gradient_accumulation_steps must be an int >= 1; got {g!r}.")
        if self.auto_find_batch_size:
            raise InputValueError(
                "TrainingArguments: auto_find_batch_size changes the batch size, which the privacy accounting depends "
                "on; set auto_find_batch_size=False."
            )
        if self.fp16 or (self.bf16 and not self.fsdp):
            raise InputValueError(
                "TrainingArguments: "
                + ("fp16" if self.fp16 else "bf16")
                + " mixed precision is not supported by DPTrainer (per-example clipping runs in the model's own dtype"
                + ("; with fsdp, bf16=True is honoured (FSDP2's MixedPrecisionPolicy), fp16 is not" if self.fsdp else
                   "; with fsdp under torchrun, bf16=True is honoured through FSDP2's MixedPrecisionPolicy")
                + "); set fp16=False and bf16=False, or load the model in bfloat16."
            )
        if self.per_device_train_batch_size < 1:
            raise InputValueError("TrainingArguments: per_device_train_batch_size (the expected batch) must be >= 1.")
        if self.privacy_unit == "user" and self.privacy_user_sampling == "users" and self.torch_compile:
            raise InputValueError(
                "TrainingArguments: torch_compile=True is not supported with privacy_unit='user' and "
                "privacy_user_sampling='users' yet: the compiled step pads batches of examples, not blocks of users. "
                "Set torch_compile=False, or privacy_user_sampling='examples'."
            )
        self.check_fsdp_fields()

    def _check_fsdp_strategy(self) -> None:
        items = self.fsdp.split() if isinstance(self.fsdp, str) else list(self.fsdp) if isinstance(self.fsdp, list) else []
        hybrid = [i for i in items if str(i) in ("hybrid_shard", "hybrid_shard_zero2")]
        if hybrid:
            raise InputValueError(
                f"TrainingArguments: fsdp={self.fsdp!r}: {hybrid[0]} (HSDP: sharded within a node, replicated across "
                "nodes, a 2-D mesh) is not supported by the sharded DP step, which shards over one 1-D mesh of all "
                "ranks. Use fsdp='full_shard' (or fsdp=True) with fsdp_config={'fsdp_version': 2}."
            )
        if "no_shard" in [str(i) for i in items]:
            raise InputValueError(
                f"TrainingArguments: fsdp={self.fsdp!r}: no_shard is data parallelism, which DPTrainer does without "
                "fsdp (each rank clips its examples, the clipped sums are summed, the same noise on every rank). Leave "
                "fsdp out."
            )

    def check_fsdp_fields(self) -> None:
        """Refuses the Hugging Face ``fsdp`` options that the sharded DP step cannot honour.

        With ``fsdp`` on, ``DPTrainer`` shards the model with FSDP2's ``fully_shard`` (each
        layer of ``fsdp_config["transformer_layer_cls_to_wrap"]``, then the root) and trains
        it through the sharded DP step (:func:`opake_fx.distributed.fsdp.make_functional_fsdp`
        and ``DPPlan.pipeline(model=fmodel)``). Honoured: ``fsdp=True`` / ``"full_shard"`` /
        ``"shard_grad_op"`` / ``"auto_wrap"``, ``fsdp_version=2``,
        ``transformer_layer_cls_to_wrap``, ``auto_wrap_policy`` ``"TRANSFORMER_BASED_WRAP"``
        or ``"NO_WRAP"``, ``reshard_after_forward``, ``state_dict_type="FULL_STATE_DICT"``.
        Trainer checkpoints (``save_strategy``, ``save_steps``) and
        ``train(resume_from_checkpoint=...)`` work: each checkpoint holds the full weights and
        the run's sharded DP state (``dp_state/``), resumed on the same number of ranks.
        Refused, each with the fix: FSDP1, XLA FSDP, CPU offload, ``cpu_ram_efficient_loading``,
        FSDP's activation checkpointing, size-based wrapping, sharded state dicts,
        ``load_best_model_at_end``, ``torch_compile``, and the plan parts whose sharded
        release is not built. DP-FTRL mechanisms, per-group clip norms and adaptive clipping
        work sharded (each rank draws its rows of the noise, each leaf its group's; the
        noised count is summed over the ranks as without fsdp).
        ``bf16=True`` is honoured: FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``
        (bf16 forward and backward; the norms, clipped sums, noise, parameters and optimizer
        state stay float32). fp16 is refused for every run, bf16 without fsdp too.

        Raises:
            InputValueError: the first such option, naming it and what to set instead.

        Privacy: none (a check).
        """
        if not self.fsdp:
            return
        config = self.fsdp_config or {}
        plugin = self.fsdp_plugin_args or {}
        version = plugin.get("fsdp_version", 2)
        refusals = (
            (config.get("xla", False),
             "fsdp_config['xla'] (XLA's FSDP) is not supported: the sharded DP step is built on torch's FSDP2. Remove "
             "'xla' from fsdp_config."),
            (version != 2,
             f"fsdp_config['fsdp_version']={version} (FSDP1) is not supported: the sharded DP step is built on FSDP2's "
             "DTensor parameters. Set fsdp_config={'fsdp_version': 2, ...}."),
            (bool(plugin.get("cpu_offload", False)),
             "fsdp 'offload' (fsdp_config['cpu_offload']) is not supported: the sharded DP step gathers and updates "
             "the parameters where they live. Remove 'offload' from fsdp and 'cpu_offload' from fsdp_config."),
            (bool(plugin.get("cpu_ram_efficient_loading", False)),
             "fsdp_config['cpu_ram_efficient_loading'] is not supported: DPTrainer shards the model it is given, which "
             "must hold the same initial weights on every rank. Set it to False (the default)."),
            (bool(plugin.get("activation_checkpointing", False)),
             "fsdp_config['activation_checkpointing'] is not supported: the sharded DP step calls the model "
             "functionally with FSDP's hooks held off, and per-example clipping needs the activations. Set it to "
             "False; for memory, use microbatch_size or gradient_accumulation_steps."),
            (plugin.get("auto_wrap_policy") == "SIZE_BASED_WRAP",
             "fsdp_config['auto_wrap_policy']='SIZE_BASED_WRAP' is not supported: DPTrainer shards each layer of "
             "transformer_layer_cls_to_wrap, then the root. Use 'TRANSFORMER_BASED_WRAP' (the default) with "
             "fsdp_config['transformer_layer_cls_to_wrap'], or 'NO_WRAP' (the root only)."),
            ("FULL_STATE_DICT" not in str(plugin.get("state_dict_type", "FULL_STATE_DICT")),
             f"fsdp_config['state_dict_type']={plugin.get('state_dict_type')!r} is not supported: DPTrainer writes "
             "the model whole (save_model, and each checkpoint's weights) and the run's sharded state in each "
             "checkpoint's dp_state/ directory; FSDP's own sharded model state dict is not written. Set it to "
             "'FULL_STATE_DICT' (the default)."),
            (bool(self.load_best_model_at_end),
             "load_best_model_at_end=True with fsdp is not supported: loading a checkpoint's weights into the sharded "
             "model after training is not built. Leave it False and load the best checkpoint's weights "
             "(checkpoint-N/model.safetensors, or the adapters) with from_pretrained after train()."),
            (bool(self.torch_compile),
             "torch_compile=True with fsdp is not supported: the compiled DP step is built for unsharded parameters. "
             "Set torch_compile=False."),
        )
        for refused, why in refusals:
            if refused:
                raise InputValueError(f"TrainingArguments: {why}")


def check_max_grad_norm(value: Any, where: str = "TrainingArguments") -> None:
    """Refuses a ``max_grad_norm`` other than Hugging Face's default (``1.0``) or ``0`` / ``None``.

    Hugging Face clips the SUMMED gradient to ``max_grad_norm``; DP clips each example's
    gradient to ``clipping_norm`` instead, and never applies ``max_grad_norm``. A script
    that sets it (e.g. ``0.5``) expects a clip it would silently not get, so it is an error
    that names the field to set instead.

    Privacy: none (a check; the clip norm that bounds the sensitivity is ``clipping_norm``).

    Example:
        >>> check_max_grad_norm(1.0); check_max_grad_norm(0.0); check_max_grad_norm(None)
        >>> check_max_grad_norm(0.5)
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputValueError: TrainingArguments: max_grad_norm=0.5 is not applied by DPTrainer: DP clips each example's gradient to clipping_norm (before the sum), which replaces Hugging Face's clipping of the summed gradient. Set clipping_norm=0.5 and leave max_grad_norm at its default (1.0, not applied), or set max_grad_norm=0.
    """
    if value is None or (_is_real(value) and value in (0, 1)):
        return
    raise InputValueError(
        f"{where}: max_grad_norm={value!r} is not applied by DPTrainer: DP clips each example's gradient to "
        "clipping_norm (before the sum), which replaces Hugging Face's clipping of the summed gradient. Set "
        f"clipping_norm={value!r} and leave max_grad_norm at its default (1.0, not applied), or set max_grad_norm=0."
    )


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _choice(value: Any, name: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise InputValueError(f"TrainingArguments: {name} must be one of {list(options)}; got {value!r}.")

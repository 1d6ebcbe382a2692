"""The model zoo of issue 12: real architectures under every clipping backend.

Tiny models (Hugging Face ones built from config objects, random weights, nothing
downloaded; torch-native ones directly; see ``tests/integrations/_zoo.py``), each with
padded batches where the model takes a mask, an odd batch size, and batch sizes EQUAL to
another dimension of the model (sequence length, heads, relative-attention buckets,
channels, LSTM layers...), since the bug class is "a dimension equal to the batch size is
taken for the batch axis".

For every model, batch size and backend ("vmap", "ghost", "auto"), the clipped sum and
the per-example norms must equal a per-example autograd loop in float64 (each example
run alone, batch size 1) to 1e-10 relative, with a clipping norm between the examples'
norms (some clipped, some not). The fast path is asserted: where the issue says a model
must stay on layer rules, a ``SlowPathWarning`` is an error (and ghost/auto may not run
``torch.func.vmap`` at all); where a slow path is acceptable, it must say so.

Cases that fail today are ``xfail(strict=True)``, each marker's reason naming the root
cause; a fix flips them to XPASS, which fails the run until the marker is removed.
"""

from __future__ import annotations

import functools
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.errors import OpakeError, SlowPathWarning
from opake_fx.functional import make_functional
from tests.integrations import _zoo as Z

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft on transformers 5

BACKENDS = ("vmap", "ghost", "auto")

# --- what fails today, and why -----------------------------------------------------------------
# (case, size label or "*", backend or "*", reason, exception type(s) expected today), each
# becoming a strict xfail; the first match wins. Empty: every case passes on every backend.
# (This round fixed: HF masks and float64 RNNs under vmap, by the exact per-example loop; T5
# at B == T, by the batch axis by provenance; BERT/RoBERTa's tied decoder bias; RMSNorm and
# EmbeddingBag rules.)

XFAIL: list[tuple[str, str, str, str, Any]] = [
]

# The fast path, also checked by counting torch.func.vmap calls (a fallback that ran vmap
# without saying so would pass the warning check above but not this one).
XFAIL_VMAP_COUNT: dict[str, tuple[str, Any]] = {}


def xfail_reason(name: str, label: str, backend: str) -> tuple[str, Any] | None:
    for n, lab, be, reason, raises in XFAIL:
        if n == name and lab in ("*", label) and be in ("*", backend):
            return reason, raises
    return None


def _marks(case: Z.Case, xfail: tuple[str, Any] | None) -> list[Any]:
    marks: list[Any] = []
    if case.hf and (Z.transformers is None or Z.peft is None):
        marks.append(pytest.mark.skip(reason="needs the hf extra (transformers, peft)"))
    if case.slow:
        marks.append(pytest.mark.slow)
    if xfail is not None:
        reason, raises = xfail
        marks.append(pytest.mark.xfail(strict=True, raises=raises, reason=reason))
    return marks


ZOO = [
    pytest.param(case.name, label, backend, id=f"{case.name}-{label}-{backend}",
                 marks=_marks(case, xfail_reason(case.name, label, backend)))
    for case in Z.CASES
    for label in case.sizes
    for backend in BACKENDS
]

FAST_CASES = [
    pytest.param(case.name, backend, id=f"{case.name}-{backend}", marks=_marks(case, XFAIL_VMAP_COUNT.get(case.name)))
    for case in Z.CASES
    for backend in ("ghost", "auto")
    if case.expect[backend] == "fast"
]


@functools.lru_cache(maxsize=None)
def _model(name: str) -> torch.nn.Module:
    return Z.build(Z.BY_NAME[name])


@functools.lru_cache(maxsize=None)
def _oracle(name: str, label: str) -> tuple[Z.Prepared, float, list[torch.Tensor], torch.Tensor]:
    """The prepared case, a clipping norm between the examples' norms, and the reference."""
    case = Z.BY_NAME[name]
    prep = Z.prepare(case, case.sizes[label], _model(name))
    grads_of, norms = Z.per_example_grads(prep.batched, prep.train, prep.batch)
    c = Z.clip_norm_between(norms)
    return prep, c, Z.clipped_sum(grads_of, norms, c), norms


def _run(request: pytest.FixtureRequest, backend: str, prep: Z.Prepared, c: float, error_on_slow: bool) -> Z.Run:
    """``Z.run_backend``; for a test marked xfail, its exception is re-raised (same object,
    same type) without the deep transformers/functorch traceback, the innermost frames named
    in a note: pytest spends ~0.5 s parsing sources for each such traceback, most of this
    file's run time. Tests without the marker (remove it to debug) keep their full traceback."""
    if request.node.get_closest_marker("xfail") is None:
        return Z.run_backend(backend, prep, c, error_on_slow=error_on_slow)
    try:
        return Z.run_backend(backend, prep, c, error_on_slow=error_on_slow)
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)[-4:][::-1]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames)
        e.add_note(f"(traceback shortened for an xfail test; innermost frames: {where})")
        e.__cause__, e.__suppress_context__ = None, True
        raise e.with_traceback(None)  # noqa: B904


@pytest.mark.parametrize("name,label,backend", ZOO)
def test_zoo(name: str, label: str, backend: str, request: pytest.FixtureRequest) -> None:
    case = Z.BY_NAME[name]
    prep, c, want, norms = _oracle(name, label)
    expect = case.expect[backend]
    run = _run(request, backend, prep, c, error_on_slow=expect == "fast")
    Z.compare(prep, run, want, norms)
    assert run.out.max_norm == c
    if expect == "slow":
        assert run.warnings, f"{backend}: an exact slow path was expected to emit a SlowPathWarning"
    if expect == "any" and backend != "vmap" and run.vmap_calls:
        assert run.warnings, f"{backend}: {run.vmap_calls} vmap fallback(s) ran without a SlowPathWarning"


@pytest.mark.parametrize("name,backend", FAST_CASES)
def test_zoo_fast_path_runs_no_vmap(name: str, backend: str, request: pytest.FixtureRequest) -> None:
    """Models that must stay on layer rules: no SlowPathWarning and no ``torch.func.vmap`` at
    all (every exact fallback today is built on vmap; a silent one would pass the test above)."""
    case = Z.BY_NAME[name]
    label = next(iter(case.sizes))
    prep, c, want, norms = _oracle(name, label)
    run = _run(request, backend, prep, c, error_on_slow=True)
    Z.compare(prep, run, want, norms)
    assert run.vmap_calls == 0, f"{backend}: {run.vmap_calls} vmap call(s): a module took a vmap fallback"


# --- a model that mixes examples --------------------------------------------------------------


def _mixing() -> tuple[Any, tuple[torch.Tensor, ...], Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Z.Mixing().double()
    fmodel, params = make_functional(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64)

    def batched(p: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return ((fmodel(p, xb) - yb) ** 2).sum(1)

    return fmodel, params, batched, x, y


@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_mixing_model_is_refused_by_the_fast_backends(backend: str) -> None:
    fmodel, params, batched, x, y = _mixing()
    fn, state = clipped_grad(batched, clipping_norm=1.0, batch_argnums=(1, 2), clip_backend=backend, model=fmodel)
    with pytest.raises(OpakeError, match="mixes examples") as err:
        fn(params, x, y, state=state)
    assert "clip_backend='vmap'" in str(err.value)


def test_mixing_model_under_vmap_is_per_example() -> None:
    # The vmap backend calls the loss on single examples: there the mean over the batch
    # axis is over one example, as in the per-example loop.
    fmodel, params, batched, x, y = _mixing()
    _, unclipped = Z.reference(batched, params, (x, y), float("inf"))
    c = Z.clip_norm_between(unclipped)
    want, norms = Z.reference(batched, params, (x, y), c)
    prep = Z.Prepared(fmodel, params, list(fmodel.param_names), batched, (x, y))
    run = Z.run_backend("vmap", prep, c, error_on_slow=True)
    Z.compare(prep, run, want, norms)


@pytest.mark.parametrize("name", [c.name for c in Z.CASES if not c.slow])
def test_zoo_whole_loss_fallback_as_listed(name: str) -> None:
    """ghost/auto take the whole-loss fallback exactly where the zoo lists why (issue 29: no
    whole-loss fallback on the models people fine-tune; the rest named with their reason)."""
    case = Z.BY_NAME[name]
    if case.hf and (Z.transformers is None or Z.peft is None):
        pytest.skip("needs the hf extra (transformers, peft)")
    prep = Z.prepare(case, next(iter(case.sizes.values())))
    run = Z.run_backend("auto", prep, 1.0)
    whole = [w for w in run.warnings if "whole-loss fallback" in w and "parameter(s)" in w]
    if case.whole_loss is None:
        assert not whole, whole
    else:
        assert whole, f"{name} no longer takes the whole-loss fallback: drop its whole_loss reason"

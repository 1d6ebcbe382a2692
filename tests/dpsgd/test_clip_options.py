"""The clipping functions' shared options are checked once into one ClipConfig, and the three
clip stages are generated from their clipping function (issue 31: one value, not a retyped
signature at every hop)."""

from __future__ import annotations

import inspect

import pytest
import torch

from opake_fx.dpsgd.clipping import (adaptive_clip, adaptive_clipped_grad, auto_clip, auto_clipped_grad, clip,
                                     clipped_grad)
from opake_fx.dpsgd.clipping.options import ClipConfig
from opake_fx.errors import InputValueError
from opake_fx.random import key

STAGES = [(clip, clipped_grad, dict(clipping_norm=1.0)), (auto_clip, auto_clipped_grad, {}),
          (adaptive_clip, adaptive_clipped_grad, dict(initial_clipping_norm=1.0, count_noise_multiplier=0.0, key=key(0)))]


def loss(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((x - p) ** 2).sum()


@pytest.mark.parametrize("stage, maker, required", STAGES)
def test_a_stage_takes_its_clipping_function_keywords_but_the_four_it_fixes(stage, maker, required):
    made = inspect.signature(maker).parameters
    taken = inspect.signature(stage).parameters
    assert set(made) - set(taken) == {"argnums", "has_aux", "return_aux", "dtype"}
    assert list(taken)[0] == "loss_fn" and set(taken) <= set(made)
    for name, parameter in taken.items():
        assert parameter.default == made[name].default and parameter.annotation == made[name].annotation
        assert parameter.kind == (made[name].kind if name == "loss_fn" else inspect.Parameter.KEYWORD_ONLY)
    assert stage.__name__ == stage.__qualname__ and stage.__module__ == "opake_fx.dpsgd.clipping.stage"
    assert "Example:" in stage.__doc__ and "Privacy:" in stage.__doc__


@pytest.mark.parametrize("stage, maker, required", STAGES)
def test_a_malformed_stage_call_is_a_type_error_naming_the_stage(stage, maker, required):
    with pytest.raises(TypeError, match=rf"^{stage.__name__}\(\) .*'dtype'"):
        stage(loss, dtype=torch.float64, **required)
    with pytest.raises(TypeError, match=rf"^{stage.__name__}\(\) "):
        stage(loss, 1.0, **required)


@pytest.mark.parametrize("stage, maker, required", STAGES)
def test_a_stage_checks_its_options_once_into_one_config(stage, maker, required, monkeypatch):
    made = []
    of = ClipConfig.of.__func__

    def counted(cls, arguments):
        made.append(of(cls, arguments))
        return made[-1]

    monkeypatch.setattr(ClipConfig, "of", classmethod(counted))
    t = stage(loss, batch_argnums=(1,), normalize_by=4, microbatch_size=2, **required)
    assert len(made) == 1
    cfg = made[0]
    assert (cfg.argnums, cfg.single_argnum, cfg.batch_argnums, cfg.normalize_by, cfg.microbatch_size) == \
        ((0,), True, (1,), 4.0, 2)
    p = torch.zeros(2)
    out, _ = t.update((torch.ones(4, 2),), t.init(p), p)
    assert len(made) == 1  # a step reads the config, never builds another


def test_the_config_keeps_the_checks_and_their_messages():
    shared = dict(argnums=(0, 2), has_aux=False, normalize_by=2, batch_argnums=1, microbatch_size=None,
                  return_stats=True, return_aux=False, dtype=None, clip_backend="vmap", model=None, pre_clip=None,
                  second_moment=False)
    cfg = ClipConfig.of(shared)
    assert (cfg.argnums, cfg.single_argnum, cfg.batch_argnums, cfg.normalize_by) == ((0, 2), False, (1,), 2.0)
    assert isinstance(cfg.normalize_by, float)
    with pytest.raises(InputValueError, match="normalize_by must be a finite number > 0; got inf"):
        ClipConfig.of({**shared, "normalize_by": float("inf")})
    with pytest.raises(InputValueError, match="return_aux and return_stats cannot both be set"):
        ClipConfig.of({**shared, "return_aux": True})
    with pytest.raises(InputValueError, match="microbatch_size must be a positive int or None; got True"):
        ClipConfig.of({**shared, "microbatch_size": True})

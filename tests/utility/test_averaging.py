"""EMA and Polyak averaging: bit-exact against a reference loop, and resumed from a checkpoint."""

from __future__ import annotations

import pytest
import torch

from opake_fx.averaging import AverageState, ema, polyak
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.serialization import load_checkpoint, save_checkpoint


def _trajectory(n: int = 30):
    g = torch.Generator().manual_seed(0)
    return [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)} for _ in range(n)]


def _ema_reference(traj, decay, warmup, start):
    avg = {k: v.clone() for k, v in traj[0].items()}  # init from the first params (a copy)
    out = []
    for t, p in enumerate(traj):
        if t < start:
            avg = {k: v.clone() for k, v in p.items()}
        else:
            n = t - start
            d = min(decay, (1.0 + n) / (10.0 + n)) if warmup else decay
            avg = {k: avg[k] * d + p[k] * (1.0 - d) for k in p}
        out.append(avg)
    return out


@pytest.mark.parametrize("warmup,start", [(True, 0), (False, 0), (True, 5)])
def test_ema_is_bit_exact_against_a_reference_loop(warmup, start):
    traj = _trajectory()
    avg = ema(0.95, warmup=warmup, start=start)
    state = avg.init(traj[0])
    want = _ema_reference(traj, 0.95, warmup, start)
    for t, p in enumerate(traj):
        out, state = avg.update(p, state)
        for k in p:
            assert torch.equal(out[k], want[t][k]), (t, k)
    assert state.count == len(traj)


def test_polyak_is_the_running_mean_bit_for_bit():
    traj = _trajectory()
    avg = polyak(start=4)
    state = avg.init(traj[0])
    ref = None
    for t, p in enumerate(traj):
        out, state = avg.update(p, state)
        if t < 4:
            ref = {k: v.clone() for k, v in p.items()}
        else:
            n = t - 4
            ref = {k: ref[k] + (p[k] - ref[k]) / (n + 1) for k in p}
        for k in p:
            assert torch.equal(out[k], ref[k])
    mean = {k: torch.stack([p[k] for p in traj[4:]]).mean(0) for k in traj[0]}
    for k in mean:
        torch.testing.assert_close(out[k], mean[k])  # and it is the mean (up to rounding)


@pytest.mark.parametrize("make", [lambda: ema(0.9), lambda: polyak(start=3)])
def test_averaging_resumes_from_a_checkpoint_bit_for_bit(tmp_path, make):
    traj = _trajectory(20)
    avg = make()
    state = avg.init(traj[0])
    for p in traj:
        full, state = avg.update(p, state)

    avg2 = make()
    state2 = avg2.init(traj[0])
    for p in traj[:11]:
        _, state2 = avg2.update(p, state2)
    save_checkpoint(tmp_path / "avg.pt", avg=state2)
    resumed = load_checkpoint(tmp_path / "avg.pt", avg=make().init(traj[0]))["avg"]
    assert isinstance(resumed, AverageState) and resumed.count == 11
    avg3 = make()
    for p in traj[11:]:
        out, resumed = avg3.update(p, resumed)
    for k in full:
        assert torch.equal(out[k], full[k])


def test_bad_arguments_are_refused():
    with pytest.raises(InputValueError, match=r"\[0, 1\)"):
        ema(1.0)
    with pytest.raises(InputValueError, match="start"):
        polyak(start=-1)
    with pytest.raises(InputTypeError, match="AverageState"):
        ema(0.9).update([torch.zeros(1)], None)


def test_wrong_types_are_input_type_errors():
    with pytest.raises(InputTypeError, match="decay"):
        ema("0.9")
    with pytest.raises(InputTypeError, match="start"):
        polyak(start=1.5)

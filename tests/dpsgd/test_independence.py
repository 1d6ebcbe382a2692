"""The fast backends refuse every model or loss in which one example reads another.

Each class below is an attack from the privacy review (issue 27, item 3): a forward that
lets example i read example i-1 (differentiably, or through a detached or integer path),
a custom autograd.Function whose forward is the identity and whose backward mixes the
batch, a small batch-mean term in the loss, a loss scaled by the batch size. Before the
exact guard, the forward probe (losses of examples 0 and 1 with and without example 2,
1e-3 relative) let all of them train. Each is checked against the leave-one-out
sensitivity it would have had: the clipped sum moves by more than C when one example is
removed, so accepting it would have been a privacy bug, not a style issue.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.dpsgd.clipping._independence import FORWARD_RTOL, PROBE_EXAMPLES
from opake_fx.errors import InputValueError, SlowPathWarning
from opake_fx.functional import make_functional
from tests.dpsgd._attacks import MixingBackward, shift

BACKENDS = ["ghost", "auto"]
D = 5


class ReadsPredecessor(nn.Module):
    def __init__(self, detach: bool = False, weight: float = 0.5) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 8), nn.Linear(8, 1)
        self.detach, self.weight = detach, weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        prev = shift(h)
        h = h + self.weight * (prev.detach() if self.detach else prev)
        return self.b(h)[:, 0]


class MixesInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(MixingBackward.apply(torch.tanh(self.a(x))))[:, 0]


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _labels(x: torch.Tensor) -> torch.Tensor:
    return (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # in 0..2, from each example's own features


def _clip(model: nn.Module, loss, backend: str, x: torch.Tensor, c: float = 1.0, warn: bool = False):
    fmodel, params = make_functional(model)
    fn, state = clipped_grad(lambda p, xb, yb: loss(fmodel(p, xb), yb), clipping_norm=c, batch_argnums=(1, 2),
                             clip_backend=backend, model=fmodel)
    if warn:
        return fn(params, x, _labels(torch.nan_to_num(x)), state=state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(params, x, _labels(torch.nan_to_num(x)), state=state)


def _leave_one_out(model: nn.Module, loss, x: torch.Tensor, c: float = 1.0) -> float:
    """||clipped sum(x) - clipped sum(x without its first example)|| / C with the vmap backend's
    clip of the BATCHED loss taken at face value (what accepting the model would release)."""
    fmodel, params = make_functional(model)
    params = tuple(p.detach().requires_grad_(True) for p in params)

    def clipped_sum(xb: torch.Tensor) -> torch.Tensor:
        total = None
        for i in range(xb.shape[0]):
            g = torch.autograd.grad(loss(fmodel(params, xb), _labels(xb))[i], params)
            flat = torch.cat([t.reshape(-1) for t in g])
            flat = flat * min(1.0, c / float(flat.norm()))
            total = flat if total is None else total + flat
        return total

    return float((clipped_sum(x) - clipped_sum(x[1:])).norm()) / c


def _identity(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def _batch_mean_term(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _ce(out + 0.01 * out.mean(0), y)  # a 1% batch-mean term


def _scaled_by_batch(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = _ce(out, y)
    return z * (4.0 / z.shape[0])  # reads the batch size: removing one example rescales all others


ATTACKS = {
    "reads-predecessor": (lambda: ReadsPredecessor(), _identity),
    "reads-predecessor-detached": (lambda: ReadsPredecessor(detach=True), _identity),
    "mixing-backward": (lambda: MixesInBackward(), _identity),
    "batch-mean-1pct": (lambda: Plain(), _batch_mean_term),
    "scaled-by-batch-size": (lambda: Plain(), _scaled_by_batch),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_every_mixing_attack_is_refused(attack, backend):
    make, loss = ATTACKS[attack]
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(7, D, dtype=torch.float64)
    with pytest.raises(InputValueError, match="mixes examples"):
        _clip(model, loss, backend, x)


@pytest.mark.parametrize("attack", ["reads-predecessor", "reads-predecessor-detached", "mixing-backward"])
def test_the_attacks_are_real_privacy_bugs(attack):
    # What refusing them protects: with the batched loss taken at face value, removing one example
    # moves the clipped sum by more than C (C / 1 is the bound the accountant assumes).
    make, loss = ATTACKS[attack]
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(7, D, dtype=torch.float64) * 3
    assert _leave_one_out(model, loss, x, c=0.05) > 1.05


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixing_beyond_the_first_examples_is_refused(backend):
    # Only examples 5 and 6 read anything (example 6 reads example 5): no pair among the first
    # three examples mixes, which is all the old probe compared.
    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(D, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if h.shape[0] > 6:
                h = torch.cat([h[:6], h[6:7] + 0.3 * h[5:6], h[7:]])
            return self.b(h)[:, 0]

    torch.manual_seed(1)
    with pytest.raises(InputValueError, match="mixes examples"):
        _clip(Late().double(), _identity, backend, torch.randn(PROBE_EXAMPLES, D, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_detached_read_just_above_the_tolerance_is_refused(backend):
    # Non-differentiable mixing is seen only through loss values, within sqrt(eps64) = 1.5e-8 of the
    # loss. Mixing at 4x that (a literal here, so a raised constant cannot move the test with it)
    # must be refused: this kills a tenfold-raised threshold.
    assert FORWARD_RTOL <= 2 ** -26
    class Faint(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(D, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            own = self.a(x)[:, 0]
            # +-1 from the predecessor's first feature (+1 for an example alone); no gradient path
            s = torch.sign(shift(x[:, :1])[:, 0] + 1e-3).detach()
            return own * (1 + 4 * 2 ** -26 * s)  # moves 8 tolerances when s flips

    torch.manual_seed(2)
    model = Faint().double()
    with torch.no_grad():
        model.a.bias.fill_(3.0)
    with pytest.raises(InputValueError, match="mixes examples"):
        _clip(model, _identity, backend, torch.randn(6, D, dtype=torch.float64))


def _same_as_vmap(backend: str, x: torch.Tensor) -> None:
    model = Plain().double()
    fast, _ = _clip(model, _ce, backend, x, c=0.2)
    ref, _ = _clip(model, _ce, "vmap", x, c=0.2)
    for a, b in zip(fast.pytree, ref.pytree):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_independent_models_pass_and_match_vmap(backend):
    torch.manual_seed(3)
    _same_as_vmap(backend, torch.randn(9, D, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_models_are_checked_too(backend):
    torch.manual_seed(4)
    with pytest.raises(InputValueError, match="mixes examples"):
        _clip(Plain(), _batch_mean_term, backend, torch.randn(7, D))
    _clip(Plain(), _ce, backend, torch.randn(7, D))  # and an independent one passes


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_examples_do_not_hide_mixing(backend):
    torch.manual_seed(5)
    x = torch.randn(7, D, dtype=torch.float64)
    x[0, 0] = float("nan")  # the first example (the old probe's) is NaN
    with pytest.raises(InputValueError, match="mixes examples"):
        _clip(MixesInBackward().double(), _identity, backend, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_examples_alone_are_not_mixing(backend):
    torch.manual_seed(6)
    x = torch.randn(7, D, dtype=torch.float64)
    x[2, 1] = float("nan")
    x[5, 0] = float("inf")
    _same_as_vmap(backend, x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reads", ["predecessor", "successor", "only-first-reads-second"])
def test_a_differentiable_dependence_of_any_size_is_refused(backend, reads):
    # 1e-12 of a neighbour: far below any loss tolerance, but a structural nonzero in the backward
    # (the gradient check has no threshold). Both directions, and one pair alone (example 0 reads
    # example 1: only a seed that holds 0 and not 1 sees it, so both halves of the seed groups matter).
    class Faint(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(D, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if reads == "predecessor":
                other = shift(h)
            elif reads == "successor":
                other = torch.flip(shift(torch.flip(h, [0])), [0])
            else:
                other = torch.cat([h[1:2], torch.zeros_like(h[1:])])
            return self.b(h + 1e-12 * other)[:, 0]

    torch.manual_seed(7)
    with pytest.raises(InputValueError, match="mixes examples: in the backward pass"):
        _clip(Faint().double(), _identity, backend, torch.randn(6, D, dtype=torch.float64))


def _noisy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _ce(out + 0.1 * torch.randn_like(out), y)  # noise from torch's global generator, even in eval mode


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loss_drawing_global_random_numbers_takes_the_exact_path_not_a_refusal(backend):
    # An example alone cannot equal itself in the batch when the loss draws noise: randomness, not
    # mixing. The exact per-example path runs, and says why.
    torch.manual_seed(8)
    with pytest.warns(SlowPathWarning, match="draws random numbers"):
        clipped, _ = _clip(Plain().double(), _noisy, backend, torch.randn(6, D, dtype=torch.float64), warn=True)
    assert all(torch.isfinite(t).all() for t in clipped.pytree)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_guard_leaves_the_callers_random_stream_alone(backend):
    # The first call runs the guard (which draws, through the loss) and then the exact path; a later
    # call runs the exact path only. From the same seed both must leave the same stream behind.
    x = torch.randn(6, D, dtype=torch.float64)
    fmodel, params = make_functional(Plain().double())
    fn, state = clipped_grad(lambda p, xb, yb: _noisy(fmodel(p, xb), yb), clipping_norm=1.0, batch_argnums=(1, 2),
                             clip_backend=backend, model=fmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(9)
        first, _ = fn(params, x, _labels(x), state=state)
        after_first = torch.rand(3)
        torch.manual_seed(9)
        again, _ = fn(params, x, _labels(x), state=state)
    assert torch.equal(torch.rand(3), after_first)
    for a, b in zip(first.pytree, again.pytree):
        assert torch.equal(a, b)


class _RolledBroadcast(nn.Module):
    """A parameter broadcast to the batch (tapped by the elementwise rule), then rolled along
    the batch: the rows are identical, so no value changes, but example i's loss now reads
    row i - 1 of the broadcast, and the rule would give example i - 1 its gradient."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.lin = nn.Linear(3, 4)
        self.pos = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        ones = torch.ones_like(h).detach()
        b = ones + self.pos if self.op == "add" else ones * self.pos
        return (h * b.roll(1, 0)).sum(1)


@pytest.mark.parametrize("op", ["add", "mul"])
@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_mixing_seen_only_in_a_parameter_broadcast_is_refused(backend, op):
    # The guard watched the broadcast's value, which the op did not use (no gradient reached it):
    # this passed the guard before, and the per-example norms of `pos` went to the wrong examples.
    model = _RolledBroadcast(op).double()
    fmodel, params = make_functional(model)
    fn, state = clipped_grad(lambda p, x: fmodel(p, x), clipping_norm=1.0, batch_argnums=1, clip_backend=backend,
                             model=fmodel)
    with pytest.raises(InputValueError, match="mixes examples"):
        fn(params, torch.randn(6, 3, dtype=torch.float64), state=state)

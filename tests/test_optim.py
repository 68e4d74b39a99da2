"""Optimisers vs torch.optim on the same gradients (float64), state round trip, LR schedules."""
import numpy
import pytest

from refimpl.nn.parameter import Parameter
from refimpl.optim import (MLPERF_COSMOFLOW, SGD, Adam, Schedule, make_optimizer, parse_decay,
                           scaled_lr)

SHAPES = [(3, 2, 3, 3, 3), (3,), (4, 5)]


def make_params(seed):
    rng = numpy.random.default_rng(seed)
    return [Parameter(rng.standard_normal(s), f"p{i}") for i, s in enumerate(SHAPES)]


def grads(seed, steps):
    rng = numpy.random.default_rng(seed + 1000)
    return [[rng.standard_normal(s) for s in SHAPES] for _ in range(steps)]


def rel_err(a, b):
    return float(numpy.max(numpy.abs(a - b)) / numpy.max(numpy.abs(b)))


CASES = [
    ("sgd", dict(lr=0.1, momentum=0.0)),
    ("sgd", dict(lr=0.05, momentum=0.9)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("adam", dict(lr=1e-2)),
    ("adam", dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2)),
]


@pytest.mark.parametrize("name,kwargs", CASES)
def test_matches_torch(name, kwargs):
    torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
    params = make_params(0)
    tparams = [torch.tensor(p.data.copy(), requires_grad=True) for p in params]
    ours = SGD(params, **kwargs) if name == "sgd" else Adam(params, **kwargs)
    theirs = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(tparams, **kwargs)
    for step_grads in grads(0, 6):
        for p, tp, g in zip(params, tparams, step_grads):
            p.grad = g.copy()
            tp.grad = torch.tensor(g)
        ours.step()
        theirs.step()
    for p, tp in zip(params, tparams):
        assert rel_err(p.data, tp.detach().numpy()) < 1e-13


def test_update_in_place_and_skips_missing_grad():
    params = make_params(1)
    arrays = [p.data for p in params]
    before, before0 = params[1].data.copy(), params[0].data.copy()
    opt = make_optimizer("sgd", params, lr=0.1, momentum=0.9)
    for p, g in zip(params, grads(1, 1)[0]):
        p.grad = g
    params[1].grad = None
    opt.step()
    assert all(p.data is a for p, a in zip(params, arrays))
    assert numpy.array_equal(params[1].data, before)
    assert not numpy.array_equal(params[0].data, before0)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_state_round_trip_is_bit_exact(name):
    """Stop after 3 steps, restore into a fresh optimiser: the next steps match bit for bit."""
    g = grads(2, 6)
    params_a = make_params(2)
    opt_a = make_optimizer(name, params_a, lr=0.01, momentum=0.9)
    params_b = make_params(2)
    opt_b = make_optimizer(name, params_b, lr=0.01, momentum=0.9)
    for t in range(6):
        for p, gi in zip(params_a, g[t]):
            p.grad = gi
        opt_a.step()
        if t < 3:
            for p, gi in zip(params_b, g[t]):
                p.grad = gi
            opt_b.step()
    state = opt_b.state_dict()
    params_c = [Parameter(p.data.copy(), p.name) for p in params_b]
    opt_c = make_optimizer(name, params_c, lr=99.0)
    opt_c.load_state_dict(state)
    assert opt_c.lr == 0.01 and opt_c.step_count == 3
    for t in range(3, 6):
        for p, gi in zip(params_c, g[t]):
            p.grad = gi
        opt_c.step()
    for a, c in zip(params_a, params_c):
        assert numpy.array_equal(a.data, c.data)


def test_bad_arguments():
    params = make_params(3)
    with pytest.raises(ValueError, match="lr"):
        SGD(params, lr=-1.0)
    with pytest.raises(ValueError, match="nesterov"):
        SGD(params, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        Adam(params, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="optimizer"):
        make_optimizer("lamb", params, lr=0.1)
    opt = SGD(params, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="Adam"):
        opt.load_state_dict(Adam(params).state_dict())
    bad = {"name": "SGD", "step_count": 1, "lr": 0.1, "arrays": {"momentum_buffer.0": numpy.zeros(3)}}
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(bad)


def test_linear_scaling():
    assert scaled_lr(0.001, 256, 64) == pytest.approx(0.004)
    assert scaled_lr(0.1, 8, None) == 0.1


def test_constant_with_warmup():
    s = Schedule("constant", 0.4, warmup_steps=4)
    assert [s(t) for t in range(6)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])


def test_step_decay():
    s = Schedule("step", 1.0, milestones=parse_decay("5:0.5,3:0.1"))
    # factors are relative to the peak (not cumulative) and sorted by step
    assert [s(t) for t in range(7)] == pytest.approx([1, 1, 1, 0.1, 0.1, 0.5, 0.5])
    assert parse_decay({32: 0.25, 64: 0.125}) == ((32, 0.25), (64, 0.125))
    with pytest.raises(ValueError, match="STEP:FACTOR"):
        parse_decay("10=0.5")


def test_mlperf_schedule_matches_reference_rule():
    """base 0.001 at batch 64, global batch 256 -> peak 0.004; 4 warmup epochs; decays after 32, 64."""
    cfg = MLPERF_COSMOFLOW
    peak = scaled_lr(cfg["lr"], 256, cfg["base_batch"])
    s = Schedule("mlperf", peak, base_lr=cfg["lr"], steps_per_epoch=10,
                 warmup_epochs=cfg["warmup_epochs"], decay_epochs=parse_decay(cfg["decay_epochs"]))
    epoch_lr = {e: s(10 * e + 3) for e in (0, 1, 2, 3, 4, 32, 33, 64, 65, 100)}
    assert epoch_lr[0] == pytest.approx(0.001)
    assert epoch_lr[2] == pytest.approx(0.001 + 2 * 0.003 / 4)
    assert epoch_lr[4] == pytest.approx(0.004)
    assert epoch_lr[32] == pytest.approx(0.004)          # decay applies once epoch > 32
    assert epoch_lr[33] == pytest.approx(0.001)
    assert epoch_lr[64] == pytest.approx(0.001)
    assert epoch_lr[65] == pytest.approx(0.0005)
    assert epoch_lr[100] == pytest.approx(0.0005)


def test_schedule_rejects_bad_values():
    with pytest.raises(ValueError, match="schedule"):
        Schedule("cosine", 0.1)
    with pytest.raises(ValueError, match="warmup_steps"):
        Schedule("constant", 0.1, warmup_steps=-1)

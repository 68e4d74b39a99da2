"""Optimisers (SGD with momentum, Adam) and learning-rate schedules.

The optimisers follow ``torch.optim`` exactly (same update formulas, same
state), so that a run can be checked step by step against PyTorch:

- SGD (``torch.optim.SGD``):   g <- grad + wd p;  b <- g on the first step,
  b <- mu b + (1 - dampening) g after;  g <- g + mu b (Nesterov) or b;
  p <- p - lr g.
- Adam (``torch.optim.Adam``, L2 weight decay): g <- grad + wd p;
  m <- m + (1 - b1)(g - m);  v <- b2 v + (1 - b2) g^2;
  p <- p - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps).

Updates are in place (``p.data`` keeps its identity, so layers and gradient
buckets holding the array stay valid) and xp-generic.  The state is arrays
(one per parameter and slot) plus the step count; ``state_dict`` returns host
copies for checkpoints and ``load_state_dict`` puts them back bit for bit.

Every rank holds the same synchronised gradients, so every rank computes the
same update: no message is needed here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .backend import array_module, to_host


class Optimizer:
    """Base: a list of Parameters, a learning rate and per-parameter state slots."""

    slots: tuple[str, ...] = ()

    def __init__(self, params, lr: float, weight_decay: float = 0.0):
        self.params = list(params)
        if not self.params:
            raise ValueError("params is empty: the model has no parameters to optimise")
        _check_nonneg("lr", lr)
        _check_nonneg("weight_decay", weight_decay)
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        self.step_count = 0
        self.state: list[dict] = [{} for _ in self.params]   # slot name -> array, per parameter

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def step(self) -> None:
        """One update of every parameter that has a gradient (with ``self.lr``)."""
        self.step_count += 1
        for index, param in enumerate(self.params):
            if param.grad is not None:
                self.apply(index, param.grad)

    def apply(self, index: int, grad) -> None:
        """The update of parameter ``index`` with gradient ``grad``, at the current ``step_count``
        and ``lr``: ``step`` is a count increment and one ``apply`` per parameter, which lets
        ``parallel/priority.LayerwiseUpdate`` apply each layer's update when it is needed."""
        param = self.params[index]
        if self.weight_decay:
            grad = grad + self.weight_decay * param.data
        self._update(param.data, grad, self.state[index])

    def _update(self, p, g, state) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """{"step_count", "lr", "arrays": {"<slot>.<param index>": host array}}."""
        arrays = {f"{slot}.{i}": to_host(a).copy()
                  for i, state in enumerate(self.state) for slot, a in state.items()}
        return {"name": type(self).__name__, "step_count": self.step_count, "lr": self.lr,
                "arrays": arrays}

    def load_state_dict(self, state: dict) -> None:
        """Restore exactly what ``state_dict`` returned (ValueError on a mismatch)."""
        if state.get("name") != type(self).__name__:
            raise ValueError(f"optimizer state is for {state.get('name')!r}, this is {type(self).__name__}")
        fresh = [{} for _ in self.params]
        for key, value in state["arrays"].items():
            slot, _, index = key.rpartition(".")
            i = int(index)
            if slot not in self.slots or not 0 <= i < len(self.params):
                raise ValueError(f"optimizer state has unknown entry {key!r}")
            p = self.params[i].data
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)}, "
                                 f"parameter {self.params[i].name!r} has {tuple(p.shape)}")
            fresh[i][slot] = array_module(p).asarray(value, dtype=p.dtype).copy()
        self.state = fresh
        self.step_count = int(state["step_count"])
        self.lr = float(state["lr"])


class SGD(Optimizer):
    """SGD with (Nesterov) momentum and L2 weight decay, as torch.optim.SGD."""

    slots = ("momentum_buffer",)

    def __init__(self, params, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0):
        super().__init__(params, lr, weight_decay)
        _check_nonneg("momentum", momentum)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening == 0 (as torch.optim.SGD)")
        self.momentum, self.dampening, self.nesterov = float(momentum), float(dampening), bool(nesterov)

    def _update(self, p, g, state) -> None:
        if self.momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.copy()
            else:
                buf *= self.momentum
                buf += (1.0 - self.dampening) * g
            g = g + self.momentum * buf if self.nesterov else buf
        p -= self.lr * g


class Adam(Optimizer):
    """Adam with bias correction and L2 weight decay, as torch.optim.Adam (amsgrad=False)."""

    slots = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, lr, weight_decay)
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas!r}")
        _check_nonneg("eps", eps)
        self.betas, self.eps = (b1, b2), float(eps)

    def _update(self, p, g, state) -> None:
        xp = array_module(p)
        b1, b2 = self.betas
        if "exp_avg" not in state:
            state["exp_avg"], state["exp_avg_sq"] = xp.zeros_like(p), xp.zeros_like(p)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m += (1.0 - b1) * (g - m)            # torch's lerp form of b1 m + (1 - b1) g
        v *= b2
        v += (1.0 - b2) * (g * g)
        t = self.step_count
        step_size = self.lr / (1.0 - b1 ** t)
        denom = xp.sqrt(v) / math.sqrt(1.0 - b2 ** t) + self.eps
        p -= step_size * (m / denom)


OPTIMIZERS = {"sgd": SGD, "adam": Adam}


def make_optimizer(name: str, params, lr: float, momentum: float = 0.9, nesterov: bool = False,
                   weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8) -> Optimizer:
    """The optimiser ``name`` ('sgd' | 'adam') over ``params``."""
    if name == "sgd":
        return SGD(params, lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    if name == "adam":
        return Adam(params, lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}")


# ---------------------------------------------------------------- learning-rate schedules

# MLPerf HPC CosmoFlow reference (mlcommons/hpc, cosmoflow/configs/cosmo.yaml and
# utils/optimizers.py): SGD, momentum 0.9; base_lr 0.001 at base_batch_size 64, scaled
# linearly with the global batch; 4 warmup epochs ramping from base_lr to the scaled lr;
# then the scaled lr times 0.25 after epoch 32 and times 0.125 after epoch 64.
MLPERF_COSMOFLOW = {"optimizer": "sgd", "momentum": 0.9, "lr": 0.001, "base_batch": 64,
                    "warmup_epochs": 4, "decay_epochs": {32: 0.25, 64: 0.125}}


def scaled_lr(base_lr: float, global_batch: int, base_batch: int | None) -> float:
    """Linear scaling rule (Goyal et al. 2017): lr = base_lr * global_batch / base_batch."""
    if base_batch is None:
        return float(base_lr)
    if base_batch < 1:
        raise ValueError(f"base_batch must be >= 1, got {base_batch}")
    return float(base_lr) * global_batch / base_batch


@dataclass(frozen=True)
class Schedule:
    """lr as a function of the step (0-based, the step about to be taken).

    ``kind``:
    - "constant": ``peak_lr`` after an optional linear warmup;
    - "step": ``peak_lr * factor`` of the last ``(step, factor)`` milestone reached
      (``step >= milestone``), after the warmup; factors are relative to peak_lr,
      not cumulative (as the MLPerf reference);
    - "mlperf": the MLPerf CosmoFlow rule, per *epoch* e = step // steps_per_epoch:
      e < warmup_epochs: base_lr + e (peak_lr - base_lr) / warmup_epochs; after:
      peak_lr * factor of the latest decay epoch E with E < e.

    The generic warmup is ``peak_lr * (step + 1) / warmup_steps`` for
    step < warmup_steps: it never takes a step with lr 0 and reaches peak_lr on
    the last warmup step.
    """
    kind: str
    peak_lr: float
    warmup_steps: int = 0
    milestones: tuple = ()            # ((step, factor), ...) for "step"
    base_lr: float = 0.0              # "mlperf": lr at epoch 0
    steps_per_epoch: int = 1          # "mlperf"
    warmup_epochs: int = 0            # "mlperf"
    decay_epochs: tuple = ()          # ((epoch, factor), ...) for "mlperf"

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.kind!r}")
        _check_nonneg("lr", self.peak_lr)
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {self.steps_per_epoch}")
        for name, pairs in (("decay", self.milestones), ("decay_epochs", self.decay_epochs)):
            for at, factor in pairs:
                if int(at) != at or at < 0 or not factor >= 0:
                    raise ValueError(f"{name} entries must be (step >= 0, factor >= 0), got {pairs!r}")

    def __call__(self, step: int) -> float:
        if self.kind == "mlperf":
            epoch = step // self.steps_per_epoch
            if epoch < self.warmup_epochs:
                return self.base_lr + epoch * (self.peak_lr - self.base_lr) / self.warmup_epochs
            factor = 1.0
            for at, f in sorted(self.decay_epochs):
                if at < epoch:
                    factor = f
            return self.peak_lr * factor
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        factor = 1.0
        if self.kind == "step":
            for at, f in sorted(self.milestones):
                if step >= at:
                    factor = f
        return self.peak_lr * factor


SCHEDULES = ("constant", "step", "mlperf")


def parse_decay(text) -> tuple:
    """'100:0.25,200:0.125' (or a dict / list of pairs) -> ((100, 0.25), (200, 0.125))."""
    if text is None or text == "":
        return ()
    if isinstance(text, dict):
        pairs = list(text.items())
    elif isinstance(text, str):
        pairs = []
        for part in text.split(","):
            at, sep, factor = part.partition(":")
            if not sep:
                raise ValueError(f"decay must be comma-separated STEP:FACTOR pairs, got {text!r}")
            pairs.append((at, factor))
    else:
        pairs = list(text)
    try:
        return tuple(sorted((int(at), float(f)) for at, f in pairs))
    except (TypeError, ValueError):
        raise ValueError(f"decay must be STEP:FACTOR pairs of an int and a float, got {text!r}") from None


def _check_nonneg(name, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


__all__ = ["Optimizer", "SGD", "Adam", "OPTIMIZERS", "make_optimizer", "MLPERF_COSMOFLOW",
           "scaled_lr", "Schedule", "SCHEDULES", "parse_decay"]

"""``Module``: a layer with parameters, buffers, sub-layers and a hand-written backward.

There is no autograd: ``forward(x)`` keeps what its backward needs, and
``backward(dy) -> dx`` uses it once, *accumulates* the parameter gradients with
``Parameter.accumulate_grad`` (which fires the gradient-synchronisation hook)
and returns the input gradient.  Containers call their children's backward in
reverse order.

Names follow PyTorch (``"0.weight"``, ``"3.running_mean"``), so a ``state_dict``
maps one to one onto the equivalent torch model's.  Registration order is the
order of ``parameters()``, which gradient bucketing relies on.
"""
from __future__ import annotations

from ..backend import array_module, to_host
from ..progress import phase
from .parameter import Parameter


class Module:
    def __init__(self):
        self._parameters: dict[str, Parameter] = {}
        self._buffers: dict[str, object] = {}    # arrays updated in place (running stats)
        self._modules: dict[str, Module] = {}
        self._cache = None                         # what forward keeps for backward
        self.training = True

    # ------------------------------------------------------------ registration
    def add_parameter(self, name: str, data) -> Parameter:
        param = Parameter(data, name)
        self._parameters[name] = param
        return param

    def add_buffer(self, name: str, data):
        self._buffers[name] = data
        return data

    def add_module(self, name: str, module: "Module") -> "Module":
        if not isinstance(module, Module):
            raise ValueError(f"module {name!r} must be a refimpl.nn Module, got {type(module).__name__}")
        self._modules[name] = module
        for sub, param in module.named_parameters():
            param.name = f"{name}.{sub}"
        return module

    # ------------------------------------------------------------ computation
    def forward(self, x):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def __call__(self, x):
        return self.forward(x)

    def setup(self, global_in_shape):
        """Prepare for inputs of global spatial extent (D, H, W); returns the output's extent.

        Pointwise layers keep the extent (this default).  Window layers compute theirs;
        their spatially partitioned versions also build their halo plans here (pure
        index math, no message), which is why models call it once before training.
        """
        return tuple(global_in_shape)

    def _save(self, *values):
        self._cache = values

    def _saved(self):
        """The values saved by forward, released so memory is freed after backward."""
        if self._cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward called without a forward before it")
        values, self._cache = self._cache, None
        return values

    # ------------------------------------------------------------ traversal
    def children(self):
        return list(self._modules.values())

    def named_parameters(self, prefix: str = ""):
        """(name, Parameter) pairs: this module's in registration order, then each child's."""
        out = [(prefix + name, p) for name, p in self._parameters.items()]
        for name, child in self._modules.items():
            out += child.named_parameters(f"{prefix}{name}.")
        return out

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def named_modules(self, prefix: str = ""):
        """(name, module) pairs, this module first ('' for the root), then each child's."""
        out = [(prefix.rstrip("."), self)]
        for name, child in self._modules.items():
            out += child.named_modules(f"{prefix}{name}.")
        return out

    def named_buffers(self, prefix: str = ""):
        out = [(prefix + name, b) for name, b in self._buffers.items()]
        for name, child in self._modules.items():
            out += child.named_buffers(f"{prefix}{name}.")
        return out

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def train(self, mode: bool = True) -> "Module":
        self.training = mode
        for child in self._modules.values():
            child.train(mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Host (NumPy) copies of every parameter and buffer, PyTorch-style names."""
        state = {name: to_host(p.data).copy() for name, p in self.named_parameters()}
        state.update({name: to_host(b).copy() for name, b in self.named_buffers()})
        return state

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy values into the existing arrays (in place, so optimiser references stay valid)."""
        targets = {name: p.data for name, p in self.named_parameters()}
        targets.update(self.named_buffers())
        if strict:
            missing = sorted(set(targets) - set(state))
            unexpected = sorted(set(state) - set(targets))
            if missing or unexpected:
                raise ValueError(f"state_dict does not match the model: missing {missing}, "
                                 f"unexpected {unexpected}")
        for name, target in targets.items():
            if name not in state:
                continue
            value = state[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"state_dict[{name!r}] has shape {tuple(value.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
            target[...] = array_module(target).asarray(value, dtype=target.dtype)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not self._modules:
            return head + ")"
        lines = [f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in self._modules.items()]
        return head + "\n" + "\n".join(lines) + "\n)"


class Sequential(Module):
    """Layers applied in order; backward runs them in reverse.

    **Max pooling before the activation in front of it.**  Where a max-pooling layer
    (``pools_by_max``) directly follows an activation ``f`` that is non-decreasing
    (``commutes_with_max``: ReLU, LeakyReLU with a slope >= 0), the pair runs pool first,
    then ``f`` on the pooled block (backward: ``f``'s, then the pool's).  Why it is the same
    function: for a non-decreasing ``f``, ``max(f(a), f(b)) = f(max(a, b))``, and in floating
    point too, since ``f`` is ``x`` or a rounded ``slope * x`` and rounding is monotone; so
    the output has the same values (NaN included), and ``f`` costs an eighth of what it did
    behind a 2 x 2 x 2 pool (CosmoFlow's activations; docs/benchmarks.md).  They are the same
    bits wherever ``f`` keeps the window's inputs apart; where it maps two different inputs of
    one window to one value -- LeakyReLU rounding ``slope * x`` of two negative inputs within
    about an ulp to one float32 (a few windows in millions), or a negative input below about
    1e-43 to -0 next to a +0 (the output is then a zero whose sign may differ) -- the written
    order sends the gradient to the first of the tie and this order to the larger input; ReLU's
    ties (inputs <= 0) carry a zero gradient either way, and its outputs are the same bits
    (docs/derivations.md, "Pooling").  When the pool is the container's last layer the
    activation's backward gets a copy of the caller's gradient (an eighth of its size), so that
    its ``reuse_grad`` never writes over an array the caller holds.  ``pool_first=False`` keeps
    the written order.  ``setup``, ``state_dict`` and the layers' names keep the written order;
    so do the oracle's traces, which run the layers one by one; the models' ``describe()`` (the
    planner's layer list) prices such an activation on the pooled extent.
    """

    def __init__(self, *layers: Module, pool_first: bool = True):
        super().__init__()
        if not isinstance(pool_first, bool):
            raise ValueError(f"pool_first must be True or False, got {pool_first!r}")
        self.pool_first = pool_first
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)

    def run_order(self) -> list:
        """The layers in the order ``forward`` runs them (see the class docstring)."""
        layers, order, i = list(self._modules.values()), [], 0
        while i < len(layers):
            if (self.pool_first and i + 1 < len(layers) and getattr(layers[i], "commutes_with_max", False)
                    and getattr(layers[i + 1], "pools_by_max", False)):
                order += [layers[i + 1], layers[i]]
                i += 2
            else:
                order.append(layers[i])
                i += 1
        return order

    def forward(self, x):
        for layer in self.run_order():
            phase("forward of {layer}", layer)        # for the watchdog's stall messages
            x = layer.forward(x)
        return x

    def backward(self, dy):
        order = self.run_order()
        if order and order[-1] is not next(reversed(self._modules.values())):
            dy = dy.copy()              # a swapped activation runs first: the caller's dy stays as given
        for layer in reversed(order):
            phase("backward of {layer}", layer)
            dy = layer.backward(dy)
        return dy

    def setup(self, global_in_shape):
        for layer in self._modules.values():
            global_in_shape = layer.setup(global_in_shape)
        return global_in_shape

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


__all__ = ["Module", "Sequential"]

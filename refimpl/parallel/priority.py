"""The update of each layer applied just before that layer's next forward (MLSL's prioritised
gradient exchange, Sridharan et al. 2018).

A plain data-parallel step ends with ``sync.finish()`` (wait for every bucket) and
``optimizer.step()`` (update every parameter); the next forward starts only after the slowest
bucket is summed and the whole model updated.  But the next forward needs the layers in
forward order: the first layer's parameters now, the dense head's only at the end.  So:

    step(lr)        after backward: start every bucket not yet started, the input side first
                    (``GradientSynchronizer(priority="input-first")``), count the optimizer's step,
                    and return at once -- every bucket is *owed*;
    forward         before a layer with parameters runs, each owed bucket holding one of them is
                    waited for (``sync.wait_bucket``) and its parameters updated
                    (``optimizer.apply``): the first layer waits only for its own small bucket,
                    which was started first, while the large output-side buckets are still
                    being summed behind the forward;
    flush()         whatever is still owed (before a checkpoint, at the end, and before the next
                    backward refills the buffers).

Exactness: every parameter gets the same update as ``finish(); step()``, from the same summed
gradient (the chunks of a bucket add the same numbers; only the order in which the reduction
adds the ranks' contributions may differ) at the same ``lr`` and step count.

With ``priority="none"`` ``step`` is exactly ``finish(); optimizer.step()``, so the two can be
timed by one loop: ``marks`` records, per step, the end of backward and the start of the next
forward's first layer (``gaps``: the seconds between them).
"""
from __future__ import annotations

import time


class LayerwiseUpdate:
    """``sync.finish`` + ``optimizer.step``, deferred layer by layer into the next forward when
    ``sync.priority`` is "input-first".

    ``model``: the module whose forward runs next (every sub-module owning parameters gets a
    hook in front of its forward); ``sync``: its ``GradientSynchronizer``; ``optimizer``: a
    ``refimpl.optim`` optimizer over the same parameters.
    """

    def __init__(self, model, sync, optimizer):
        self.sync, self.optimizer = sync, optimizer
        self.deferred = sync.priority != "none"
        self._index = {id(p): i for i, p in enumerate(optimizer.params)}
        if set(self._index) != {id(p) for b in sync.buckets for p in b.params}:
            raise ValueError("the optimizer and the synchroniser must hold the same parameters")
        self.owed = set()            # ids of buckets summed (or being summed) but not yet applied
        self.marks = []              # per step: (end of backward, next forward's first layer), perf_counter
        self._backward_end = None
        for _, module in model.named_modules():
            if module._parameters:
                self._hook(module)
        sync.before_backward = self.flush

    def _hook(self, module) -> None:
        """Run ``before_forward(module)`` ahead of ``module.forward`` (an instance attribute
        over the class's method, so every caller goes through it)."""
        forward = module.forward

        def hooked(*args, **kwargs):
            self.before_forward(module)
            return forward(*args, **kwargs)
        module.forward = hooked

    def step(self, lr: float) -> None:
        """End of backward: the gradient exchange and the optimizer step at ``lr``."""
        self.flush()
        self.optimizer.lr = lr
        self._backward_end = time.perf_counter()
        if not self.deferred:
            self.sync.finish()
            self.optimizer.step()
            return
        self.sync.finish(wait=False)
        self.optimizer.step_count += 1      # the step's updates are applied as layers need them
        self.owed = {id(b) for b in self.sync.buckets}

    def before_forward(self, module) -> None:
        """Apply the owed updates of ``module``'s parameters; note the first layer's start."""
        if self.owed:
            for param in module._parameters.values():
                bucket = self.sync.bucket_of(param)
                if id(bucket) in self.owed:
                    self._apply(bucket)
        if self._backward_end is not None:
            self.marks.append((self._backward_end, time.perf_counter()))
            self._backward_end = None

    @property
    def gaps(self) -> list:
        """Seconds from the end of each backward to the start of the next forward's first layer."""
        return [start - end for end, start in self.marks]

    def _apply(self, bucket) -> None:
        self.sync.wait_bucket(bucket)
        for param, grad in self.sync.gradients(bucket):
            self.optimizer.apply(self._index[id(param)], grad)
        self.owed.discard(id(bucket))

    def flush(self) -> None:
        """Apply every owed update (input side first)."""
        for bucket in sorted(self.sync.buckets, key=lambda b: -b.priority):
            if id(bucket) in self.owed:
                self._apply(bucket)

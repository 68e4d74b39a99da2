"""What the main thread is doing: the phase labels the fail-stop watchdog reports.

The layers, the training loop and the planner mark each phase they enter (``phase``:
*halo exchange of features.3 (forward)*, *gradient allreduce*, *checkpoint write*) and
each step (``set_step``): two stores and an increment, cheap enough for every layer of
every step.  The watchdog thread (refimpl/watchdog.py) reads ``PROGRESS`` to tell a rank
that moves from one that hangs, and to name the phase a stalled job waits in; a failure
or an interrupt names it too.  Nothing here sends a message or starts a thread.
"""
from __future__ import annotations


class Progress:
    """The main thread's current phase, read by the watchdog thread (GIL-atomic stores)."""

    __slots__ = ("count", "step", "phase", "layer", "names", "saved")

    def __init__(self):
        self.count, self.step, self.phase, self.layer, self.names = 0, None, "start-up", None, {}
        self.saved = None        # what an interrupted run keeps: 'the last checkpoint is step 40'

    def where(self) -> str:
        """'halo exchange of features.3 (forward) at step 12'."""
        text = self.phase
        if self.layer is not None:
            name = self.names.get(id(self.layer)) or type(self.layer).__name__
            text = text.replace("{layer}", name)
        return text + (f" at step {self.step}" if self.step is not None else "")


PROGRESS = Progress()


def phase(what: str, layer=None) -> None:
    """Record that the main thread now does ``what`` ('{layer}' is replaced by ``layer``'s name)."""
    p = PROGRESS
    p.phase, p.layer = what, layer
    p.count += 1


def set_step(step) -> None:
    PROGRESS.step = step
    PROGRESS.count += 1


def label_layers(model) -> None:
    """Name the layers of ``model`` for stall messages (PyTorch-style dotted names)."""
    PROGRESS.names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}

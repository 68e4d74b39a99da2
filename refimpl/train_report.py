"""What a training run reports: its files in OUT, its lines on rank 0's stdout, the progress bar.

And where its last checkpoint is, for the message of an interruption
(``PROGRESS.saved``, refimpl/failstop.py) or of a divergence.

OUT receives checkpoint.h5 (refimpl/checkpoint.py), metrics.jsonl (one JSON line
per training step and per validation), loss.png (drawn from metrics.jsonl at each
checkpoint), config.json (the settings the run used) and summary.json (the
run's totals).  Apart from the loop (refimpl/train_loop.py) so that what is
trained and what is said about it can each be read alone.

Rank 0 writes for every rank, in ``on_root``: a failed write (disk full) raises
``WriteError`` on every rank, never leaves the others waiting in the next
collective.  So every ``RunReport`` method that writes is collective: every rank
calls it, at the same point of the run.  Each file is written whole
(``atomic_write``) except metrics.jsonl, appended one line per step, so that a
run killed between checkpoints keeps its metrics up to its last step; a resumed
run first cuts the lines after its checkpoint's step (``truncate_metrics``).
"""
from __future__ import annotations

import json
import os
import sys
import time

from .atomic import atomic_write
from .errors import WriteError
from .failstop import on_root
from .progress import PROGRESS, phase

CHECKPOINT = "checkpoint.h5"
METRICS = "metrics.jsonl"
PLOT = "loss.png"
CONFIG = "config.json"
SUMMARY = "summary.json"
RUN_FILES = (CHECKPOINT, METRICS, PLOT, CONFIG, SUMMARY)      # what a run writes into OUT


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``M:SS`` under an hour) of a non-negative number of seconds, rounded up."""
    total = int(-(-max(0.0, seconds) // 1))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class RunReport:
    """Rank 0's account of one run: config.json, metrics lines, the plot, the summary, the log lines;
    every rank's record of the last checkpoint."""

    def __init__(self, config: dict, comm, metric_name: str):
        self.config, self.comm, self.metric_name = config, comm, metric_name
        self.out = config["out"]
        self.talks = comm.Get_rank() == 0 and not config["quiet"]     # only rank 0 prints, unless --quiet
        self.bar = None
        self._since = None           # (clock, step) at ``start``: the pace the log lines' ETA uses
        self.last_saved = None       # the step of the last checkpoint (``saved``)

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)

    def say(self, line: str) -> None:
        if self.talks:
            print(line, flush=True)

    def start(self, step: int, total_steps: int, lines) -> None:
        """OUT made, metrics cut back to ``step``, config.json written; ``lines`` said; the bar opened."""
        from tqdm import tqdm
        phase("writing config.json (rank 0)")
        on_root(self.comm, self._start_outputs, step, error=WriteError)
        for line in lines:
            self.say(line)
        # the bar only on a terminal: redirected into a job log its redraws would fill the file
        # (the log lines on stdout, every --log-every steps, report the progress there)
        self.bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True,
                        disable=not self.talks or not sys.stderr.isatty(), file=sys.stderr)
        self._since = (time.perf_counter(), step)     # the ETA of the log lines: this run's pace so far

    def _start_outputs(self, step: int) -> None:
        os.makedirs(self.out, exist_ok=True)
        truncate_metrics(self.path(METRICS), step)
        write_json(self.path(CONFIG), self.config, indent=2, sort_keys=True)

    def train_step(self, record: dict, total_steps: int) -> None:
        """One training step's metrics line, the bar moved on, and every --log-every steps a log line."""
        self._write_metrics(record)
        name, step = self.metric_name, record["step"]
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4g}", **{name: f"{record[name]:.4g}"})
        if (step % self.config["log_every"] == 0 or step == total_steps) and self.talks:
            self.bar.write(f"step {step:>5}/{total_steps} | epoch {record['epoch']} | "
                           f"loss {record['loss']:.5g} | {name} {record[name]:.4g} | lr {record['lr']:.3g} | "
                           f"{record['samples_per_s']:.1f} samples/s{self._eta(step, total_steps)}", file=sys.stdout)

    def _eta(self, step: int, total_steps: int) -> str:
        """`` | eta H:MM:SS`` for the steps left at this run's pace so far (its validations and
        checkpoints included), for the log lines of a job log, where no bar is drawn; empty at
        the last step."""
        if self._since is None:
            return ""
        t0, step0 = self._since
        if step >= total_steps or step <= step0:
            return ""
        left = (time.perf_counter() - t0) / (step - step0) * (total_steps - step)
        return f" | eta {format_duration(left)}"

    def validation(self, record: dict) -> None:
        """One validation's metrics line and its log line."""
        self._write_metrics(record)
        if self.talks:
            self.bar.write(f"  val @ step {record['step']}: loss {record['loss']:.5g} | {self.metric_name} "
                           f"{record[self.metric_name]:.4g}", file=sys.stdout)

    def _write_metrics(self, record: dict) -> None:
        phase("writing metrics (rank 0)")
        on_root(self.comm, append_line, self.path(METRICS), json.dumps(record), error=WriteError)

    def plot(self) -> None:
        """loss.png redrawn from metrics.jsonl (unless --no-plot)."""
        phase("plotting (rank 0)")
        on_root(self.comm, self._plot, error=WriteError)

    def _plot(self) -> None:
        if self.config["plot"] and os.path.exists(self.path(METRICS)):
            plot_metrics(self.path(METRICS), self.path(PLOT), self.metric_name)

    def saved(self, step) -> None:
        """The last checkpoint is at ``step`` (None: none yet); an interruption's message says so."""
        self.last_saved = step
        PROGRESS.saved = (f"the last checkpoint is step {step} ({self.path(CHECKPOINT)})" if step is not None
                          else "no checkpoint was written yet")

    def kept(self) -> str:
        """What a divergence leaves in OUT to go back to."""
        if not os.path.exists(self.path(CHECKPOINT)):
            return "no checkpoint was written yet"
        return f"the last good checkpoint (step {self.last_saved if self.last_saved is not None else '?'}) " \
               f"is in {self.out}"

    def files(self) -> dict:
        """Where the run's outputs are, for the summary."""
        return {"out": self.out, "checkpoint": self.path(CHECKPOINT), "metrics": self.path(METRICS),
                "plot": self.path(PLOT) if self.config["plot"] else None}

    def finish(self, summary: dict) -> None:
        """The bar closed, summary.json written (unless no step ran: the old one stays), the last line said."""
        self.bar.close()
        if summary["steps_this_run"]:
            phase("writing summary.json (rank 0)")
            on_root(self.comm, write_json, self.path(SUMMARY), summary, indent=2, error=WriteError)
        self.say(summary_line(summary, self.metric_name))


def summary_line(summary: dict, metric_name: str) -> str:
    parts = [f"done: {summary['steps']} steps ({summary['epochs']:.2f} epochs) in {summary['seconds']:.1f} s",
             f"{summary['samples_per_s']:.1f} samples/s over the whole run (start-up, validation and "
             "checkpoints included)"]
    if summary["final_train"]:
        t = summary["final_train"]
        parts.append(f"train loss {t['loss']:.5g} {metric_name} {t[metric_name]:.4g}")
    if summary["final_val"]:
        v = summary["final_val"]
        parts.append(f"val loss {v['loss']:.5g} {metric_name} {v[metric_name]:.4g}")
    parts.append(f"checkpoint {summary['checkpoint']}, metrics {summary['metrics']}"
                 + (f", plot {summary['plot']}" if summary["plot"] else ""))
    return " | ".join(parts)


def write_json(path, value, **dump_options) -> None:
    """Write ``value`` as JSON to ``path`` atomically (never half-written)."""
    atomic_write(path, lambda f: json.dump(value, f, **dump_options))


def append_line(path, line: str) -> None:
    """Append one line (flushed at close): metrics survive a crash up to the last step written."""
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError as err:           # name the file: a write error carries no filename
        raise OSError(err.errno, err.strerror, path) from None


def truncate_metrics(path, step: int) -> None:
    """Drop metric lines written after ``step`` (by a run killed after its last checkpoint)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError):
            pass
    atomic_write(path, lambda f: f.writelines(keep))


def plot_metrics(metrics_path, png_path, metric_name) -> None:
    """Loss and metric vs step (train and val) as a PNG (matplotlib, Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("loss", metric_name)):
        train = [(r["step"], r[key]) for r in rows if r["split"] == "train" and key in r]
        if train:
            steps, values = zip(*train)
            ax.plot(steps, values, "-", color="C0", alpha=0.3, label="train (per step)")
            window = max(1, len(values) // 20)     # running mean over ~5% of the run
            smooth = [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
                      for i in range(len(values))]
            ax.plot(steps, smooth, "-", color="C0", label=f"train (mean of {window})")
        val = [(r["step"], r[key]) for r in rows if r["split"] == "val" and key in r]
        if val:
            ax.plot(*zip(*val), "o-", color="C1", label="val", markersize=4)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_yscale("log" if key == "loss" else "linear")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(png_path))))
    fig.tight_layout()
    try:
        atomic_write(png_path, lambda f: fig.savefig(f, dpi=90, format="png"), binary=True)
    finally:
        plt.close(fig)


__all__ = ["CHECKPOINT", "METRICS", "PLOT", "CONFIG", "SUMMARY", "RUN_FILES", "RunReport", "summary_line",
           "write_json", "append_line", "truncate_metrics", "plot_metrics"]

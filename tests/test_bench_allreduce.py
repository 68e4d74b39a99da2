"""scripts/bench_allreduce.py part 3 (priorities) at a tiny step count under mpiexec -n 2: the
table, the JSON, the JSON-lines trace and the timeline picture; the trace shows the input-side
bucket started before the output side's held chunks at the end of backward."""
import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")
from launcher import run_launched  # noqa: E402
from test_train_cli import mpi_env  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_allreduce.py"


def test_priority_part_writes_trace_and_timeline(tmp_path):
    out, trace, png = tmp_path / "r.json", tmp_path / "trace.jsonl", tmp_path / "timeline.png"
    cmd = [shutil.which("mpiexec"), "--oversubscribe", "-n", "2", sys.executable, str(SCRIPT), "--parts", "3",
           "--steps", "2", "--json", str(out), "--trace", str(trace), "--timeline", str(png)]
    proc = run_launched(cmd, timeout=600, env=mpi_env())
    assert proc.returncode == 0, proc.stderr
    assert "bwd->next fwd" in proc.stdout
    rows = json.loads(out.read_text())["priorities"]["configurations"]
    assert [r["configuration"] for r in rows] == ["plain (none)", "none, 256 KiB chunks",
                                                  "input-first, 256 KiB chunks"]
    assert all(r["gap_s"] > 0 and r["step_s"] > r["gap_s"] for r in rows)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {r["rank"] for r in records} == {0, 1}
    chunks = [r for r in records if r["event"] == "chunk"]
    assert all(r["finish"] >= r["start"] for r in chunks)
    assert png.stat().st_size > 10_000
    # one input-first step of rank 0: the input-side bucket starts before held output-side chunks
    first = [r for r in chunks if r["configuration"].startswith("input-first") and r["rank"] == 0
             and r["step"] == 1]
    last_bucket = max(r["bucket"] for r in first)
    order = [r["bucket"] for r in sorted(first, key=lambda r: r["start"])]
    assert any(b < last_bucket for b in order[order.index(last_bucket):])

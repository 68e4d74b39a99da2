"""scripts/bench_comm.py at a tiny size: the distributed update's optimizer state is the plain
state's 1/P share, exactly and as tracemalloc sees it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_comm.py"


def test_state_share_is_one_over_p(tmp_path):
    out = tmp_path / "comm.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "1,2", "--preset", "tiny", "--repeats", "1",
                           "--optimizer", "sgd", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["ranks"], r["update"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(1, "plain"), (1, "distributed"), (2, "plain"), (2, "distributed")}
    plain = rows[1, "plain"]["state_bytes"]
    assert plain == rows[1, "plain"]["param_bytes"]                      # SGD momentum: one copy
    assert rows[2, "plain"]["state_bytes"] == plain
    assert abs(rows[2, "distributed"]["state_bytes"] - plain / 2) <= 8 * 8   # block rounding
    assert abs(rows[2, "distributed"]["state_traced_bytes"] - rows[2, "distributed"]["state_bytes"]) <= 4096
    assert "x 1/P" in proc.stdout

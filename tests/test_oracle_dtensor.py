"""``refimpl oracle run-dtensor`` on 2 processes, then ``refimpl oracle check``: the verdicts
per case and tensor equal the 2-process table of docs/peers.md.

The suite (a TOML block) and the table are both read from the page, so the page, the
adapter and the checker cannot drift apart: a DTensor release that fixes (or breaks) a
case fails this test until the page says so.  One process per rank, gloo on the CPU; a
few cases of the page's suite keep it near 30 s on two cores.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("h5py")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "peers.md"
#: the cases this test runs (the page's table has more; the tutorial runs others), in file-name
#: order: refusals every rank shares let the ranks go on, so the crash comes last and the
#: four cases share one launch of two processes
CASES = ("avgpool_h_split", "batchnorm_channel_split", "conv_batch_split", "conv_w_empty")


def page_suite() -> str:
    """The TOML of the 2-process suite: the first ```toml block after its marker."""
    text = PAGE.read_text()
    tail = text[text.index("<!-- suite: dtensor-2 -->"):]
    match = re.search(r"```toml\n(.*?)```", tail, re.S)
    assert match, "docs/peers.md: no ```toml block after <!-- suite: dtensor-2 -->"
    return match.group(1)


def page_table(marker: str) -> dict:
    """{case file name: {tensor: verdict}} of the table after ``marker`` (columns case,
    layer, grid, y, dx, dw, db, finding; '—' where the layer has no such tensor)."""
    text = PAGE.read_text()
    lines = text[text.index(marker):].splitlines()[1:]
    rows, started = {}, False
    for line in lines:
        if not line.startswith("|"):
            if started:
                break
            continue
        started = True
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("case", "") or set(cells[0]) <= set("-: "):
            continue
        name = cells[0].strip("`")
        rows[name] = {t: v.strip("*") for t, v in zip(("y", "dx", "dw", "db"), cells[3:7]) if v != "—"}
    return rows


def refimpl(*args, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "refimpl", "oracle", *args], capture_output=True,
                          text=True, env=env, timeout=300)
    if check:
        assert proc.returncode in (0, 1), f"refimpl oracle {args[0]}: exit {proc.returncode}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def dtensor_run(tmp_path_factory):
    """The page's suite, CASES only: generated, run by DTensor on 2 processes, checked."""
    tmp = tmp_path_factory.mktemp("dtensor")
    suite = tmp / "dtensor2.toml"
    suite.write_text(page_suite())
    cases, out = tmp / "cases", tmp / "dtensor"
    refimpl("generate", str(suite), "--out", str(cases), *[a for c in CASES for a in ("--case", c)])
    run = refimpl("run-dtensor", str(cases), "--out", str(out), "--nproc", "2", "--timeout", "120")
    assert run.returncode == 0, run.stdout + run.stderr
    check = refimpl("check", str(cases), str(out), "--json", str(tmp / "report.json"))
    return {"out": out, "run": run.stdout, "check": check.stdout,
            "reports": {c["case"]: c for c in json.loads((tmp / "report.json").read_text())["cases"]},
            "summary": json.loads((out / "dtensor_summary.json").read_text())}


def test_page_table_matches_run_dtensor_and_check(dtensor_run):
    from refimpl.oracle.dtensor_adapter import verdicts
    table = page_table("<!-- table: dtensor-2 -->")
    summary, reports = dtensor_run["summary"], dtensor_run["reports"]
    got = {e["case"]: verdicts(e, reports.get(e["case"])) for e in summary["cases"]}
    assert len(got) == len(CASES)
    for name, verdict in got.items():
        assert name in table, f"{name}: not in docs/peers.md's 2-process table"
        assert verdict == table[name], (f"{name}: run-dtensor + check say {verdict}, docs/peers.md says "
                                        f"{table[name]}\n{dtensor_run['run']}\n{dtensor_run['check']}")
    # every refusal and crash is recorded with the exception's first line
    failed = [r for r in summary["records"] if r["status"] != "ok"]
    assert failed and all(r["status"] in ("refused", "crashed") and r["error"] for r in failed)


def test_results_carry_dtensor_offsets(dtensor_run):
    """Channel-parallel batch norm: DTensor's y and dx are Shard(1) on the model axis, so
    rank r's blocks start at channel 2r (the 'offset' attribute), and dw/db are given once."""
    import h5py
    with h5py.File(dtensor_run["out"] / "batchnorm_channel_split.1-1-1-1-2.h5", "r") as h5:
        for r in (0, 1):
            for name in ("y", "dx"):
                ds = h5[f"float64/rank/{r}/{name}"]
                assert list(ds.attrs["offset"]) == [0, 2 * r, 0, 0, 0] and ds.shape == (2, 2, 3, 3, 3)
            assert "dw" not in h5[f"float64/rank/{r}"]
        assert h5["float64/global/dw"].shape == (4,) and list(h5["float64/global/db"].attrs["offset"]) == [0]
    records = {(r["case"], r["tensor"]): r for r in dtensor_run["summary"]["records"]}
    assert records[("avgpool_h_split.1-1-2-1.h5", "dx")]["status"] == "refused"
    assert "avg_pool3d_backward" in records[("avgpool_h_split.1-1-2-1.h5", "dx")]["error"]


def test_cli_refuses_bad_arguments(tmp_path):
    proc = refimpl("run-dtensor", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "no such case file" in proc.stderr
    help_text = refimpl("run-dtensor", "--help").stdout
    assert "offset" in help_text and "--nproc" in help_text


def test_hard_table_covers_the_hard_suite():
    """docs/peers.md's hard table has a row only for case files of the shipped suite, each
    with a verdict per tensor of its layer (the run behind it takes ~15 minutes: the page shows
    the command; this checks the table did not drift from the suite).  A case added since the
    run has no row yet: the site names it under the table (scripts/mkdocs_hooks.py
    ``hard_table_note``, tests/test_site.py), so a new case needs no DTensor run."""
    from refimpl import layers
    from refimpl.oracle import load_suite
    table = page_table("<!-- table: hard -->")
    specs = {s.file_name: s for s in load_suite("hard")}
    assert set(table) <= set(specs), f"rows for cases the suite no longer has: {sorted(set(table) - set(specs))}"
    for name, verdict in table.items():
        params = layers.lookup(specs[name].layer).parameter_shapes(specs[name])
        assert set(verdict) == ({"y", "dx", "dw", "db"} if params else {"y", "dx"}), name
        assert set(verdict.values()) <= {"pass", "fail", "refused", "crashed"}, name


# ---------------------------------------------------------------- a whole CosmoFlow step under DTensor

def trace_table() -> dict:
    """{grid: (layer, tensor, ranks, first cell, diagnosis, backward)} of the page's table."""
    text = PAGE.read_text()
    lines = text[text.index("<!-- table: dtensor-trace -->"):].splitlines()[1:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("grid", "") or set(cells[0]) <= set("-: "):
            continue
        rows[cells[0].split()[0].replace("×", ",")] = cells[1:]
    return rows


@pytest.mark.parametrize("grid", ["1,1,1,2", "2,1,1,1"])
def test_dtensor_cosmoflow_step_matches_the_page(tmp_path, grid):
    """run-dtensor --trace on CosmoFlow tiny, then trace check: the first wrong layer, its
    ranks, first cell and diagnosis (or a pass), and the backward's refusal, as the page says."""
    row = trace_table()[grid]
    trace, out, report = tmp_path / "trace.h5", tmp_path / "dt.h5", tmp_path / "r.json"
    refimpl("trace", "generate", "--model", "cosmoflow", "--preset", "tiny", "--grid", grid, "--dtype", "float64",
            "--out", str(trace))
    run = refimpl("run-dtensor", "--trace", str(trace), "--out", str(out), "--timeout", "200")
    assert run.returncode == 0, run.stdout + run.stderr
    assert ("refused in the backward" in run.stdout) == (row[5] == "refused"), run.stdout
    check = refimpl("trace", "check", str(trace), str(out), "--json", str(report))
    first = json.loads(report.read_text())["first_finding"]
    if row[0].startswith("—"):
        assert check.returncode == 0 and first is None, check.stdout
        return
    assert check.returncode == 1, check.stdout
    assert row[0].startswith(f"`{first['layer']}`") and row[1] == first["tensor"]
    assert row[2] == ", ".join(map(str, first["ranks"])) and row[3] == str(first["first_index"])
    assert row[4] == first["diagnosis"], (row[4], first["diagnosis"])
    assert "placements claim another local shape" in run.stdout


def test_run_dtensor_needs_cases_or_a_trace(tmp_path):
    proc = refimpl("run-dtensor", "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "CASES" in proc.stderr and "--trace" in proc.stderr

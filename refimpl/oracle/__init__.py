"""The oracle toolkit: reference cases per layer, per grid and per rank, and a shard-by-shard
diagnosis of another implementation's results (``refimpl oracle``; docs/oracle.md).

    suite.py          TOML suites of layer cases (``hard`` ships with refimpl)
    expect.py         expected global arrays and every rank's blocks (pure math, no MPI)
    casefile.py       case and results files (HDF5): write, load, validate
    compare.py        errors, tolerances and why, first mismatch and its owner
    diagnose.py       known mistakes recognised from the error pattern
    torch_adapter.py  PyTorch as the implementation under test (run-torch; --plant)
    trace.py          whole-model step traces: the reference step layer by layer (oracle trace)
    trace_check.py    a peer's step judged layer by layer on its own input (oracle trace check)
    trace_results.py  a peer's results of a trace: read and validated
    trace_diagnose.py known mistakes rebuilt on a traced layer (and diagnose.py on it as a case)
    trace_torch.py    the PyTorch twin runs a trace (oracle trace run-torch; --plant)
    model_twins.py    PyTorch twins of CosmoFlow and the U-Net, named as refimpl's models

What each kind of layer contributes (its reference, halo plan, tolerances, known mistakes,
PyTorch twin) comes from the layer registry, refimpl/layers.

Python API::

    from refimpl.oracle import load_case, load_results, compare
    case = load_case("cases/conv_even_kernel.1-2-2-1.h5")
    x = case.inputs["float64"]["x"]; lo = case.layouts[2]   # rank 2's ranges
    ...                                                     # run your implementation
    write_results("mine.h5", case, global_={"float64": {"y": y, "dx": dx, "dw": dw, "db": db}})
    report = compare(case, load_results("mine.h5", case))
    print(report.ok, [f.as_dict() for f in report.findings if not f.ok])

Results may be partial (any tensors, ranks, dtypes: ``report.not_provided``) and in any
block layout: a rank's tensor given as ``(array, offset)`` to ``write_results`` is placed at
``offset`` (``report.layout == "results"``: ranks are the results' own).
"""
from .casefile import Case, Results, UnusableInput, load_case, load_results, write_case, write_results
from .compare import CaseReport, Finding, compare, tolerance
from .suite import CaseSpec, load_suite, parse_suite

__all__ = ["Case", "Results", "UnusableInput", "load_case", "load_results", "write_case", "write_results",
           "CaseReport", "Finding", "compare", "tolerance", "CaseSpec", "load_suite", "parse_suite"]

#!/usr/bin/env bash
# Install refimpl with every test extra and run the whole suite: plain pytest
# (unit math, PyTorch oracle, CuPy API scan) plus tests/mpi/ under real
# `mpiexec -n 1, 2, 3, 4, 6, 8` (driven by tests/test_mpiexec.py), and the documentation site
# (tests/test_docs.py: `mkdocs build --strict`, and the commands and code the pages show).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[mpi,test,oracle,gpu,docs]"
python -m pytest -q "$@"

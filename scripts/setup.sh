#!/usr/bin/env bash
# Create .venv with a CPU build of PyTorch (pinned: an open range would pull a multi-GB CUDA build) and
# install flexengine with its test dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# setuptools' note that an editable install with a package-dir mapping (conf/ -> flexengine.conf) imports through a
# meta path finder is information, not a problem: it alone is silenced (tests/test_packaging.py refuses real warnings)
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".[test]"

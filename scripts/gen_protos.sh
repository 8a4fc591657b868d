#!/usr/bin/env bash
# Regenerate the gRPC modules under server/rpc/protos/ from their .proto files. The generated
# files are committed; tests/server/test_grpc_protos.py checks that they match the .proto files.
#
# The generator is pinned (grpcio-tools 1.66.2, protobuf 5.27 code) and run in a throwaway uv
# environment: generated code requires a runtime at least as new as its generator, so an old
# generator keeps mserve's lower bounds (grpcio, protobuf in pyproject.toml) low.
set -euo pipefail
cd "$(dirname "$0")/.."
UV="$(command -v uv || echo .venv/bin/uv)"
TOOLS="grpcio-tools==1.66.2"
# google/rpc/status.proto ships with googleapis-common-protos (a runtime dependency)
"$UV" run --quiet --no-project --with "$TOOLS" --with "googleapis-common-protos>=1.56" python - <<'PY'
import os
import sys

import google.rpc
from grpc_tools import protoc

common = os.path.dirname(os.path.dirname(google.rpc.__path__[0]))
tools = os.path.join(os.path.dirname(protoc.__file__), "_proto")
args = ["protoc", "-I", ".", "-I", common, "-I", tools, "--python_out=.", "--pyi_out=.",
        "--grpc_python_out=.", "server/rpc/protos/inference.proto",
        "server/rpc/protos/management.proto", "server/rpc/protos/oip.proto",
        "server/rpc/protos/mserve_management.proto"]
sys.exit(protoc.main(args))
PY
echo "regenerated server/rpc/protos/*_pb2*.py with $TOOLS"

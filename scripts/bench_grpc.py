"""gRPC unary vs JSON REST on one real mserve, in the same run: requests/s and p50 for an echo
handler, batch size 1, one client connection each, calls in turn (REST, gRPC, REST, gRPC...).

    python scripts/bench_grpc.py [--seconds 5] [--rounds 3]

Read the rows side by side only: both go through the same queue and worker, so the difference
is the frontend and the client library (http.client vs grpcio's sync stub).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from server.rpc.protos import inference_pb2, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _measure(call: Callable[[], None], seconds: float) -> tuple[float, float]:
    latencies = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - started)
    return len(latencies) / sum(latencies), statistics.median(latencies) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        store = work / "store"
        store.mkdir()
        subprocess.run(
            [BIN / "model-archiver", "--model-name", "echo", "--handler", "echo", "--model-path",
             ROOT / "tests/handlers/echo_fn", "--export-path", store, "-f"],
            check=True, capture_output=True,
        )  # fmt: skip
        config = work / "mserve.yaml"
        config.write_text(
            "inference_address: 127.0.0.1:0\nmanagement_address: 127.0.0.1:0\n"
            "metrics_address: 127.0.0.1:0\ngrpc_inference_address: 127.0.0.1:0\n"
            f"grpc_management_address: 127.0.0.1:0\nmodel_store: {store}\n"
            "access_log: false\n"
            # loopback only; both transports are measured without keys alike
            "disable_token_authorization: true\n"
        )
        run = work / "run"
        mserve = [BIN / "mserve", "--run-dir", run]
        subprocess.run([*mserve, "--start", "--config", config, "--models", "echo=echo.mar"],
                       check=True, capture_output=True)  # fmt: skip
        try:
            status = json.loads((run / "status.json").read_text())
            host, port = status["inference"].rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port))
            body = json.dumps({"x": 1}).encode()
            headers = {"Content-Type": "application/json"}

            def rest() -> None:
                conn.request("POST", "/predictions/echo", body, headers)
                response = conn.getresponse()
                response.read()
                assert response.status == 200

            channel = grpc.insecure_channel(status["grpc_inference"])
            stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
            request = inference_pb2.PredictionsRequest(model_name="echo", input={"body": body})

            def rpc() -> None:
                stub.Predictions(request, timeout=30)

            for call in (rest, rpc):  # warm both
                _measure(call, 0.5)
            print(f"{'transport':<12} {'req/s':>8} {'p50 ms':>8}")
            for _ in range(args.rounds):
                for name, call in (("REST JSON", rest), ("gRPC unary", rpc)):
                    rate, p50 = _measure(call, args.seconds)
                    print(f"{name:<12} {rate:>8.0f} {p50:>8.2f}")
            channel.close()
            conn.close()
        finally:
            subprocess.run([*mserve, "--stop"], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

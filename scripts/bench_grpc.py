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
import sys
import tempfile
from pathlib import Path

import grpc
from harness import REPO, Server, archive, timed_calls

from server.rpc.protos import inference_pb2, inference_pb2_grpc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        archive(work / "store", "echo", "--handler", "echo", "--model-path",
                REPO / "tests/handlers/echo_fn", "-f")  # fmt: skip
        # loopback only; both transports are measured without keys alike
        settings = {"access_log": False, "disable_token_authorization": True}
        server = Server(work, settings, ["echo=echo.mar"])
        try:
            conn = http.client.HTTPConnection(server.host, server.port)
            body = json.dumps({"x": 1}).encode()
            headers = {"Content-Type": "application/json"}

            def rest() -> None:
                conn.request("POST", "/predictions/echo", body, headers)
                response = conn.getresponse()
                response.read()
                assert response.status == 200

            channel = grpc.insecure_channel(server.status["grpc_inference"])
            stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
            request = inference_pb2.PredictionsRequest(model_name="echo", input={"body": body})

            def rpc() -> None:
                stub.Predictions(request, timeout=30)

            for call in (rest, rpc):  # warm both
                timed_calls(call, 0.5)
            print(f"{'transport':<12} {'req/s':>8} {'p50 ms':>8}")
            for _ in range(args.rounds):
                for name, call in (("REST JSON", rest), ("gRPC unary", rpc)):
                    rate, p50 = timed_calls(call, args.seconds)
                    print(f"{name:<12} {rate:>8.0f} {p50:>8.2f}")
            channel.close()
            conn.close()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Open Inference Protocol benchmark: the same torch MLP over TorchServe's JSON path, OIP with
JSON data, OIP with binary tensor data and OIP over gRPC, in one run.

Usage: python scripts/bench_oip.py [--duration 6] [--rounds 3]

The model is tests/handlers/oip_models' MLP (256 -> 64 -> 10, float32, seed 0, one torch thread),
served by one worker with batch size 1 and token authorization on (the inference key is read from
``<run_dir>/key_file.json``, as a client would). One keep-alive connection sends requests one
after another for ``--duration`` seconds per row, split into ``--rounds`` runs taken in turn with
the other rows of the same input (the medians are printed): requests/s, p50 latency and the
ratio to the TorchServe JSON row of the same input size. Inputs: one row of 256 floats, and 1024
rows (1 MiB of float32). Bodies are built once, before timing: the figures are the server's and
the worker's cost (and the client reading the answer), not the client encoding its request.

- ``torchserve json``: ``POST /predictions/mlp`` with ``{"data": [[...]]}``; the handler answers a
  JSON list.
- ``oip json``: ``POST /v2/models/mlp/infer`` with the tensor as JSON ``data``, answer as JSON.
- ``oip binary``: the same with the binary tensor data extension both ways.
- ``oip grpc raw``: ``inference.GRPCInferenceService/ModelInfer`` on the gRPC inference port, the
  tensor in ``raw_input_contents`` (as tritonclient.grpc sends it), one channel, calls one after
  another; the answer in ``raw_output_contents``.
- ``oip grpc typed``: the same with the tensor in ``contents.fp32_contents``.

"bytes" is the request body (for gRPC, the serialized message).

This VM's speed drifts (CPU steal): compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np
import torch
from harness import REPO, Server, archive, timed_calls

from mserve_worker.oip.tensors import HEADER_LENGTH, RequestedOutput, Tensor
from mserve_worker.oip.wire import encode_request
from server.rpc.protos import oip_pb2, oip_pb2_grpc

FOLDER = REPO / "tests" / "handlers" / "oip_models"


def start(work: Path) -> Server:
    sys.path.insert(0, str(FOLDER))
    from mlp_handler import MLP  # the served model's own class

    torch.manual_seed(0)
    torch.save(MLP().state_dict(), work / "mlp.pt")
    archive(work / "store", "mlp", "--handler", "mlp_handler", "--model-path", FOLDER,
            "--serialized-file", work / "mlp.pt",
            "--config-file", FOLDER / "mlp_config.yaml")  # fmt: skip
    limits = {"max_request_size_bytes": 16000000, "max_response_size_bytes": 16000000}
    return Server(work, limits, ["mlp=mlp.mar"])


def bodies(x: np.ndarray) -> dict[str, tuple[str, bytes, dict[str, str]]]:
    ts = json.dumps({"data": x.tolist()}).encode()
    tensor = Tensor("input__0", "FP32", x.shape, x)
    as_json, _ = encode_request([tensor], [False], [RequestedOutput("output__0", False)])
    as_binary, length = encode_request([tensor], [True], [RequestedOutput("output__0", True)])
    binary_headers = {HEADER_LENGTH: str(length), "Content-Type": "application/octet-stream"}
    return {
        "torchserve json": ("/predictions/mlp", ts, {"Content-Type": "application/json"}),
        "oip json": ("/v2/models/mlp/infer", as_json, {"Content-Type": "application/json"}),
        "oip binary": ("/v2/models/mlp/infer", as_binary, binary_headers),
    }


def grpc_requests(x: np.ndarray) -> dict[str, oip_pb2.ModelInferRequest]:
    wanted = [oip_pb2.ModelInferRequest.InferRequestedOutputTensor(name="output__0")]
    raw = oip_pb2.ModelInferRequest(model_name="mlp", outputs=wanted)
    raw.inputs.add(name="input__0", datatype="FP32", shape=x.shape)
    raw.raw_input_contents.append(x.tobytes())
    typed = oip_pb2.ModelInferRequest(model_name="mlp", outputs=wanted)
    tensor = typed.inputs.add(name="input__0", datatype="FP32", shape=x.shape)
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    return {"oip grpc raw": raw, "oip grpc typed": typed}


def load_grpc(
    stub: oip_pb2_grpc.GRPCInferenceServiceStub,
    key: str,
    request: oip_pb2.ModelInferRequest,
    duration: float,
) -> tuple[float, float]:
    metadata = [("authorization", f"Bearer {key}")]
    for _ in range(3):  # warm up, and check the answer
        answer = stub.ModelInfer(request, metadata=metadata, timeout=120)
        if not answer.raw_output_contents:
            raise SystemExit(f"ModelInfer: no raw_output_contents in {answer}")
    return timed_calls(lambda: stub.ModelInfer(request, metadata=metadata, timeout=120), duration)


def load(host: str, port: int, key: str, path: str, body: bytes, headers: dict[str, str],
         duration: float) -> tuple[float, float]:  # fmt: skip
    headers = {**headers, "Authorization": f"Bearer {key}"}
    conn = http.client.HTTPConnection(host, port, timeout=120)
    for _ in range(3):  # warm up, and check the answer
        conn.request("POST", path, body, headers)
        resp = conn.getresponse()
        answer = resp.read()
        if resp.status != 200:
            raise SystemExit(f"{path}: {resp.status} {answer[:300]!r}")

    def call() -> None:
        conn.request("POST", path, body, headers)
        conn.getresponse().read()

    figures = timed_calls(call, duration)
    conn.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per row")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = start(work)
        host, port, grpc_address = server.host, server.port, server.status["grpc_inference"]
        key = server.keys["inference"]
        options = [("grpc.max_send_message_length", 16_000_000),
                   ("grpc.max_receive_message_length", 16_000_000)]  # fmt: skip
        channel = grpc.insecure_channel(grpc_address, options=options)
        stub = oip_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            rng = np.random.default_rng(0)
            sizes = {"256 floats": (1, 256), "1 MiB": (1024, 256)}
            print(f"{'input':<11} {'path':<16} {'bytes':>11} {'req/s':>8} {'p50 ms':>8}"
                  f" {'vs ts json':>10} {'vs oip binary':>13}")  # fmt: skip
            for label, shape in sizes.items():
                x = rng.standard_normal(shape, dtype=np.float32)
                rows = bodies(x)
                calls = grpc_requests(x)
                sent = {name: len(body) for name, (_, body, _) in rows.items()}
                sent.update({name: request.ByteSize() for name, request in calls.items()})
                runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sent}
                share = args.duration / args.rounds
                for _ in range(args.rounds):  # interleaved: drift hits every row alike
                    for name, (path, body, headers) in rows.items():
                        runs[name].append(load(host, port, key, path, body, headers, share))
                    for name, request in calls.items():
                        runs[name].append(load_grpc(stub, key, request, share))
                base = statistics.median(r for r, _ in runs["torchserve json"])
                binary = statistics.median(r for r, _ in runs["oip binary"])
                for name, size in sent.items():
                    rps = statistics.median(r for r, _ in runs[name])
                    p50 = statistics.median(p for _, p in runs[name])
                    print(f"{label:<11} {name:<16} {size:>11} {rps:>8.1f} {p50:>8.2f}"
                          f" {rps / base:>9.2f}x {rps / binary:>12.2f}x", flush=True)  # fmt: skip
        finally:
            channel.close()
            server.stop()


if __name__ == "__main__":
    main()

"""The committed gRPC modules (server/rpc/protos/) match their .proto files, and the wire format
is TorchServe's (its two services) and Triton's (the Open Inference Protocol's
``inference.GRPCInferenceService``): package, services, methods, messages, field names, numbers
and types.

Our OIP module is read from its generated source, never imported here: it defines the
``inference`` package's messages, as tritonclient's own module does, and protobuf refuses a
second file defining the same names in one process (the OIP tests import tritonclient).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import google.rpc
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from server.rpc.protos import (
    inference_pb2,
    inference_pb2_grpc,
    management_pb2,
    management_pb2_grpc,
    mserve_management_pb2,
)

protoc = pytest.importorskip("grpc_tools.protoc")

ROOT = Path(__file__).resolve().parents[2]

T = FieldDescriptor
STRING, BYTES, INT32, BOOL, MESSAGE = (
    T.TYPE_STRING,
    T.TYPE_BYTES,
    T.TYPE_INT32,
    T.TYPE_BOOL,
    T.TYPE_MESSAGE,
)

# TorchServe's published definitions, as facts: message -> {field: (number, type)}
INFERENCE_MESSAGES = {
    "PredictionsRequest": {
        "model_name": (1, STRING),
        "model_version": (2, STRING),
        "input": (3, MESSAGE),
        "sequenceId": (4, STRING),
    },
    "PredictionResponse": {
        "prediction": (1, BYTES),
        "sequenceId": (2, STRING),
        "status": (3, MESSAGE),
    },
    "TorchServeHealthResponse": {"health": (1, STRING)},
}
MANAGEMENT_MESSAGES = {
    "ManagementResponse": {"msg": (1, STRING)},
    "DescribeModelRequest": {
        "model_name": (1, STRING),
        "model_version": (2, STRING),
        "customized": (3, BOOL),
    },
    "ListModelsRequest": {"limit": (1, INT32), "next_page_token": (2, INT32)},
    "RegisterModelRequest": {
        "batch_size": (1, INT32),
        "handler": (2, STRING),
        "initial_workers": (3, INT32),
        "max_batch_delay": (4, INT32),
        "model_name": (5, STRING),
        "response_timeout": (6, INT32),
        "runtime": (7, STRING),
        "synchronous": (8, BOOL),
        "url": (9, STRING),
        "s3_sse_kms": (10, BOOL),
        "queue_timeout": (11, INT32),
    },
    "ScaleWorkerRequest": {
        "model_name": (1, STRING),
        "model_version": (2, STRING),
        "max_worker": (3, INT32),
        "min_worker": (4, INT32),
        "number_gpu": (5, INT32),
        "synchronous": (6, BOOL),
        "timeout": (7, INT32),
    },
    "SetDefaultRequest": {"model_name": (1, STRING), "model_version": (2, STRING)},
    "UnregisterModelRequest": {"model_name": (1, STRING), "model_version": (2, STRING)},
}
# method -> (request, response, client streams, server streams)
INFERENCE_METHODS = {
    "Ping": ("google.protobuf.Empty", "TorchServeHealthResponse", False, False),
    "Predictions": ("PredictionsRequest", "PredictionResponse", False, False),
    "StreamPredictions": ("PredictionsRequest", "PredictionResponse", False, True),
    "StreamPredictions2": ("PredictionsRequest", "PredictionResponse", True, True),
}
MANAGEMENT_METHODS = {
    name: (request, "ManagementResponse", False, False)
    for name, request in (
        ("DescribeModel", "DescribeModelRequest"),
        ("ListModels", "ListModelsRequest"),
        ("RegisterModel", "RegisterModelRequest"),
        ("ScaleWorker", "ScaleWorkerRequest"),
        ("SetDefault", "SetDefaultRequest"),
        ("UnregisterModel", "UnregisterModelRequest"),
    )
}


@pytest.mark.parametrize(
    ("module", "package", "service", "messages", "methods"),
    [
        (inference_pb2, "org.pytorch.serve.grpc.inference", "InferenceAPIsService",
         INFERENCE_MESSAGES, INFERENCE_METHODS),
        (management_pb2, "org.pytorch.serve.grpc.management", "ManagementAPIsService",
         MANAGEMENT_MESSAGES, MANAGEMENT_METHODS),
    ],
)  # fmt: skip
def test_wire_format_is_torchserves(module, package, service, messages, methods) -> None:
    file = module.DESCRIPTOR
    assert file.package == package
    assert set(file.message_types_by_name) == set(messages)
    for name, fields in messages.items():
        message = file.message_types_by_name[name]
        assert message.full_name == f"{package}.{name}"
        found = {f.name: (f.number, f.type) for f in message.fields}
        assert found == fields, name
    assert set(file.services_by_name) == {service}
    svc = file.services_by_name[service]
    assert svc.full_name == f"{package}.{service}"
    found_methods = {}
    for method in svc.methods:
        request = method.input_type.full_name.removeprefix(f"{package}.")
        response = method.output_type.full_name.removeprefix(f"{package}.")
        found_methods[method.name] = (
            request,
            response,
            method.client_streaming,
            method.server_streaming,
        )
    assert found_methods == methods


def test_inference_map_and_status_types() -> None:
    request = inference_pb2.PredictionsRequest.DESCRIPTOR
    entry = request.fields_by_name["input"].message_type
    assert entry.GetOptions().map_entry
    assert {f.name: f.type for f in entry.fields} == {"key": STRING, "value": BYTES}
    status = inference_pb2.PredictionResponse.DESCRIPTOR.fields_by_name["status"]
    assert status.message_type.full_name == "google.rpc.Status"


def test_committed_modules_match_the_proto_files(tmp_path: Path) -> None:
    """What scripts/gen_protos.sh would generate now describes the same files as what is
    committed (compared as descriptors, so the grpcio-tools version does not matter)."""
    common = os.path.dirname(os.path.dirname(google.rpc.__path__[0]))
    tools = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    out = tmp_path / "set.pb"
    args = ["protoc", "-I", str(ROOT), "-I", common, "-I", tools, f"--descriptor_set_out={out}",
            "server/rpc/protos/inference.proto", "server/rpc/protos/management.proto",
            "server/rpc/protos/oip.proto", "server/rpc/protos/mserve_management.proto"]  # fmt: skip
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert protoc.main(args) == 0
    finally:
        os.chdir(cwd)
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    by_name = {f.name: _without_json_names(f) for f in compiled.file}
    committed_files = [
        descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        for module in (inference_pb2, management_pb2, mserve_management_pb2)
    ]
    committed_files.append(_oip_file())
    for committed in committed_files:
        _without_json_names(committed)
        assert committed == by_name[committed.name], (
            f"the module of {committed.name} is stale: run scripts/gen_protos.sh"
        )


def _without_json_names(
    file: descriptor_pb2.FileDescriptorProto,
) -> descriptor_pb2.FileDescriptorProto:
    """protoc's descriptor set names each field's JSON name; generated Python code leaves them
    out (they are derived from the field names)."""
    messages = list(file.message_type)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            field.ClearField("json_name")
    return file


def test_generated_services_are_importable() -> None:
    assert inference_pb2_grpc.InferenceAPIsServiceStub
    assert inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server
    assert management_pb2_grpc.ManagementAPIsServiceStub
    assert management_pb2_grpc.add_ManagementAPIsServiceServicer_to_server


def _oip_file() -> descriptor_pb2.FileDescriptorProto:
    """The descriptor committed in server/rpc/protos/oip_pb2.py, read from its source (the
    bytes it hands to ``AddSerializedFile``) without importing it."""
    source = (ROOT / "server/rpc/protos/oip_pb2.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
        ):
            return descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(node.args[0]))
    raise AssertionError("oip_pb2.py has no AddSerializedFile call")


def test_oip_wire_format_is_tritons() -> None:
    """Every message of ours is Triton's (tritonclient's own generated module): the same full
    name, the same fields with the same numbers, types, labels and message types; every method
    ours serves has Triton's name, types and streaming."""
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    triton = descriptor_pb2.FileDescriptorProto.FromString(service_pb2.DESCRIPTOR.serialized_pb)
    ours = _oip_file()
    assert ours.package == triton.package == "inference"

    def messages(file: descriptor_pb2.FileDescriptorProto) -> dict[str, Any]:
        found, todo = {}, [(f".{file.package}", m) for m in file.message_type]
        while todo:
            scope, message = todo.pop()
            name = f"{scope}.{message.name}"
            found[name] = {
                f.name: (f.number, f.type, f.label, f.type_name, f.HasField("oneof_index"))
                for f in message.field
            }
            todo.extend((name, nested) for nested in message.nested_type)
        return found

    theirs = messages(triton)
    for name, fields in messages(ours).items():
        assert name in theirs, f"{name} is not one of Triton's messages"
        assert fields == theirs[name], name
    (service,) = ours.service
    assert service.name == "GRPCInferenceService"
    triton_methods = {m.name: m for s in triton.service if s.name == service.name for m in s.method}
    for method in service.method:
        other = triton_methods[method.name]
        assert (method.input_type, method.output_type) == (other.input_type, other.output_type)
        assert (method.client_streaming, method.server_streaming) == (
            other.client_streaming, other.server_streaming,
        )  # fmt: skip
    assert {m.name for m in service.method} == {
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
        "ModelInfer", "ModelStreamInfer",
    }  # fmt: skip

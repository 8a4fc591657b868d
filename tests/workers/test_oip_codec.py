"""The Open Inference Protocol codec and signatures, at byte level and without numpy where the
worker may lack it (mserve_worker/oip)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mserve_worker.oip.decode import flat_values, split_bytes, to_array, to_lists
from mserve_worker.oip.encode import output_tensor
from mserve_worker.oip.signature import SignatureError, parse_signature
from mserve_worker.oip.tensors import OIPError, RequestedOutput, Tensor
from mserve_worker.oip.wire import encode_request, encode_response, parse_request, parse_response


def test_binary_request_bytes_are_json_then_tensors_in_input_order() -> None:
    ints = Tensor("i", "INT16", (2,), [1, -2])
    words = Tensor("w", "BYTES", (2,), [b"ab", b""])
    body, length = encode_request([ints, words], [True, True], [RequestedOutput("o", True)])
    head = body[:length]
    assert head == (
        b'{"inputs":[{"name":"i","datatype":"INT16","shape":[2],"parameters":'
        b'{"binary_data_size":4}},{"name":"w","datatype":"BYTES","shape":[2],"parameters":'
        b'{"binary_data_size":10}}],"outputs":[{"name":"o","parameters":{"binary_data":true}}]}'
    )
    assert body[length:] == b"\x01\x00\xfe\xff" + b"\x02\x00\x00\x00ab" + b"\x00\x00\x00\x00"
    request = parse_request(body, str(length))
    assert [flat_values(t) for t in request.inputs] == [[1, -2], [b"ab", b""]]
    assert request.binary_output("o") and not request.binary_output("other")


def test_values_without_numpy_are_nested_lists() -> None:
    t = Tensor("x", "BOOL", (2, 2), [[True, False], [False, True]])
    assert to_lists(t) == [[True, False], [False, True]]
    raw = Tensor("f", "FP16", (3,), struct.pack("<3e", 0.5, 1.0, -2.0))
    assert to_lists(raw) == [0.5, 1.0, -2.0]
    out = output_tensor("o", [[1, 2], [3, 4]], "FP32", None)
    assert (out.datatype, out.shape, out.data) == ("FP32", (2, 2), [1.0, 2.0, 3.0, 4.0])
    parts, length = encode_response({"model_name": "m"}, [out], [True])
    assert parts[1] == struct.pack("<4f", 1, 2, 3, 4) and length == len(parts[0])
    # text outputs (str or bytes) are BYTES, in a model environment without numpy too
    text = output_tensor("version", "1.0", None, None)
    assert (text.datatype, text.shape, text.data) == ("BYTES", (), [b"1.0"])
    named = output_tensor("names", ["a", b"b"], "BYTES", None)
    assert (named.datatype, named.shape, named.data) == ("BYTES", (2,), [b"a", b"b"])


def test_binary_input_is_a_view_of_the_body() -> None:
    body = bytearray(b"\x00" * 16)
    t = Tensor("x", "FP32", (4,), memoryview(body)[0:16])
    array = to_array(t, np)
    body[0:4] = struct.pack("<f", 7.0)
    assert array[0] == 7.0  # no copy was made


def test_a_response_round_trips_through_the_parser() -> None:
    outs = [output_tensor("a", np.arange(3, dtype=np.uint8), None, np),
            output_tensor("b", ["x", "yz"], None, np)]  # fmt: skip
    parts, length = encode_response({"model_name": "m", "id": "1"}, outs, [True, False])
    doc, tensors = parse_response(b"".join(parts), str(length))
    assert doc["id"] == "1" and [t.datatype for t in tensors] == ["UINT8", "BYTES"]
    assert to_array(tensors[0], np).tolist() == [0, 1, 2] and tensors[1].data == ["x", "yz"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: split_bytes(b"\x05\x00\x00\x00ab", 1, "s"),
         "BYTES input 's': element 0 says 5 bytes, only 2 remain"),
        (lambda: split_bytes(b"\x01\x00", 1, "s"),
         "BYTES input 's' ends inside an element's 4-byte length"),
        (lambda: parse_request(b'{"inputs": 3}', None),
         "the inference request needs 'inputs', a list of tensors {\"name\", \"shape\","
         " \"datatype\", \"data\"}, got a number"),
        (lambda: parse_request(b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1],'
                               b' "data": [1]}, {"name": "a", "datatype": "FP32", "shape": [1],'
                               b' "data": [1]}]}', None),
         "input 'a' is given twice"),
        (lambda: parse_request(b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [-1],'
                               b' "data": [1]}]}', None),
         "input 'a' has shape [-1]; expected a list of dimensions (integers >= 0)"),
        (lambda: output_tensor("o", np.array([1 + 2j]), None, np),
         "output 'o' has dtype complex128, which no OIP datatype carries"),
        (lambda: output_tensor("o", [[1, 2], [3]], None, None), "output 'o' is not rectangular"),
    ],
)  # fmt: skip
def test_codec_messages(call, message: str) -> None:
    with pytest.raises(OIPError) as caught:
        call()
    assert caught.value.message == message


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"inputs": {"name": "x"}},
         "model config 'inputs' should be a list of {name, datatype, shape}, found dict"),
        ({"inputs": [{"name": "x", "datatype": "FLOAT32", "shape": [1]}]},
         "model config 'inputs[0]'.datatype should be one of BOOL, UINT8, UINT16, UINT32, UINT64,"
         " INT8, INT16, INT32, INT64, FP16, FP32, FP64, BYTES, found 'FLOAT32'"),
        ({"outputs": [{"name": "y", "datatype": "FP32", "shape": [-2]}]},
         "model config 'outputs[0]'.shape should be a list of dimensions (integers, -1 for any"
         " size), found [-2]"),
        ({"outputs": [{"name": "y", "datatype": "FP32", "shape": [1], "dims": [1]}]},
         "model config 'outputs[0]' has unknown key 'dims'; expected name, datatype, shape"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]},
                     {"name": "x", "datatype": "FP32", "shape": [1]}]},
         "model config 'inputs[1]'.name 'x' is declared twice"),
    ],
)  # fmt: skip
def test_signature_messages(config: dict, message: str) -> None:
    with pytest.raises(SignatureError) as caught:
        parse_signature(config)
    assert str(caught.value) == message


def test_signature_metadata_and_absence() -> None:
    sig = parse_signature({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]})
    assert sig.metadata() == {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [],
    }
    assert not parse_signature({"minWorkers": 1}).declared

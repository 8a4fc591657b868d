"""A model's signature: the tensors it takes and returns, from its model config YAML.

Standard library only, Python 3.8+. The layout follows KServe's model metadata (and Triton's
names)::

    inputs:
      - {name: input__0, datatype: FP32, shape: [-1, 256]}   # -1: any size
    outputs:
      - {name: output__0, datatype: FP32, shape: [-1, 10]}

Both keys are optional; a model without ``inputs`` accepts any inputs, one without ``outputs``
answers whatever its handler returns. The server reads the signature for the model metadata
(``GET /v2/models/{m}``); the worker checks each request against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tensors import DATATYPES, InferRequest, OIPError, Tensor

INPUTS_KEY = "inputs"
OUTPUTS_KEY = "outputs"
# Handlers of TorchServe's styles get decoded tensors (v2) and their answers wrapped (v1).
ENVELOPE_KEY = "kserveEnvelope"


class SignatureError(ValueError):
    """A model config whose ``inputs`` or ``outputs`` cannot be read; names the entry."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1: any size

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    def fits(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, shape)
        )


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...] | None  # None: not declared
    outputs: tuple[TensorSpec, ...] | None

    @property
    def declared(self) -> bool:
        return self.inputs is not None or self.outputs is not None

    def metadata(self) -> dict[str, list[dict[str, Any]]]:
        return {
            "inputs": [s.metadata() for s in self.inputs or ()],
            "outputs": [s.metadata() for s in self.outputs or ()],
        }

    def output(self, name: str) -> TensorSpec | None:
        return next((s for s in self.outputs or () if s.name == name), None)

    def check(self, request: InferRequest, model: str) -> None:
        """Raise OIPError (400) naming the first input or output that does not fit."""
        if self.inputs is not None:
            specs = {s.name: s for s in self.inputs}
            given = {t.name for t in request.inputs}
            for tensor in request.inputs:
                spec = specs.get(tensor.name)
                if spec is None:
                    raise OIPError(
                        f"model {model} has no input {tensor.name!r}; its inputs are"
                        f" {_names(self.inputs)}"
                    )
                _check_input(tensor, spec)
            missing = [s.name for s in self.inputs if s.name not in given]
            if missing:
                raise OIPError(
                    f"model {model} needs input {', '.join(repr(m) for m in missing)}, which the"
                    f" request lacks"
                )
        if self.outputs is not None:
            for wanted in request.outputs or ():
                if self.output(wanted.name) is None:
                    raise OIPError(
                        f"model {model} has no output {wanted.name!r}; its outputs are"
                        f" {_names(self.outputs)}"
                    )


def _names(specs: tuple[TensorSpec, ...]) -> str:
    return ", ".join(repr(s.name) for s in specs) or "none"


def _check_input(tensor: Tensor, spec: TensorSpec) -> None:
    if tensor.datatype != spec.datatype:
        raise OIPError(
            f"input {tensor.name!r} must be {spec.datatype}, the request sends {tensor.datatype}"
        )
    if not spec.fits(tensor.shape):
        raise OIPError(
            f"input {tensor.name!r} must have shape {_text(spec.shape)} (-1: any size), the"
            f" request sends {_text(tensor.shape)}"
        )


def check_output(tensor: Tensor, spec: TensorSpec, model: str) -> None:
    """A handler's output against its declared shape (a mismatch is the model's fault: 500)."""
    if not spec.fits(tensor.shape):
        raise OIPError(
            f"model {model} returned output {tensor.name!r} of shape {_text(tensor.shape)}, but"
            f" its signature declares {_text(spec.shape)}",
            500,
        )


def _text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def parse_signature(config: dict[str, Any] | None) -> Signature:
    """The signature of a model config (its ``inputs`` and ``outputs`` keys)."""
    config = config or {}
    return Signature(_specs(config, INPUTS_KEY), _specs(config, OUTPUTS_KEY))


def _specs(config: dict[str, Any], key: str) -> tuple[TensorSpec, ...] | None:
    entries = config.get(key)
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise SignatureError(
            f"model config '{key}' should be a list of {{name, datatype, shape}},"
            f" found {type(entries).__name__}"
        )
    specs: list[TensorSpec] = []
    for i, entry in enumerate(entries):
        where = f"model config '{key}[{i}]'"
        if not isinstance(entry, dict):
            raise SignatureError(f"{where} should be a mapping with name, datatype and shape")
        unknown = sorted(set(entry) - {"name", "datatype", "shape"})
        if unknown:
            raise SignatureError(
                f"{where} has unknown key {', '.join(repr(u) for u in unknown)};"
                f" expected name, datatype, shape"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise SignatureError(f"{where}.name should be a non-empty string, found {name!r}")
        if any(s.name == name for s in specs):
            raise SignatureError(f"{where}.name {name!r} is declared twice")
        datatype = entry.get("datatype")
        if datatype not in DATATYPES:
            raise SignatureError(
                f"{where}.datatype should be one of {', '.join(DATATYPES)}, found {datatype!r}"
            )
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(type(d) is int and d >= -1 for d in shape):
            raise SignatureError(
                f"{where}.shape should be a list of dimensions (integers, -1 for any size),"
                f" found {shape!r}"
            )
        specs.append(TensorSpec(name, datatype, tuple(shape)))
    return tuple(specs)

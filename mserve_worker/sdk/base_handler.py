"""``BaseHandler``: the base class TorchServe handlers derive from, for handlers moving to mserve.

A handler written for TorchServe changes one line::

    from ts.torch_handler.base_handler import BaseHandler        # before
    from mserve_worker.sdk.base_handler import BaseHandler      # after

and keeps its overrides of ``preprocess``, ``inference``, ``postprocess``, ``explain_handle`` and
``get_insights``. To the loader it is a plain handler class (style ``handler-class``): created
with no arguments, ``initialize(context)`` once, ``handle(data, context)`` per batch.

Runs inside a worker, in the model's own environment: standard library only at import time;
torch is imported by the methods that use it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import pickle
import time
from typing import Any

from . import aoti, onnx_session, profiling, pt2, safe_weights, weights
from .keep import STORE, file_digest, file_key, keep

# Manifest keys, as TorchServe writes them.
_SERIALIZED_FILE = "serializedFile"
_MODEL_FILE = "modelFile"
INDEX_TO_NAME = "index_to_name.json"


class ModelLoadError(RuntimeError):
    """The model files in the archive cannot be loaded as the manifest describes them."""


class BadInput(ValueError):
    """One request's input cannot be used; that caller gets a 400 and the others their results."""


class BaseHandler:
    """Load the model, then run each batch through preprocess -> inference -> postprocess.

    Subclasses usually override one step. The attributes are class-level defaults as well as
    instance ones, because handlers written for TorchServe often define ``__init__`` without
    calling ``super().__init__()``.
    """

    model: Any = None
    device: Any = None
    map_location: str | None = None
    initialized = False
    context: Any = None
    manifest: dict[str, Any] | None = None
    model_pt_path: str | None = None
    mapping: dict[str, str] | None = None
    explain = False
    target = 0
    model_yaml_config: dict[str, Any] | None = None
    # Names a model config may set under its ``handler:`` key (model-archiver -c); see
    # ``_apply_handler_config``. Built-in handlers list theirs (``topk``, ``threshold``, ...).
    handler_options: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.model = None
        self.device = None
        self.map_location = None
        self.initialized = False
        self.context = None
        self.manifest = None
        self.model_pt_path = None
        self.mapping = None
        self.explain = False
        self.target = 0
        self.profiler_args: dict[str, Any] = {}  # torch.profiler's, with ENABLE_TORCH_PROFILER
        self._rejected: dict[int, str] = {}

    # Loading.

    def initialize(self, context: Any) -> None:
        """Pick the device, load ``serializedFile`` (eager when the manifest has a ``modelFile``;
        by suffix ``.onnx`` with onnxruntime, ``.so``/``.pt2`` as AOTInductor models; else
        TorchScript) in eval mode, and read ``index_to_name.json`` when the archive has one.
        """
        import torch

        self.context = context
        self.manifest = context.manifest
        self.model_yaml_config = getattr(context, "model_yaml_config", None) or {}
        properties = context.system_properties
        model_dir = properties.get("model_dir") or "."
        gpu_id = properties.get("gpu_id")
        if gpu_id is not None and torch.cuda.is_available():
            self.map_location = "cuda"
            self.device = torch.device(f"cuda:{gpu_id}")
        else:
            self.map_location = "cpu"
            self.device = torch.device("cpu")
        self._apply_handler_config(self.model_yaml_config)

        model_info = (self.manifest or {}).get("model", {})
        serialized = model_info.get(_SERIALIZED_FILE)
        self.model_pt_path = os.path.join(model_dir, serialized) if serialized else None
        if self.model_pt_path is not None and not os.path.isfile(self.model_pt_path):
            raise ModelLoadError(
                f"the manifest's serializedFile {serialized!r} is not in the model folder: "
                f"{self.model_pt_path} does not exist"
            )
        kept_as = self._kept_as(model_dir)
        if kept_as is not None and kept_as in STORE:  # a hot reload: the model is loaded
            self.model = keep(kept_as, _missing)
            self.mapping = load_label_mapping(os.path.join(model_dir, INDEX_TO_NAME))
            self.initialized = True
            return
        model_file = model_info.get(_MODEL_FILE)
        if model_file:
            self.model = self._load_pickled_model(model_dir, model_file, self.model_pt_path)
        elif self.model_pt_path is not None and self.model_pt_path.endswith(".onnx"):
            self.model = self._load_onnx_model(self.model_pt_path)
        elif self.model_pt_path is not None and aoti.is_aoti_file(self.model_pt_path):
            self.model = self._load_aoti_model(self.model_pt_path)
        elif self.model_pt_path is not None:
            self.model = self._load_torchscript_model(self.model_pt_path)
        else:
            raise ModelLoadError(
                f"{type(self).__name__} loads the manifest's serializedFile, but the archive has "
                f"none; pass --serialized-file (and --model-file for an eager model) to "
                f"model-archiver, or override initialize()"
            )
        if hasattr(self.model, "to"):
            self.model.to(self.device)
        if hasattr(self.model, "eval"):
            self.model.eval()
        if "pt2" in self.model_yaml_config:  # torch.compile, as TorchServe's BaseHandler
            try:
                self.model = pt2.compile_model(self.model, self.model_yaml_config["pt2"])
            except ValueError as exc:
                raise ModelLoadError(str(exc)) from None
        if kept_as is not None:  # kept across hot reloads of the handler's code
            keep(kept_as, lambda: self.model)
        self.mapping = load_label_mapping(os.path.join(model_dir, INDEX_TO_NAME))
        self.initialized = True

    def _kept_as(self, model_dir: str) -> tuple[Any, ...] | None:
        """The key the loaded model is kept under across hot reloads (sdk/keep.py): what the
        model depends on (the serialized file's identity, the model file's source, the device,
        the whole model config: ``pt2``, ``weightsOnly`` and whatever a subclass reads, and the
        code of any ``_load*`` method a subclass overrides), so a reload that changes
        ``preprocess`` keeps it and one that changes how it is built loads it again. None:
        nothing to load (initialize says why)."""
        if self.model_pt_path is None:
            return None
        model_file = ((self.manifest or {}).get("model") or {}).get(_MODEL_FILE)
        source = os.path.join(model_dir, model_file) if model_file else None
        return (
            "mserve_worker.BaseHandler.model",
            file_key(self.model_pt_path),
            file_digest(source) if source and os.path.isfile(source) else model_file,
            str(self.device),
            json.dumps(self.model_yaml_config or {}, sort_keys=True, default=str),
            _overridden_loaders(type(self)),
        )

    def _load_torchscript_model(self, model_pt_path: str) -> Any:
        import torch

        if safe_weights.is_safetensors(model_pt_path):
            raise ModelLoadError(
                f"{os.path.basename(model_pt_path)} holds tensors only, not a model: archive "
                f"the model's class with --model-file, and BaseHandler loads the tensors into it"
            )
        return torch.jit.load(model_pt_path, map_location=self.device)

    def _load_aoti_model(self, model_pt_path: str) -> Any:
        """An AOTInductor ``.so`` (TorchServe's rule: with ``pt2: {export: {aot_compile:
        true}}``) or ``.pt2`` package, loaded as the callable torch gives (aoti.py)."""
        try:
            return aoti.load(model_pt_path, self.device, self.model_yaml_config)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None

    def _load_torch_export_aot_compile(self, model_so_path: str) -> Any:
        """TorchServe's name for loading an AOT-compiled ``.so``; handlers written for it call
        or override this."""
        return aoti.load_shared_library(model_so_path, self.device)

    def _use_torch_export_aot_compile(self) -> bool:
        """TorchServe's check: the model config's ``pt2.export.aot_compile``."""
        return aoti.wants_aot_compile(self.model_yaml_config)

    def _load_onnx_model(self, model_pt_path: str) -> Any:
        """An onnxruntime session, as TorchServe opens ``.onnx`` files (onnx_session.py)."""
        try:
            return onnx_session.open_session(
                model_pt_path, self.map_location, getattr(self.device, "index", None)
            )
        except ImportError as exc:
            raise ModelLoadError(
                f"{os.path.basename(model_pt_path)} is an ONNX model, which BaseHandler runs "
                f"with onnxruntime, and this model's environment cannot import it ({exc}): "
                f"install onnxruntime (onnxruntime-gpu for CUDA) in the model's environment "
                f"(requirements.txt), or pip install it next to the server"
            ) from exc

    def _load_pickled_model(
        self, model_dir: str, model_file: str, model_pt_path: str | None
    ) -> Any:
        """Build the one ``nn.Module`` class of ``model_file``; load the state dict into it."""
        import torch

        module_name = os.path.splitext(os.path.basename(model_file))[0]
        if not os.path.isfile(os.path.join(model_dir, module_name + ".py")):
            raise ModelLoadError(
                f"the manifest's modelFile {model_file!r} is not in the model folder "
                f"{model_dir} (expected {module_name}.py there)"
            )
        module = importlib.import_module(module_name)
        classes = [
            value
            for value in vars(module).values()
            if inspect.isclass(value)
            and issubclass(value, torch.nn.Module)
            and value.__module__ == module.__name__
        ]
        if len(classes) != 1:
            found = ", ".join(c.__name__ for c in classes) or "none"
            raise ModelLoadError(
                f"model file {model_file!r} must define exactly one torch.nn.Module subclass "
                f"(the model to build); found {len(classes)}: {found}. Move the others to "
                f"another module, or override _load_pickled_model()"
            )
        if model_pt_path is None:
            return classes[0]()
        state = self._load_state_dict(model_pt_path)
        if weights.is_mapped(model_pt_path):  # warm tier: no initialisation, no copy
            return weights.build_with_state(classes[0], state)
        model = classes[0]()
        model.load_state_dict(state)
        return model

    def _load_state_dict(self, path: str) -> Any:
        """The state dict: a ``.safetensors`` file's tensors, or ``torch.load`` with
        ``weights_only=True`` unless the model config says ``weightsOnly: false``
        (safe_weights.py), mapped from the page cache when the warm tier is on (weights.py)."""
        try:
            if safe_weights.is_safetensors(path):
                return safe_weights.load_safetensors(path, self.device)
            only = safe_weights.weights_only(self.model_yaml_config)
        except (ImportError, ValueError) as exc:
            raise ModelLoadError(str(exc)) from None
        try:
            return weights.load_weights(path, map_location=self.device, weights_only=only)
        except pickle.UnpicklingError as exc:
            raise ModelLoadError(
                f"{path} is not a plain state dict (torch.load with weights_only=True refused "
                f"it: {str(exc).splitlines()[0]}); save model.state_dict() (or safetensors) as "
                f"the serialized file, or set {safe_weights.OPT_OUT}: false in the model config "
                f"to unpickle it whole, running the code it names (docs/weights-safety.md)"
            ) from exc

    def _apply_handler_config(self, model_yaml_config: dict[str, Any]) -> None:
        """Set the options the model config names under ``handler:``, checked against the type
        of the class default, so a typo or a wrong type fails at load and not mid-request."""
        options = model_yaml_config.get("handler")
        if not isinstance(options, dict):
            return
        for name in self.handler_options:
            if name not in options:
                continue
            default = getattr(type(self), name)
            value = _option_value(options[name], default)
            if value is None:
                raise ModelLoadError(
                    f"model config handler.{name} must be a {type(default).__name__} like the "
                    f"default {default!r}, found {options[name]!r}"
                )
            setattr(self, name, value)

    def get_device(self) -> Any:
        """The ``torch.device`` the model runs on (TorchServe's accessor)."""
        return self.device

    # Serving.

    def preprocess(self, data: list[Any]) -> Any:
        """Each request's ``data`` (or ``body``): numbers, nested lists of numbers, or such JSON
        sent as text; the rows are stacked into one tensor. A row whose shape differs from the
        batch's most common one is rejected (400 to that caller), not the whole batch."""
        import torch

        rows = []
        for idx, row in enumerate(data):
            try:
                rows.append((idx, torch.as_tensor(_numbers(request_input(row)))))
            except (BadInput, TypeError, ValueError, RuntimeError) as exc:
                self.reject(idx, f"input must be a number or a nested list of numbers: {exc}")
        if not rows:
            return None
        shapes = [tuple(tensor.shape) for _, tensor in rows]
        expected = max(shapes, key=shapes.count)  # ties: the earliest request's shape
        for (idx, _), shape in zip(rows, shapes):
            if shape != expected:
                self.reject(
                    idx,
                    f"input has shape {list(shape)}, but this batch's inputs have shape "
                    f"{list(expected)}",
                )
        return torch.stack([t for _, t in rows if tuple(t.shape) == expected]).to(self.device)

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """Call the model without autograd (an ONNX model: its first input is the batch, its
        first output the result, as a tensor)."""
        import torch

        if onnx_session.is_session(self.model):
            return onnx_session.run(self.model, data)
        with torch.inference_mode():
            return self.model(data, *args, **kwargs)

    def postprocess(self, data: Any) -> list[Any]:
        """One plain list per request."""
        return data.tolist()

    def handle(self, data: list[Any], context: Any) -> list[Any]:
        """preprocess -> inference -> postprocess for predictions, preprocess -> explain_handle
        for explanations; requests that preprocess rejected get their 400 in their place."""
        started = time.perf_counter()
        self.context = context
        self._rejected = {}
        if profiling.enabled():  # TorchServe's ENABLE_TORCH_PROFILER: a trace per batch
            output, _ = self._infer_with_profiler(data)
            return self._finish(output, data, context, started)
        # a traced batch: the server makes spans of these phases (mserve_worker/tracing.py)
        phases = getattr(context, "_mserve_phases", None)
        model_input = self.preprocess(data)
        if phases is not None:
            phases.append(("preprocess", started, time.perf_counter()))
        accepted = [row for i, row in enumerate(data) if i not in self._rejected]
        if not accepted:
            output: list[Any] = []
        elif self._is_explain():
            output = self.explain_handle(model_input, accepted)
        elif phases is None:
            output = self.postprocess(self.inference(model_input))
        else:
            began = time.perf_counter()
            inferred = self.inference(model_input)
            ended = time.perf_counter()
            phases.append(("inference", began, ended))
            output = self.postprocess(inferred)
            phases.append(("postprocess", ended, time.perf_counter()))
        return self._finish(output, data, context, started)

    def _finish(self, output: Any, data: list[Any], context: Any, started: float) -> Any:
        """The batch's answers, rejected requests in their place; ``HandlerTime`` recorded."""
        output = self._with_rejections(output, len(data), context)
        metrics = getattr(context, "metrics", None)
        if metrics is not None and hasattr(metrics, "add_time"):
            metrics.add_time("HandlerTime", round((time.perf_counter() - started) * 1000, 2))
        return output

    def _infer_with_profiler(self, data: list[Any]) -> tuple[Any, Any]:
        """preprocess -> inference -> postprocess (or explain_handle) under torch.profiler,
        writing a Chrome trace (mserve_worker/sdk/profiling.py); returns (output, profile).
        Set ``self.profiler_args`` (torch.profiler.profile's arguments) to change what is
        recorded and where the trace goes, as with TorchServe."""
        self.__dict__.setdefault("_rejected", {})
        return profiling.profiled(self, data, self._is_explain())

    def reject(self, idx: int, message: str) -> None:
        """Answer request ``idx`` of this batch with a 400 and ``message`` instead of a result.

        For preprocess: leave the request out of the model input; ``handle`` puts the error back
        in its place, so postprocess sees only the accepted requests.
        """
        self.__dict__.setdefault("_rejected", {})[idx] = message

    def _with_rejections(self, output: Any, size: int, context: Any) -> Any:
        rejected = getattr(self, "_rejected", None)
        if not rejected or not isinstance(output, list):
            return output
        results, accepted = [], iter(output)
        for idx in range(size):
            if idx in rejected:
                results.append(context.error_response(idx, 400, "BadInput", rejected[idx]))
            else:
                results.append(next(accepted, None))
        return results

    # Explanations.

    def _is_explain(self) -> bool:
        """True for ``/explanations`` requests: the context's operation, or the ``explain: True``
        request header that handlers written for TorchServe look at."""
        context = self.context if self.context is not None else getattr(self, "_context", None)
        if context is None:
            return False
        if getattr(context, "operation", "") == "explain":
            return True
        try:
            value = context.get_request_header(0, "explain")
        except (AttributeError, IndexError):
            return False
        return str(value).lower() == "true"

    def explain_handle(self, data_preprocess: Any, raw_data: list[Any]) -> Any:
        """Call ``get_insights`` with the preprocessed batch, the first request's input and its
        ``target`` (a form field or query parameter, or a key of a JSON body; default 0)."""
        row = raw_data[0] if raw_data else {}
        inputs, target = None, None
        if isinstance(row, dict):
            inputs = request_input(row)
            target = row.get("target")
            if target is None and isinstance(row.get("body"), dict):
                target = row["body"].get("target")
        if isinstance(target, str) and target.strip().lstrip("-").isdigit():
            target = int(target)
        return self.get_insights(data_preprocess, inputs, target or 0)

    def get_insights(self, tensor_data: Any, raw_data: Any, target: Any) -> Any:
        """Explanations for ``/explanations``: each handler that offers them implements this."""
        raise NotImplementedError(
            f"{type(self).__name__} does not explain its predictions: /explanations needs a "
            f"get_insights(self, tensor_data, raw_data, target) method returning one "
            f"explanation per request"
        )


def _option_value(value: Any, default: Any) -> Any:
    """``value`` when it has the kind of ``default`` (an int is a fine float; a list of numbers
    a fine tuple), else None."""
    if isinstance(default, tuple):
        ok = isinstance(value, (list, tuple)) and len(value) == len(default)
        return tuple(value) if ok and all(_is_number(v) for v in value) else None
    if isinstance(default, bool):
        return value if isinstance(value, bool) else None
    if isinstance(default, float):
        return float(value) if _is_number(value) else None
    if isinstance(default, int):
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return value if isinstance(value, type(default)) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def request_input(row: Any) -> Any:
    """A request's input as TorchServe handlers read it: the ``data`` field, else the body."""
    if not isinstance(row, dict):
        return row
    value = row.get("data")
    return row.get("body") if value is None else value


def _numbers(value: Any) -> Any:
    """JSON numbers as they are; JSON sent as text or bytes parsed first."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadInput(f"not JSON ({exc})") from None
    if not isinstance(value, (list, int, float)) or isinstance(value, bool):
        raise BadInput(f"found {type(value).__name__}")
    return value


def load_label_mapping(path: str) -> dict[str, str] | None:
    """``index_to_name.json`` as ``{"0": "cat", ...}``; None when the file is absent.

    ImageNet-style values (``["n01440764", "tench"]``) keep their last element, the name; the
    older detection form ``{"object_type_names": ["person", ...]}`` is a list of names.
    """
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            mapping = json.load(f)
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if isinstance(mapping, dict) and isinstance(mapping.get("object_type_names"), list):
        mapping = mapping["object_type_names"]
    if isinstance(mapping, list):
        mapping = {str(i): name for i, name in enumerate(mapping)}
    if not isinstance(mapping, dict):
        raise ModelLoadError(
            f"{path} must map class indexes to names ({{'0': 'cat', ...}}), "
            f"found a {type(mapping).__name__}"
        )
    return {
        str(key): str(value[-1] if isinstance(value, list) and value else value)
        for key, value in mapping.items()
    }


def map_class_to_label(
    probs: list[list[float]],
    mapping: dict[str, str] | None = None,
    classes: list[list[int]] | None = None,
) -> list[dict[str, float]]:
    """One ``{label: probability}`` dict per request, labels through ``mapping`` when given."""
    if classes is None:
        classes = [list(range(len(row))) for row in probs]
    return [
        {label_of(c, mapping): p for c, p in zip(row_classes, row_probs)}
        for row_classes, row_probs in zip(classes, probs)
    ]


def label_of(index: int, mapping: dict[str, str] | None) -> str:
    """The class name of ``index``, or the index as text when unmapped."""
    key = str(index)
    return mapping.get(key, key) if mapping else key


def _missing() -> Any:
    raise KeyError("the kept model is gone")  # never: looked up just after it was found


def _overridden_loaders(cls: type) -> str:
    """A digest of the ``_load*`` methods ``cls`` overrides (their bytecode, constants and
    names: not their line numbers, so an edit elsewhere in the file leaves it as it was)."""
    digest = hashlib.sha256()
    for name in sorted(n for n in dir(cls) if n.startswith("_load")):
        code = getattr(getattr(cls, name, None), "__code__", None)
        if code is None or getattr(BaseHandler, name, None) is getattr(cls, name):
            continue
        digest.update(name.encode())
        _code_digest(code, digest)
    return digest.hexdigest()


def _code_digest(code: Any, digest: Any) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            _code_digest(const, digest)
        else:
            digest.update(repr(const).encode())

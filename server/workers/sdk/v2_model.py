"""V2 model-server style: classes with ``load()`` and ``predict(request)``
(mlrun-v2-model-server.txt).

A model class written for that contract changes only its import line::

    from server.workers.sdk.v2_model import V2ModelServer

    class MyModel(V2ModelServer):
        def load(self):
            model_file, extra_data = self.get_model(suffix=".pkl")
            self.model = pickle.load(open(model_file, "rb"))

        def predict(self, request):
            return self.model.predict(request["inputs"])

One instance per worker is created with ``context`` (a :class:`ServerContext`), ``name`` (the
model name), ``model_path`` (the model folder) and the ``params`` mapping of the archive's model
config YAML as keyword arguments (mlrun's ``add_model(..., key=value)``), then ``load()`` runs
once. Each request of a batch is then served on its own:

- predict (``POST /v2/models/{m}/infer``, ``/predict``, ``/predictions/{m}``) and explain
  (``/v2/models/{m}/explain``, ``/explanations/{m}``): ``preprocess`` -> ``validate`` ->
  ``predict`` or ``explain`` -> ``{"id", "model_name", "model_version", "outputs"}`` ->
  ``postprocess``. The body must be a JSON object (or become one in ``preprocess``).
- any other operation ``POST /v2/models/{m}/{op}`` calls ``op_<op>(event)`` with a
  :class:`Event`; its return value is the response body.

Errors answer only their own request, with TorchServe's ``{"code", "type", "message"}`` body:
400 for a request ``preprocess`` or ``validate`` rejects, 404 for an unknown operation, 501 for
an ``explain`` the class does not implement, 500 when ``predict``/``explain``/``op_*`` raise.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import traceback
from typing import Any

PARAMS_KEY = "params"  # the model config YAML key holding the class's parameters
_SKIP_DIRS = ("MAR-INF", "__pycache__")
_CODE_SUFFIXES = (".py", ".pyc")


class V2ModelServer:
    """Base class of v2 model classes: implement ``load()`` and ``predict(request)``.

    Override ``preprocess``, ``validate``, ``postprocess`` and ``explain`` where needed, and add
    custom operations as ``op_<name>(event)`` methods (served at ``/v2/models/{m}/<name>``).
    ``input_path`` / ``result_path`` pick a dotted key of the request body as the request and
    write the response under a dotted key of the original body, as in mlrun.
    """

    def __init__(
        self,
        context: Any = None,
        name: str | None = None,
        model_path: str | None = None,
        model: Any = None,
        protocol: str | None = None,
        input_path: str | None = None,
        result_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.name = name
        self.version = ""
        if name and ":" in name:
            self.name, self.version = name.split(":", 1)
        self.context = context
        self.ready = False
        self.error = ""
        self.protocol = protocol or "v2"
        self.model_path = model_path
        self.model_spec: Any = None
        self.metrics: dict[str, Any] = {}
        self.labels: dict[str, str] = {}
        self._input_path = input_path
        self._result_path = result_path
        self._params = kwargs
        self._new_metrics: list[tuple[str, Any]] = []
        if model is not None:
            self.model = model
            self.ready = True

    def get_param(self, key: str, default: Any = None) -> Any:
        """A constructor keyword argument, else the server context's parameter ``key``."""
        if key in self._params:
            return self._params[key]
        get = getattr(self.context, "get_param", None)
        return get(key, default) if callable(get) else default

    def set_metric(self, name: str, value: Any) -> None:
        """Record a metric; numeric ones also reach mserve's custom metrics for the request."""
        self.metrics[name] = value
        self._new_metrics.append((name, value))

    def get_model(self, suffix: str = "") -> tuple[str, dict[str, DataItem]]:
        """``(model file, extra_data)`` from ``model_path`` (the model folder when served).

        The model file is the manifest's ``serializedFile`` when it ends with ``suffix``, else
        the one file at the top of the folder that ends with ``suffix``. ``extra_data`` maps the
        folder's other data files (not Python code, not ``MAR-INF/``), by relative path and by
        bare name when unambiguous, to :class:`DataItem` paths; the manifest's config and
        requirements files are not data either.
        """
        path = self.model_path
        if not path:
            raise ValueError(f"model {self.name!r} has no model_path to load from")
        if os.path.isfile(path):
            return path, {}
        serialized = _manifest_file(self.context, "serializedFile")
        if (
            serialized
            and serialized.endswith(suffix)
            and os.path.isfile(os.path.join(path, serialized))
        ):
            model_file = os.path.join(path, serialized)
        else:
            model_file = _only_file(path, suffix, serialized)
        not_data = [_manifest_file(self.context, k) for k in ("configFile", "requirementsFile")]
        return model_file, _extra_data(path, model_file, [n for n in not_data if n])

    def load(self) -> None:
        """Load the model (see :meth:`get_model`); a subclass must override it."""
        if not self.ready:
            raise NotImplementedError(f"{type(self).__name__} must define load()")

    def predict(self, request: dict[str, Any]) -> Any:
        """The model's outputs for ``request["inputs"]``; a subclass must override it."""
        raise NotImplementedError(f"{type(self).__name__} must define predict(request)")

    def explain(self, request: dict[str, Any]) -> Any:
        """An explanation of the prediction for ``request``; optional."""
        raise NotImplementedError(f"{type(self).__name__} does not implement explain(request)")

    def preprocess(self, request: Any, operation: str) -> Any:
        """Turn the request body into the request ``validate`` and ``predict`` get."""
        return request

    def validate(self, request: Any, operation: str) -> Any:
        """Check the v2 request shape: a JSON object whose ``"inputs"`` is a list."""
        if self.protocol == "v2":
            _check_v2(request)
        return request

    def postprocess(self, response: dict[str, Any]) -> Any:
        """Change the response (``{"id", "model_name", "outputs", ...}``) before it is sent."""
        return response


class DataItem(str):
    """A file of the model folder: a ``str`` path, with mlrun's DataItem reading helpers."""

    def local(self) -> str:
        return str(self)

    def get(self) -> bytes:
        with open(self, "rb") as f:
            return f.read()

    def as_df(self, **kwargs: Any) -> Any:
        """A pandas DataFrame of a CSV, JSON or Parquet file (pandas must be installed)."""
        import pandas  # optional: only the models that read tables need it

        if self.endswith(".parquet") or self.endswith(".pq"):
            return pandas.read_parquet(self, **kwargs)
        if self.endswith(".json"):
            return pandas.read_json(self, **kwargs)
        return pandas.read_csv(self, **kwargs)


class Response:
    """What an ``op_*`` method may return to choose the status, content type and headers."""

    def __init__(
        self,
        body: Any = None,
        content_type: str | None = None,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body = body
        self.content_type = content_type
        self.status_code = status_code
        self.headers = headers or {}


class Event:
    """One request as an ``op_*`` method sees it.

    ``body`` is decoded as for any handler (JSON to Python values, text to ``str``, else
    ``bytes``); ``path`` is the operation name; ``fields`` holds query parameters and form fields.
    """

    def __init__(self, row: dict[str, Any], op: str, request_id: str, headers: Any) -> None:
        self.body = row.get("body")
        self.fields = {k: v for k, v in row.items() if k != "body"}
        self.path = op
        self.method = "POST"
        self.id = request_id
        self.headers = dict(headers)
        self.content_type = _header(self.headers, "content-type")


class ServerContext:
    """``self.context`` of a model class: a logger, the config parameters, worker facts."""

    Response = Response

    def __init__(self, handler_context: Any, params: dict[str, Any], logger: Any) -> None:
        self.logger = logger
        self.handler_context = handler_context  # the TorchServe-style context, for the curious
        self.worker_id = getattr(handler_context, "worker_id", "")
        self.is_mock = False
        self._params = params

    def get_param(self, key: str, default: Any = None) -> Any:
        """A key of the ``params`` mapping in the archive's model config YAML."""
        return self._params.get(key, default)


class _KeywordLogger(logging.Logger):
    """A Logger that also takes mlrun's ``logger.info("msg", key=value)`` keyword fields."""

    def _log(self, level: int, msg: Any, args: Any, exc_info: Any = None, extra: Any = None,
             stack_info: bool = False, stacklevel: int = 1, **fields: Any) -> None:  # fmt: skip
        if fields:
            msg = f"{msg} " + " ".join(f"{k}={v!r}" for k, v in fields.items())
        super()._log(level, msg, args, exc_info, extra, stack_info, stacklevel + 1)


def _make_logger(model_name: str) -> logging.Logger:
    logger = _KeywordLogger(f"mserve.v2_model.{model_name}", logging.INFO)
    handler = logging.StreamHandler(sys.stderr)  # the server re-logs worker stderr
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    return logger


def _check_v2(request: Any) -> None:
    if not isinstance(request, dict):
        raise ValueError(
            f'Expected a JSON object like {{"inputs": [...]}}, got {type(request).__name__}'
        )
    if "inputs" not in request:
        raise ValueError('Expected key "inputs" in request body')
    if not isinstance(request["inputs"], list):
        raise ValueError('Expected "inputs" to be a list')


def _header(headers: dict[str, str], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def _manifest_file(context: Any, key: str) -> str | None:
    """A file the manifest names (``serializedFile``, ``configFile``, ...), if any."""
    handler_context = getattr(context, "handler_context", context)
    manifest = getattr(handler_context, "manifest", None) or {}
    return (manifest.get("model") or {}).get(key) or None


def _only_file(folder: str, suffix: str, serialized: str | None) -> str:
    if not suffix:
        raise ValueError(
            f"get_model(): the manifest names no serializedFile in {folder}; archive the model "
            f"with --serialized-file, or pass the file's suffix, e.g. get_model(suffix='.pkl')"
        )
    names = sorted(
        n
        for n in os.listdir(folder)
        if n.endswith(suffix) and os.path.isfile(os.path.join(folder, n))
    )
    if len(names) == 1:
        return os.path.join(folder, names[0])
    found = ", ".join(names) if names else "none"
    also = f" (serializedFile is {serialized!r})" if serialized else ""
    raise ValueError(
        f"get_model(suffix={suffix!r}) needs exactly one file ending with {suffix!r} in {folder}"
        f"{also}; found: {found}"
    )


def _extra_data(folder: str, model_file: str, not_data: list[str]) -> dict[str, DataItem]:
    paths: dict[str, DataItem] = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if (
                name.endswith(_CODE_SUFFIXES)
                or rel in not_data
                or os.path.samefile(path, model_file)
            ):
                continue
            paths[rel] = DataItem(path)
    stems: dict[str, list[DataItem]] = {}
    for rel, path in paths.items():
        stems.setdefault(os.path.splitext(rel)[0], []).append(path)
    for stem, found in stems.items():
        if len(found) == 1 and stem not in paths:
            paths[stem] = found[0]
    return paths


# The adapter: what loader.py calls.


def claims(target: Any) -> bool:
    """A subclass of :class:`V2ModelServer`, or any class with ``load()`` and ``predict()``."""
    if not inspect.isclass(target):
        return False
    if issubclass(target, V2ModelServer):
        return True
    return callable(getattr(target, "load", None)) and callable(getattr(target, "predict", None))


def load(target: Any, module: Any, context: Any) -> Any:
    """Create the model object, run its ``load()`` and return the per-batch entry."""
    from ..loader import V2_MODEL, HandlerLoadError, LoadedHandler

    label = f"{module.__name__}:{target.__name__}"
    _check_methods(target, label, HandlerLoadError)
    params = context.model_yaml_config.get(PARAMS_KEY) or {}
    if not isinstance(params, dict):
        raise HandlerLoadError(
            f"model config key {PARAMS_KEY!r} must be a mapping of parameter names to values "
            f"for {label}, found {type(params).__name__}"
        )
    server_context = ServerContext(context, params, _make_logger(context.model_name))
    model_dir = context.system_properties["model_dir"]
    given = {"context": server_context, "name": context.model_name, "model_path": model_dir}
    reserved = sorted(set(params) & {*given, "model"})
    if reserved:
        raise HandlerLoadError(
            f"model config {PARAMS_KEY!r} of {label} sets {', '.join(reserved)}, which the "
            f"server sets itself; rename those parameters"
        )
    instance = _create(target, label, {**given, **params}, HandlerLoadError)
    for name, value in given.items():  # what a custom __init__ did not keep
        if getattr(instance, name, None) in (None, ""):
            setattr(instance, name, value)
    if not getattr(instance, "version", "") and context.model_version:
        instance.version = context.model_version
    if not getattr(instance, "ready", False):
        instance.load()
        instance.ready = True
    getattr(instance, "_new_metrics", []).clear()
    server_context.logger.info(f"model {instance.name} was loaded")
    served = _Served(instance)
    return LoadedHandler(V2_MODEL, served.handle, instance=instance, module=module)


def _check_methods(target: type, label: str, error: type) -> None:
    if issubclass(target, V2ModelServer):
        for method in ("load", "predict"):
            if getattr(target, method) is getattr(V2ModelServer, method):
                raise error(
                    f"{label} subclasses V2ModelServer but does not define {method}(); a v2 model "
                    f"class needs load() (read the model, see get_model()) and predict(request)"
                )
    for method, args in (("load", (None,)), ("predict", (None, {}))):
        try:
            inspect.signature(getattr(target, method)).bind(*args)
        except TypeError:
            shown = inspect.signature(getattr(target, method))
            wanted = "load(self)" if method == "load" else "predict(self, request)"
            raise error(f"{label}.{method}{shown} cannot be called as {wanted}") from None
        except ValueError:
            pass  # no signature to inspect (implemented in C); just call it


def _create(target: type, label: str, kwargs: dict[str, Any], error: type) -> Any:
    """``target(**kwargs)`` with the keyword arguments its ``__init__`` accepts."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return target(**kwargs)
    accepts_all = any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    )
    if not accepts_all:
        kwargs = {k: v for k, v in kwargs.items() if k in signature.parameters}
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise error(
            f"cannot create {label}: __init__{signature} ({exc}); the server passes context, "
            f"name, model_path and the model config's {PARAMS_KEY!r} as keyword arguments"
        ) from None
    return target(**kwargs)


class _Served:
    """Serves each request of a batch through the model object, one at a time."""

    def __init__(self, instance: Any) -> None:
        self.model = instance

    def handle(self, batch: list[Any], context: Any) -> list[Any]:
        return [self._one(idx, row, context) for idx, row in enumerate(batch)]

    def _one(self, idx: int, row: Any, context: Any) -> Any:
        op = context.operation
        body = row.get("body")
        if op == "" and isinstance(body, dict) and isinstance(body.get("operation"), str):
            op = body["operation"]  # mlrun lets a predict request's body name the operation
        if op in ("", "infer", "predict"):
            return self._infer(idx, row, context, "infer", "predict")
        if op == "explain":
            return self._infer(idx, row, context, "explain", "explain")
        return self._custom(idx, row, context, op)

    def _infer(self, idx: int, row: Any, context: Any, op: str, method_name: str) -> Any:
        model = self.model
        if not getattr(model, "ready", True):
            return _error(context, idx, 503, "ModelNotReady", f"model {model.name} is not ready")
        body = row.get("body")
        event_id = context.get_request_id(idx)
        if isinstance(body, dict) and body.get("id") is not None:
            event_id = body["id"]
        try:
            request = _select(body, getattr(model, "_input_path", None))
            preprocess = getattr(model, "preprocess", None)
            if callable(preprocess):
                request = preprocess(request, op)
            if not isinstance(request, dict):
                raise ValueError(
                    f'the {op} request must be a JSON object like {{"inputs": [...]}}, '
                    f"got {type(request).__name__}"
                )
            validate = getattr(model, "validate", None)
            request = validate(request, op) if callable(validate) else _valid(request)
        except Exception as exc:  # the request was refused before the model ran
            return _error(context, idx, 400, "InvalidRequest", str(exc))
        method = getattr(model, method_name, None)
        if not callable(method):
            return _not_implemented(context, idx, model, method_name)
        try:
            outputs = method(request)
        except NotImplementedError:
            if method_name == "predict":
                raise
            return _not_implemented(context, idx, model, method_name)
        except Exception as exc:
            return _failed(context, idx, model, method_name, exc)
        response = {"id": event_id, "model_name": model.name, "outputs": outputs}
        if getattr(model, "version", ""):
            response["model_version"] = model.version
        postprocess = getattr(model, "postprocess", None)
        if callable(postprocess):
            try:
                response = postprocess(response)
            except Exception as exc:
                return _failed(context, idx, model, "postprocess", exc)
        self._push_metrics(context, idx)
        return _place(body, getattr(model, "_result_path", None), response)

    def _custom(self, idx: int, row: Any, context: Any, op: str) -> Any:
        model = self.model
        method = getattr(model, "op_" + op, None) if op.isidentifier() else None
        if not callable(method):
            custom = sorted(n[3:] for n in dir(model) if n.startswith("op_") and n[3:])
            available = ", ".join(["infer", "predict", "explain", *custom])
            return _error(
                context, idx, 404, "OperationNotFound",
                f"model {model.name} has no operation {op!r} (no op_{op} method); "
                f"available: {available}",
            )  # fmt: skip
        headers = context.get_all_request_header(idx)
        event = Event(row, op, context.get_request_id(idx), headers)
        try:
            result = method(event)
        except Exception as exc:
            return _failed(context, idx, model, f"op_{op}", exc)
        self._push_metrics(context, idx)
        if isinstance(result, Response):
            context.set_response_status(result.status_code, "", idx)
            for key, value in result.headers.items():
                context.set_response_header(idx, key, value)
            if result.content_type:
                context.set_response_content_type(idx, result.content_type)
            return b"" if result.body is None else result.body
        return result

    def _push_metrics(self, context: Any, idx: int) -> None:
        pending = getattr(self.model, "_new_metrics", None)
        if not pending:
            return
        for name, value in pending:
            if isinstance(name, str) and name and _is_number(value):
                context.metrics.add_metric(name, value, idx=idx)
        pending.clear()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _valid(request: dict[str, Any]) -> dict[str, Any]:
    _check_v2(request)
    return request


def _select(body: Any, path: str | None) -> Any:
    """The part of the body at the dotted ``input_path`` (all of it when there is none)."""
    if not path:
        return body
    value = body
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"input_path {path!r}: the request body has no {key!r} there")
        value = value[key]
    return value


def _place(body: Any, path: str | None, response: Any) -> Any:
    """The original body with the response under the dotted ``result_path`` (mlrun's rule)."""
    if not path or not isinstance(body, dict):
        return response
    result = json.loads(json.dumps(body))  # a deep copy of plain JSON values
    where = result
    keys = path.split(".")
    for key in keys[:-1]:
        if not isinstance(where.get(key), dict):
            where[key] = {}
        where = where[key]
    where[keys[-1]] = response
    return result


def _error(context: Any, idx: int, code: int, kind: str, message: str) -> dict[str, Any]:
    context.set_response_status(code, "", idx)
    return {"code": code, "type": kind, "message": message}


def _not_implemented(context: Any, idx: int, model: Any, method: str) -> dict[str, Any]:
    return _error(
        context, idx, 501, "NotImplemented",
        f"model {model.name} does not implement {method}(request); "
        f"its class {type(model).__name__} must define it to serve this operation",
    )  # fmt: skip


def _failed(context: Any, idx: int, model: Any, where: str, exc: Exception) -> dict[str, Any]:
    print(f"request {context.get_request_id(idx)}: {where} failed", file=sys.stderr)
    traceback.print_exc()  # the server re-logs worker stderr under the model's name
    return _error(
        context, idx, 500, "InternalServerError",
        f"{type(model).__name__}.{where} failed: {type(exc).__name__}: {exc}",
    )  # fmt: skip

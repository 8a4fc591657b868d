"""V2 model-server style: classes with ``load()`` and ``predict(request)``
(mlrun-v2-model-server.txt).

A model class written for that contract runs unedited: inside a worker
``from mlrun.serving import V2ModelServer`` gives this class (see
:mod:`mserve_worker.stand_ins`), also importable from here::

    from mlrun.serving import V2ModelServer

    class MyModel(V2ModelServer):
        def load(self):
            model_file, extra_data = self.get_model(suffix=".pkl")
            self.model = pickle.load(open(model_file, "rb"))

        def predict(self, request):
            return self.model.predict(request["inputs"])

One instance per worker is created with ``context`` (a :class:`ServerContext`), ``name`` (the
model name), ``model_path`` (the model folder; ``get_model()`` finds the files in it) and the
``params`` mapping of the archive's model config YAML as keyword arguments, as mlrun's
``add_model(..., key=value)`` passes them: ``get_param(key)`` reads them, and the keys
``protocol``, ``input_path`` and ``result_path`` set those constructor arguments::

    batchSize: 4        # model config YAML (model-archiver -c): server settings, then
    params:             # the class's parameters
      threshold: 0.5

Then ``load()`` runs once (a failure fails the worker's load with that exception) and ``ready``
becomes True. Each request of a batch is then served on its own:

- predict (``POST /v2/models/{m}/infer``, ``/predict``, ``/predictions/{m}``) and explain
  (``/v2/models/{m}/explain``, ``/explanations/{m}``): ``preprocess`` -> ``validate`` ->
  ``predict`` or ``explain`` -> ``{"id", "model_name", "model_version", "outputs"}`` ->
  ``postprocess``. The body must be a JSON object (or become one in ``preprocess``).
- any other operation ``POST /v2/models/{m}/{op}`` calls ``op_<op>(event)`` with a
  :class:`Event`; its return value is the response body.

When the server logs the model for monitoring (docs/inference-logging.md), each
predict/explain is recorded as mlrun's model monitoring stream has it: what
``logged_results(request, response, op)`` returns (``(inputs, outputs)``), else the request and
response; the values ``set_metric`` recorded ride along; a failure is recorded with its message.

Errors answer only their own request, with TorchServe's ``{"code", "type", "message"}`` body:
400 for a request ``preprocess`` or ``validate`` rejects, 404 for an unknown operation, 501 for
an ``explain`` the class does not implement, 500 when ``predict``/``explain``/``op_*`` raise.
"""

from __future__ import annotations

import os
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
            check_v2(request)
        return request

    def postprocess(self, response: dict[str, Any]) -> Any:
        """Change the response (``{"id", "model_name", "outputs", ...}``) before it is sent."""
        return response

    def logged_results(self, request: dict[str, Any], response: Any, op: str) -> Any:
        """What model monitoring records of a request, when the server logs this model
        (docs/inference-logging.md): ``(inputs, outputs)`` lists to record instead
        of the request and response, or ``(None, None)`` to record them as they are."""
        return None, None


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
        self.headers = Headers(headers)
        self.content_type = self.headers.get("content-type")


class Headers(dict):  # type: ignore[type-arg]
    """Request headers as sent; lookups ignore case, as HTTP header names do."""

    def _key(self, key: Any) -> Any:
        if isinstance(key, str) and not dict.__contains__(self, key):
            for name in self:
                if name.lower() == key.lower():
                    return name
        return key

    def __getitem__(self, key: Any) -> Any:
        return dict.__getitem__(self, self._key(key))

    def __contains__(self, key: Any) -> bool:
        return dict.__contains__(self, self._key(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return dict.get(self, self._key(key), default)


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


def check_v2(request: Any) -> None:
    """The v2 protocol's request shape; raises ValueError (a 400 for the caller) otherwise."""
    if not isinstance(request, dict):
        raise ValueError(
            f'Expected a JSON object like {{"inputs": [...]}}, got {type(request).__name__}'
        )
    if "inputs" not in request:
        raise ValueError('Expected key "inputs" in request body')
    if not isinstance(request["inputs"], (list, dict)):  # rows, or OIP tensors by name
        raise ValueError('Expected "inputs" to be a list')


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

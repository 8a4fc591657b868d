"""Kernel style: a ``Kernel`` subclass with ``on_kernel_start`` / ``on_task_invoke`` /
``on_kernel_shutdown``, for kernel files written for another inference service (kernel-file.txt).

A kernel file runs unedited: inside a worker ``from redhareapi import Kernel`` gives this
``Kernel`` (see :mod:`mserve_worker.stand_ins`), also importable as
``mserve_worker.sdk.kernel``. Its lifecycle maps onto the worker's:

- load: the class is created with no arguments and ``on_kernel_start(kernel_context)`` runs once;
  :class:`KernelContext` gives the worker id and a JSON model description.
- each batch: ``on_task_invoke(task_context)`` runs once with the first of the batch's tasks, linked
  with ``next()`` / ``prev()`` (None past the ends). A task whose output the kernel never set
  answers its caller 500 with a message naming the task id; the other tasks are unaffected.
- stop (scale down, unregister, server stop): ``on_kernel_shutdown()``.

Inputs: ``get_input_data()`` is the request body as the kernel file expects to ``json.loads`` it:
the JSON text exactly as sent (``str``) for JSON requests, the text (``str``) for ``text/*``
requests, and the raw ``bytes`` otherwise (images, octet streams, form posts). Outputs:
``set_output_data`` takes ``str``, ``bytes`` or a JSON-able value; a ``str`` holding a JSON
object or array is answered as ``application/json``, other text as ``text/plain``, bytes as
``application/octet-stream``.

Kernels serve predictions only (``/predictions``, ``/v2/models/{m}/infer``); other operations
answer 404 per request.

Model options come from the ``kernel`` section of the archive's model config YAML: ``attributes``,
``mk_environments``, ``creator`` and ``service_uri`` are copied into the model description.

Standard library only, Python 3.8+, nothing done at import time.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import time
import uuid
from typing import Any

from ..contract import KERNEL, HandlerLoadError, LoadedHandler, create_instance
from ..payload import is_json, with_body

STYLE = KERNEL
SCHEMA_VERSION = "1"
_CONFIG_KEY = "kernel"


class Kernel:
    """Base class of model kernels; override the three ``on_*`` methods.

    ``on_kernel_start`` and ``on_kernel_shutdown`` do nothing unless overridden;
    ``on_task_invoke`` must be overridden (a kernel without it fails at load).
    """

    def on_kernel_start(self, kernel_context: KernelContext) -> None:
        """Load the model; runs once per worker before any task."""

    def on_task_invoke(self, task_context: TaskContext) -> None:
        """Run the batch that starts at ``task_context``; set each task's output."""
        raise NotImplementedError(f"{type(self).__name__} does not define on_task_invoke")

    def on_kernel_shutdown(self) -> None:
        """Clean up; runs once when the worker stops."""

    # Logging: lines on stderr, which mserve re-logs under the model's name.
    @staticmethod
    def log_info(msg: Any) -> None:
        _log("INFO", msg)

    @staticmethod
    def log_warn(msg: Any) -> None:
        _log("WARN", msg)

    @staticmethod
    def log_debug(msg: Any) -> None:
        _log("DEBUG", msg)

    @staticmethod
    def log_error(msg: Any) -> None:
        _log("ERROR", msg)

    def run(self) -> None:
        """What the kernel file's ``if __name__ == "__main__"`` block calls.

        mserve loads kernels itself (``run`` is never called there), so running the file on its
        own only says how to serve it, and exits with status 2.
        """
        name = type(self).__name__
        sys.stderr.write(
            f"{name} is a model kernel: mserve loads it, it does not run on its own.\n"
            f"  model-archiver --model-name NAME --handler {_file_of(type(self))} "
            f"--extra-files WEIGHTS --export-path STORE\n"
            f"  mserve --start --model-store STORE --models NAME=NAME.mar\n"
        )
        raise SystemExit(2)


def _log(level: str, msg: Any) -> None:
    sys.stderr.write(f"[kernel] {level}: {msg}\n")
    sys.stderr.flush()


def _file_of(cls: type) -> str:
    try:
        return os.path.basename(inspect.getfile(cls))
    except (TypeError, OSError):
        return "kernel.py"


class KernelContext:
    """What ``on_kernel_start`` gets: the worker's id and the model's description."""

    def __init__(self, context: Any, kernel_path: str, started_at: int) -> None:
        self._context = context
        self._kernel_path = kernel_path
        self._started_at = started_at
        self._description: str | None = None

    def get_instance_id(self) -> str:
        """The worker id (unique among the server's workers, e.g. ``"9000"``)."""
        return str(self._context.worker_id)

    def get_model_description(self) -> str:
        """The model description as a JSON text (built once, on first use)."""
        if self._description is None:
            self._description = json.dumps(
                describe_model(self._context, self._kernel_path, self._started_at)
            )
        return self._description


def describe_model(context: Any, kernel_path: str, started_at: int) -> dict[str, Any]:
    """The fields kernel files read from ``get_model_description()``.

    ``weight_path`` is the folder of the archive's serialized file relative to ``model_path``
    (``"./"`` for an archive's usual flat layout), so ``os.path.join(model_path, weight_path,
    name)`` works as it did; ``weight_file`` (mserve's addition) is the serialized file's full
    path, or ``""`` when the archive has none.
    """
    model_dir = str(context.system_properties.get("model_dir") or os.getcwd())
    manifest = context.manifest if isinstance(context.manifest, dict) else {}
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    options = _options(context)
    name = context.model_name or str(model.get("modelName", ""))
    version = context.model_version or str(model.get("modelVersion", ""))
    serialized = str(model.get("serializedFile") or "")
    weight_dir = os.path.dirname(serialized)
    folder_mtime = _mtime(model_dir)
    created = _created_on(manifest.get("createdOn"))
    return {
        "name": name,
        "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"mserve:model/{name}/{version}")),
        "tag": version,
        "size": _folder_bytes(model_dir),
        "weight_path": weight_dir + "/" if weight_dir else "./",
        "weight_file": os.path.join(model_dir, serialized) if serialized else "",
        "model_path": model_dir,
        "create_time": created if created is not None else folder_mtime,
        "last_updated_time": folder_mtime,
        "started_at": started_at,
        "creator": str(options.get("creator", "")),
        "runtime": str(manifest.get("runtime", "python")),
        "kernel_path": kernel_path,
        "service_uri": str(
            options.get("service_uri", f"/predictions/{name}/{version}" if version else "")
        ),
        "attributes": _list_option(options, "attributes"),
        "mk_environments": _list_option(options, "mk_environments"),
        "schema_version": SCHEMA_VERSION,
    }


def _options(context: Any) -> dict[str, Any]:
    config = getattr(context, "model_yaml_config", None) or {}
    section = config.get(_CONFIG_KEY) if isinstance(config, dict) else None
    return section if isinstance(section, dict) else {}


def _list_option(options: dict[str, Any], key: str) -> list[Any]:
    value = options.get(key, [])
    if isinstance(value, dict):  # a YAML mapping reads naturally; kernels expect a list
        return [{"key": str(k), "value": v} for k, v in value.items()]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _created_on(text: Any) -> int | None:
    """torch-model-archiver's ``createdOn`` (``dd/mm/YYYY HH:MM:SS``, local time) as epoch."""
    if not isinstance(text, str):
        return None
    try:
        return int(time.mktime(time.strptime(text, "%d/%m/%Y %H:%M:%S")))
    except (ValueError, OverflowError):
        return None


def _mtime(path: str) -> int:
    try:
        return int(os.stat(path).st_mtime)
    except OSError:
        return 0


def _folder_bytes(folder: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we walk: not counted
                total += os.lstat(os.path.join(root, name)).st_size
    return total


class TaskContext:
    """One request of the batch; ``next()`` / ``prev()`` walk the batch in arrival order."""

    def __init__(self, context: Any, index: int, body: Any) -> None:
        self._context = context
        self._index = index
        self._body = body
        self._input: Any = None
        self._output: Any = None
        self._has_output = False
        self._next: TaskContext | None = None
        self._prev: TaskContext | None = None

    def get_id(self) -> str:
        """The request id (also the response's ``X-Request-Id``)."""
        return str(self._context.get_request_id(self._index))

    def get_version(self) -> str:
        """The model version being served."""
        return str(self._context.model_version)

    def get_input_data(self) -> str | bytes:
        """The request body: JSON text or text as ``str``, anything else as raw ``bytes``."""
        if self._input is None:
            raw = getattr(self._context, "get_request_body", None)
            self._input = _input_of(
                self._body, self._content_type(), raw(self._index) if raw else None
            )
        return self._input

    def set_output_data(self, data: Any) -> None:
        """The response body: ``str``, ``bytes`` or a JSON-able value."""
        self._output = data
        self._has_output = True

    def get_output_data(self) -> Any:
        """What :meth:`set_output_data` set (None before)."""
        return self._output

    def next(self) -> TaskContext | None:
        return self._next

    def prev(self) -> TaskContext | None:
        return self._prev

    # mserve additions, for what the original SDK had no word for.
    def get_request_header(self, key: str) -> str | None:
        """A request header (any case), or None."""
        return self._context.get_request_header(self._index, key)

    def set_response_status(self, code: int, phrase: str = "") -> None:
        """This task's HTTP status (e.g. 400 for bad input), leaving the others' alone."""
        self._context.set_response_status(code, phrase, self._index)

    def _content_type(self) -> str:
        value = self._context.get_request_header(self._index, "content-type") or ""
        return value.split(";", 1)[0].strip().lower()

    def __repr__(self) -> str:
        return f"TaskContext(id={self.get_id()!r})"


def _input_of(body: Any, content_type: str, raw: bytes | None = None) -> str | bytes:
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body)
    if isinstance(body, str) and not is_json(content_type):
        return body
    # The runtime parsed the JSON body; kernels parse it again themselves, so give them its text
    # as sent (numbers, spacing and key order untouched).
    if raw is not None:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            pass  # another charset: the runtime decoded it, so re-encode what it found
    return json.dumps(body, ensure_ascii=False)


def _json_text(value: str) -> bool:
    head = value.lstrip()[:1]
    if head not in ("{", "["):
        return False
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def claims(target: Any) -> bool:
    """A class with ``on_task_invoke(task_context)`` is a kernel (ours or a look-alike)."""
    return inspect.isclass(target) and callable(getattr(target, "on_task_invoke", None))


def load(target: Any, module: Any, context: Any) -> Any:
    """Create the kernel, run ``on_kernel_start``, and wrap ``on_task_invoke`` per batch."""
    label = f"{getattr(module, '__name__', '?')}:{target.__name__}"
    if getattr(target, "on_task_invoke", None) is Kernel.on_task_invoke:
        raise HandlerLoadError(
            f"kernel class {label!r} does not define on_task_invoke(self, task_context); "
            f"a kernel must override it to run its tasks"
        )
    kernel = create_instance(target, label)
    _method(kernel, "on_task_invoke", "task_context", label)
    start = _method(kernel, "on_kernel_start", "kernel_context", label, optional=True)
    stop = _method(kernel, "on_kernel_shutdown", "", label, optional=True)
    if start is not None:
        start(KernelContext(context, _kernel_path(module, context), int(time.time())))

    def entry(batch: list[Any], ctx: Any) -> list[Any]:
        return _run_batch(kernel, batch, ctx)

    return LoadedHandler(STYLE, entry, instance=kernel, module=module, on_shutdown=stop or _nothing)


def _nothing() -> None:
    """The stop hook of a look-alike kernel without on_kernel_shutdown."""


def _method(kernel: Any, name: str, argument: str, label: str, optional: bool = False) -> Any:
    """The kernel's bound method ``name``, checked to accept ``argument`` (or no argument)."""
    method = getattr(kernel, name, None)
    if method is None and optional:
        return None
    wanted = f"{name}(self{', ' + argument if argument else ''})"
    if not callable(method):
        raise HandlerLoadError(f"kernel class {label!r}: {name} is not a method; expected {wanted}")
    try:
        inspect.signature(method).bind(*([None] if argument else []))
    except TypeError:
        raise HandlerLoadError(
            f"kernel class {label!r}: {name}{inspect.signature(method)} cannot be called as "
            f"{wanted}"
        ) from None
    except ValueError:
        pass  # no signature to inspect (implemented in C); just call it
    return method


def _kernel_path(module: Any, context: Any) -> str:
    """The kernel file, relative to the model folder when it is inside it."""
    path = getattr(module, "__file__", None) or ""
    model_dir = context.system_properties.get("model_dir") or ""
    if path and model_dir:
        relative = os.path.relpath(os.path.realpath(path), os.path.realpath(model_dir))
        if not relative.startswith(os.pardir):
            return relative
    return path


def _run_batch(kernel: Any, batch: list[Any], context: Any) -> list[Any]:
    operation = getattr(context, "operation", "")
    if operation:
        message = (
            f"model {context.model_name!r} is a kernel, which serves predictions only; "
            f"it has no {operation!r} operation"
        )
        for i in range(len(batch)):
            context.set_response_status(404, "Not Found", i)
        return [message] * len(batch)
    tasks = [
        TaskContext(context, i, with_body(row, context, i).get("body"))
        for i, row in enumerate(batch)
    ]
    for before, after in zip(tasks, tasks[1:]):
        before._next, after._prev = after, before
    kernel.on_task_invoke(tasks[0])
    outputs = []
    for i, task in enumerate(tasks):
        if not task._has_output:
            message = f"the kernel set no output for task {task.get_id()}"
            _log("ERROR", message)
            context.set_response_status(500, "Internal Server Error", i)
            outputs.append(message)
            continue
        output = task._output
        if isinstance(output, str) and _json_text(output):
            context.set_response_content_type(i, "application/json")
        outputs.append(output)
    return outputs

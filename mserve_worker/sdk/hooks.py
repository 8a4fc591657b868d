"""Hooks + driver style: a hooks file run around one driver per stage (kibernetika-serving).

This runs inside a worker process, in the model's own Python environment: standard library only
at import time, Python 3.8+. numpy is imported when the style loads (inputs are numpy arrays).

The hooks file is the archive's handler module and imports nothing from us. It defines any of:

``init_hook(**params)``
    Called once at load, before the drivers load. ``params`` holds every stage's ``options``
    (a later stage's value wins on a shared name), ``model_path`` (the first stage's weights
    file, absolute, or None), ``model_paths`` (one per stage) and ``model_dir``. A hook without
    ``**params`` gets only the names it declares.
``preprocess`` / ``postprocess``
    A function, or a list with one entry per pipeline stage (``None``: no hook there). A single
    function with a pipeline of several stages runs before the first stage (preprocess) or
    after the last (postprocess). Accepted signatures, inspected once at load:
    ``(inputs)``, ``(inputs, ctx)``, ``(inputs, **kwargs)``, ``(inputs, ctx, **kwargs)``. The
    second positional parameter, whatever its name, gets ``ctx``; named parameters after it get
    the driver keyword argument of that name (``model``, ``model_class``, ``driver``). A wrapper
    taking only ``*args`` (and ``**kwargs``) gets ``inputs`` alone, unless it was made with
    ``functools.wraps`` (then the wrapped function's signature counts).

The model config YAML (``model-archiver -c``) chooses the drivers, at its top level::

    driver: pytorch                # one stage; default when nothing is set: one "null" stage
    model_path: weights.pt         # relative to the model folder; default: serializedFile
    options: {model_class: "net:Net"}

    pipeline:                      # or several stages, run in order (not with the keys above)
      - {driver: pytorch, model_path: detector.pt, options: {model_class: "det:Det"}}
      - {driver: "null"}

Per request: the JSON body is ``{"inputs": {name: array}}`` or directly ``{name: array}``; each
value becomes a numpy array. A fresh ``ctx`` (:class:`HookContext`) goes through every hook of
the request. For each stage: preprocess, driver, postprocess. When the dict reaching a driver
holds the key ``ml-serving-ignore``, the key is removed; if its value is true the driver does
not run and the stage's outputs are those inputs (its postprocess still runs). The final result
is sent as JSON with arrays as lists (a ``str`` or ``bytes`` result is sent as it is). A body that
is not a JSON object answers 400; a hook or driver that raises answers 500 for that request
only, naming the hook; the other requests of the batch are unaffected.
"""

from __future__ import annotations

import inspect
import json
import traceback
from typing import Any

from ..contract import HOOKS, HandlerLoadError, LoadedHandler, accepted_keywords
from ..payload import with_body
from .drivers import StageConfig, driver_class, stage_configs

HOOK_NAMES = ("init_hook", "preprocess", "postprocess")
IGNORE_KEY = "ml-serving-ignore"
_SIGNATURES = "(inputs), (inputs, ctx), (inputs, **kwargs) or (inputs, ctx, **kwargs)"


def claims(module: Any) -> bool:
    """A module with ``init_hook``, a ``preprocess`` / ``postprocess`` function defined in it, or
    a list holding a function under one of those names. A ``preprocess`` merely imported from a
    library, or a list of names, does not count, so a module that fits no style still gets the
    loader's "fits no style" message (``--handler-style hooks`` forces this style)."""
    if callable(getattr(module, "init_hook", None)):
        return True
    for name in ("preprocess", "postprocess"):
        value = getattr(module, name, None)
        if isinstance(value, (list, tuple)):
            if any(callable(v) for v in value):
                return True
        elif callable(value) and getattr(value, "__module__", None) == module.__name__:
            return True
    return False


class HookContext:
    """The ``ctx`` of one request, shared by all its hooks: set an attribute in one, read it in a
    later one. Starts with ``request_id``, ``headers`` (request headers), ``batch_index`` and
    ``batch_count`` (this request's place in the batch the worker is serving)."""

    def __init__(
        self, request_id: str, headers: dict[str, str], batch_index: int, batch_count: int
    ) -> None:
        self.request_id = request_id
        self.headers = headers
        self.batch_index = batch_index
        self.batch_count = batch_count

    def __repr__(self) -> str:
        return f"HookContext({vars(self)!r})"


class RequestFailed(Exception):
    """One request's failure: its status and the TorchServe-shaped error body."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


class Hook:
    """One user hook and how to call it, worked out from its signature at load."""

    def __init__(self, fn: Any, label: str, kwarg_names: tuple[str, ...]) -> None:
        self.fn = fn
        self.label = label
        self.pass_ctx = False
        self.kwargs: tuple[str, ...] | None = ()  # None: all of the driver's
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            return  # no signature to read (a builtin): call it with inputs alone
        params = list(signature.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not positional and not any(p.kind == p.VAR_POSITIONAL for p in params):
            raise HandlerLoadError(
                f"{label} takes no inputs argument: it is {_name_of(fn)}{signature}; "
                f"accepted: {_SIGNATURES}"
            )
        if not positional:
            return  # a wrapper taking only *args (and **kwargs): inputs alone, as it forwards them
        self.pass_ctx = len(positional) >= 2
        named = positional[2:] + [p for p in params if p.kind == p.KEYWORD_ONLY]
        unknown = [p.name for p in named if p.name not in kwarg_names and p.default is p.empty]
        if unknown:
            raise HandlerLoadError(
                f"{label} is {_name_of(fn)}{signature}: nothing to pass to "
                f"{', '.join(unknown)}; accepted: {_SIGNATURES}, where the driver's kwargs are "
                f"{', '.join(kwarg_names)}"
            )
        if any(p.kind == p.VAR_KEYWORD for p in params):
            self.kwargs = None
        else:
            self.kwargs = tuple(p.name for p in named if p.name in kwarg_names)

    def __call__(self, value: Any, ctx: HookContext, driver_kwargs: dict[str, Any]) -> Any:
        if self.kwargs is None:
            kwargs = driver_kwargs
        else:
            kwargs = {name: driver_kwargs[name] for name in self.kwargs}
        try:
            result = self.fn(value, ctx, **kwargs) if self.pass_ctx else self.fn(value, **kwargs)
        except Exception as exc:  # the per-request boundary: only this request fails
            traceback.print_exc()
            raise RequestFailed(
                500, "HookError", f"{self.label} raised {type(exc).__name__}: {exc}"
            ) from exc
        if result is None:
            raise RequestFailed(
                500,
                "HookError",
                f"{self.label} returned None; a hook must return the dict it was given "
                f"(or a new one)",
            )
        return result


class Stage:
    """One driver with the hooks around it."""

    def __init__(self, label: str, driver: Any, pre: Hook | None, post: Hook | None) -> None:
        self.label = label
        self.driver = driver
        self.pre = pre
        self.post = post
        self.kwargs = driver.hook_kwargs()

    def run(self, inputs: Any, ctx: HookContext) -> Any:
        if self.pre is not None:
            inputs = self.pre(inputs, ctx, self.kwargs)
        skip = False
        if isinstance(inputs, dict) and IGNORE_KEY in inputs:
            inputs = dict(inputs)
            skip = _is_true(inputs.pop(IGNORE_KEY))
        if skip:
            outputs = inputs
        else:
            try:
                outputs = self.driver.predict(inputs)
            except Exception as exc:  # the per-request boundary: only this request fails
                traceback.print_exc()
                raise RequestFailed(
                    500, "DriverError", f"{self.label} failed: {type(exc).__name__}: {exc}"
                ) from exc
        if self.post is not None:
            outputs = self.post(outputs, ctx, self.kwargs)
        return outputs


class HooksPipeline:
    """The stages of a hooks model, served one request at a time."""

    def __init__(self, stages: list[Stage], numpy: Any) -> None:
        self.stages = stages
        self._np = numpy

    def handle(self, batch: list[Any], context: Any) -> list[Any]:
        """One result per request; each request's failure is its own (status set on context)."""
        results = []
        for idx, data in enumerate(batch):
            try:
                if context.operation:
                    raise RequestFailed(
                        404,
                        "OperationNotFound",
                        f"model {context.model_name!r} is a hooks model, which serves only "
                        f"predictions, not {context.operation!r}",
                    )
                ctx = HookContext(
                    context.request_ids.get(idx, ""),
                    context.get_all_request_header(idx),
                    idx,
                    len(batch),
                )
                value = _inputs_of(with_body(data, context, idx), self._np)
                for stage in self.stages:
                    value = stage.run(value, ctx)
                # decoded OIP tensors: the worker encodes the outputs itself, dtypes kept
                tensors = getattr(context, "protocol", "") == "v2"
                results.append(value if tensors else _result_of(value))
            except RequestFailed as failure:
                results.append(
                    context.error_response(idx, failure.status, failure.kind, failure.message)
                )
        return results

    def close(self) -> None:
        for stage in self.stages:
            stage.driver.close()


def load(target: Any, module: Any, context: Any) -> LoadedHandler:
    """Read the model config, check the hooks, call ``init_hook``, then load the drivers."""
    try:
        import numpy
    except ImportError as exc:
        raise HandlerLoadError(
            f"the hooks style needs numpy in the model's environment; add it to the archive's "
            f"requirements file ({exc})"
        ) from exc
    if not any(getattr(module, name, None) is not None for name in HOOK_NAMES):
        raise HandlerLoadError(
            f"module {module.__name__!r} is served in the hooks style but defines none of "
            f"{', '.join(HOOK_NAMES)}; the hooks style needs at least one of them"
        )
    model_dir = context.system_properties["model_dir"]
    default_path = (context.manifest or {}).get("model", {}).get("serializedFile")
    configs = stage_configs(context.model_yaml_config, model_dir, default_path)
    classes = [driver_class(c.driver, c.label) for c in configs]
    pre = _hooks_of(module, "preprocess", configs, classes, first=True)
    post = _hooks_of(module, "postprocess", configs, classes, first=False)

    init_hook = getattr(module, "init_hook", None)
    if init_hook is not None:
        if not callable(init_hook):
            raise HandlerLoadError(
                f"init_hook in {module.__name__!r} is a {type(init_hook).__name__}, not a function"
            )
        params: dict[str, Any] = {}
        for config in configs:
            params.update(config.options)
        params["model_path"] = configs[0].model_path
        params["model_paths"] = [c.model_path for c in configs]
        params["model_dir"] = model_dir
        _call_init_hook(init_hook, params)

    gpu_id = context.system_properties.get("gpu_id")
    stages: list[Stage] = []
    for i, config in enumerate(configs):
        driver = classes[i](config.label, config.model_path, config.options, gpu_id)
        stages.append(Stage(config.label, driver, pre[i], post[i]))
    pipeline = HooksPipeline(stages, numpy)
    return LoadedHandler(
        HOOKS, pipeline.handle, instance=pipeline, module=module, on_shutdown=pipeline.close
    )


def _hooks_of(
    module: Any, name: str, configs: list[StageConfig], classes: list[Any], first: bool
) -> list[Hook | None]:
    """One hook (or None) per stage from the module's ``preprocess`` / ``postprocess``."""
    value = getattr(module, name, None)
    count = len(configs)
    hooks: list[Hook | None] = [None] * count
    if value is None:
        return hooks
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise HandlerLoadError(
                f"{name} in {module.__name__!r} is a list of {len(value)} hooks, but the model "
                f"config gives {count} pipeline stage{'s' if count != 1 else ''}; give one entry "
                f"per stage (None where a stage has no {name})"
            )
        for i, fn in enumerate(value):
            if fn is None:
                continue
            if not callable(fn):
                raise HandlerLoadError(
                    f"{name}[{i}] in {module.__name__!r} is a {type(fn).__name__}, "
                    f"not a function or None"
                )
            label = f"{name}[{i}] hook {_name_of(fn)!r} of {configs[i].label}"
            hooks[i] = Hook(fn, label, classes[i].hook_kwarg_names)
        return hooks
    if not callable(value):
        raise HandlerLoadError(
            f"{name} in {module.__name__!r} is a {type(value).__name__}; it must be a function, "
            f"a list of functions (None for no hook), or None"
        )
    i = 0 if first else count - 1
    label = f"{name} hook {_name_of(value)!r}"
    hooks[i] = Hook(value, label, classes[i].hook_kwarg_names)
    return hooks


def _name_of(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _call_init_hook(init_hook: Any, params: dict[str, Any]) -> None:
    try:
        chosen = accepted_keywords(init_hook, params)
    except TypeError as exc:
        raise HandlerLoadError(
            f"init_hook{inspect.signature(init_hook)} cannot be called with the model's params "
            f"({', '.join(sorted(params))}): {exc}; write it as init_hook(**params)"
        ) from None
    init_hook(**chosen)


def _is_true(value: Any) -> bool:
    """``ml-serving-ignore``'s value: a bool, number, string or one-element array."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    size = getattr(value, "size", None)
    if size is not None and size != 1:
        return size > 0 and bool(value.all())
    return bool(value)


def _inputs_of(data: Any, numpy: Any) -> dict[str, Any]:
    """The request's inputs as a dict of numpy arrays (400 when the body is not such a dict)."""
    body = data.get("body") if isinstance(data, dict) else data
    if isinstance(body, (bytes, bytearray, str)):
        try:
            body = json.loads(body)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise RequestFailed(
                400, "InvalidInput", f"request body is not JSON ({exc}); send {_BODY_FORMS}"
            ) from None
    if not isinstance(body, dict):
        raise RequestFailed(
            400, "InvalidInput", f"request body is a JSON {_json_type(body)}; send {_BODY_FORMS}"
        )
    if isinstance(body.get("inputs"), dict):
        others = sorted(k for k in body if k != "inputs")
        if others:
            raise RequestFailed(
                400,
                "InvalidInput",
                f"request body has {', '.join(repr(k) for k in others)} next to 'inputs'; "
                f"send {_BODY_FORMS}",
            )
        body = body["inputs"]
    inputs = {}
    for name, value in body.items():
        try:
            inputs[name] = numpy.asarray(value)
        except ValueError as exc:  # ragged nested lists
            raise RequestFailed(
                400, "InvalidInput", f"input {name!r} is not a rectangular array: {exc}"
            ) from None
    return inputs


_BODY_FORMS = 'a JSON object {"inputs": {"name": [...]}} or {"name": [...]}'


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "number"
    return {str: "string", bool: "boolean", type(None): "null"}.get(type(value), "value")


def _result_of(value: Any) -> Any:
    """The final outputs as what the runtime sends: str/bytes as they are, the rest as JSON."""
    if isinstance(value, (str, bytes)):
        return value
    try:
        return _plain(value)
    except UnicodeDecodeError as exc:
        raise RequestFailed(
            500,
            "OutputError",
            f"the outputs hold binary bytes ({exc.reason} at byte {exc.start}), which cannot be "
            f"sent as JSON; turn them into a str (e.g. base64) in a postprocess hook",
        ) from None


def _plain(value: Any) -> Any:
    """numpy arrays and scalars (and tensors) as lists and numbers, recursively."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    tolist = getattr(value, "tolist", None)
    if callable(tolist):  # numpy arrays and scalars, torch tensors
        return _plain(tolist())
    return value  # the runtime reports what JSON cannot encode

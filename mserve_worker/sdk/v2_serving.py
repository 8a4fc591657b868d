"""Serving a v2 model class: create it, ``load()`` it, then answer each request of a batch.

The adapter of the v2 model style (the loader's ``claims`` and ``load``) behind :mod:`.v2_model`
(whose docstring describes the contract users see); split from it so that module stays what a
model author reads. Standard library only, Python 3.8+.
``from mserve_worker.sdk.v2_serving import V2ModelServer`` works too, mirroring mlrun's
``mlrun.serving.v2_serving`` module name.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import traceback
from typing import Any

from ..contract import V2_MODEL, HandlerLoadError, LoadedHandler, accepted_keywords
from ..payload import with_body
from .v2_model import PARAMS_KEY, Event, Response, ServerContext, V2ModelServer, check_v2

__all__ = ["V2ModelServer", "claims", "load"]


def claims(target: Any) -> bool:
    """A subclass of :class:`V2ModelServer`, or any class with ``load()`` and ``predict()``."""
    if not inspect.isclass(target):
        return False
    if issubclass(target, V2ModelServer):
        return True
    return callable(getattr(target, "load", None)) and callable(getattr(target, "predict", None))


def load(target: Any, module: Any, context: Any) -> Any:
    """Create the model object, run its ``load()`` and return the loader's per-batch entry."""
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


class _KeywordLogger(logging.Logger):
    """A Logger that also takes mlrun's ``logger.info("msg", key=value)`` keyword fields."""

    def _log(self, level: int, msg: Any, args: Any, exc_info: Any = None, extra: Any = None,
             stack_info: bool = False, stacklevel: int = 1, **fields: Any) -> None:  # fmt: skip
        if extra is not None and not isinstance(extra, dict):  # a field named "extra"
            fields, extra = {"extra": extra, **fields}, None
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
        kwargs = accepted_keywords(target, kwargs)
    except TypeError as exc:
        raise error(
            f"cannot create {label}: __init__{inspect.signature(target)} ({exc}); the server "
            f"passes context, name, model_path and the model config's {PARAMS_KEY!r} as "
            f"keyword arguments"
        ) from None
    return target(**kwargs)


class _Served:
    """Serves each request of a batch through the model object, one at a time."""

    def __init__(self, instance: Any) -> None:
        self.model = instance

    def handle(self, batch: list[Any], context: Any) -> list[Any]:
        outputs = []
        for idx, row in enumerate(batch):
            outputs.append(self._one(idx, row, context))
            self._push_metrics(context, idx)  # what set_metric recorded during this request
        return outputs

    def _one(self, idx: int, row: Any, context: Any) -> Any:
        row = with_body(row, context, idx)
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
            return context.error_response(
                idx, 503, "ModelNotReady", f"model {model.name} is not ready"
            )
        body = row.get("body")
        tensors = getattr(context, "protocol", "") == "v2"  # decoded OIP tensors
        if tensors:  # predict(request) gets {"id", "inputs": {name: array}, ...}
            body = {"id": row.get("id"), "inputs": body, "parameters": row.get("parameters") or {},
                    "outputs": row.get("outputs")}  # fmt: skip
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
            plain = type(exc) in (Exception, ValueError) and str(exc)
            message = str(exc) if plain else f"{type(exc).__name__}: {exc}"
            return context.error_response(idx, 400, "InvalidRequest", message)
        method = getattr(model, method_name, None)
        if not callable(method):
            return _not_implemented(context, idx, model, method_name)
        try:
            outputs = method(request)
        except NotImplementedError as exc:
            if method_name == "predict":
                _log_error(context, idx, model, {**request, "id": event_id}, op, exc)
                return _failed(context, idx, model, method_name, exc)
            return _not_implemented(context, idx, model, method_name)
        except Exception as exc:
            _log_error(context, idx, model, {**request, "id": event_id}, op, exc)
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
        _log_result(context, idx, model, request, response, op, event_id)
        if tensors:
            return response  # the worker encodes response["outputs"] as OIP tensors
        return _place(body, getattr(model, "_result_path", None), response)

    def _custom(self, idx: int, row: Any, context: Any, op: str) -> Any:
        model = self.model
        method = getattr(model, "op_" + op, None) if op.isidentifier() else None
        if not callable(method):
            custom = sorted(n[3:] for n in dir(model) if n.startswith("op_") and n[3:])
            available = ", ".join(["infer", "predict", "explain", *custom])
            return context.error_response(
                idx, 404, "OperationNotFound",
                f"model {model.name} has no operation {op!r} (no op_{op} method); "
                f"available: {available}",
            )  # fmt: skip
        headers = context.get_all_request_header(idx)
        event = Event(row, op, context.get_request_id(idx), headers)
        try:
            result = method(event)
        except Exception as exc:
            return _failed(context, idx, model, f"op_{op}", exc)
        if not isinstance(result, Response):
            return result
        try:
            context.set_response_status(result.status_code, "", idx)
        except ValueError as exc:  # e.g. a status outside 100-599
            return _failed(context, idx, model, f"op_{op}", exc)
        for key, value in result.headers.items():
            context.set_response_header(idx, key, str(value))
        if result.content_type:
            context.set_response_content_type(idx, result.content_type)
        return b"" if result.body is None else result.body

    def _push_metrics(self, context: Any, idx: int) -> None:
        pending = getattr(self.model, "_new_metrics", None)
        if not pending:
            return
        for name, value in pending:
            if isinstance(name, str) and name and _is_number(value):
                context.metrics.add_metric(name, value, idx=idx)
        pending.clear()


def _log_result(
    context: Any, idx: int, model: Any, request: Any, response: Any, op: str, event_id: Any
) -> None:
    """mlrun's record of an answered request, when the server logs the model: what
    ``logged_results(request, response, op)`` returns, else the request and response."""
    records = getattr(context, "_mserve_inference_log", None)
    if records is None:
        return
    logged = getattr(model, "logged_results", None)
    inputs = outputs = None
    if callable(logged):
        try:
            inputs, outputs = logged(request, response, op)
        except Exception as exc:  # its hook failing must not fail the answer
            print(f"logged_results failed, logging the request as is: {exc!r}", file=sys.stderr)
    if inputs is None and outputs is None:
        record = {"request": request, "resp": response}
    else:
        record = {"request": {"id": event_id, "inputs": inputs or []},
                  "resp": {"outputs": outputs or []}}  # fmt: skip
    records[context.get_request_id(idx)] = _plain({**record, **_base(context, model, op)})


def _log_error(context: Any, idx: int, model: Any, request: Any, op: str, exc: Exception) -> None:
    """mlrun's record of a request whose predict/explain raised: the request and the error."""
    records = getattr(context, "_mserve_inference_log", None)
    if records is not None:
        record = {"request": request, "error": str(exc), **_base(context, model, op)}
        records[context.get_request_id(idx)] = _plain(record)


def _base(context: Any, model: Any, op: str) -> dict[str, Any]:
    metrics = getattr(model, "metrics", None)
    return {
        "op": op,
        "class": type(model).__name__,
        "worker": getattr(context, "worker_id", ""),
        "metrics": dict(metrics) if isinstance(metrics, dict) else {},
    }


def _plain(value: Any) -> Any:
    """``value`` as plain JSON values (arrays through ``tolist()``, the rest as text), so it
    can travel in the RESULT frame."""

    def fallback(item: Any) -> Any:
        tolist = getattr(item, "tolist", None)
        return tolist() if callable(tolist) else str(item)

    try:
        return json.loads(json.dumps(value, default=fallback, allow_nan=False))
    except ValueError as exc:  # NaN or infinity: not JSON
        return {"op": value.get("op"), "error": f"the record is not JSON: {exc}"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _valid(request: dict[str, Any]) -> dict[str, Any]:
    check_v2(request)
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


def _not_implemented(context: Any, idx: int, model: Any, method: str) -> dict[str, Any]:
    return context.error_response(
        idx, 501, "NotImplemented",
        f"model {model.name} does not implement {method}(request); "
        f"its class {type(model).__name__} must define it to serve this operation",
    )  # fmt: skip


def _failed(context: Any, idx: int, model: Any, where: str, exc: Exception) -> dict[str, Any]:
    print(f"request {context.get_request_id(idx)}: {where} failed", file=sys.stderr)
    traceback.print_exc()  # the server re-logs worker stderr under the model's name
    return context.error_response(
        idx, 500, "InternalServerError",
        f"{type(model).__name__}.{where} failed: {type(exc).__name__}: {exc}",
    )  # fmt: skip

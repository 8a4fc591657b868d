"""The loaded handler as a service: the handler, its context and its limits behind one call
that turns request items into response items.

The worker splits as TorchServe's does: the socket loop (:mod:`.runtime`: hello, frames in and
out, cancellations), this service (load the handler once, serve batches) and the sans-IO codec
(:mod:`.protocol`). A Ray Serve replica (server/rayserve/replica.py) uses the service without a
socket or a frame. Runs inside the model's own environment: standard library only, Python 3.8+,
nothing done at import time. A handler exception fails its batch (traceback to stderr) and never
the service.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Collection
from typing import Any

from . import compat, stand_ins, streaming, tracing
from .context import Context, Metrics
from .contract import HandlerLoadError, LoadedHandler
from .coroutines import Abandoned
from .imports import loaded_packages
from .loader import load_handler
from .oip import serving as oip_serving
from .oip.signature import SignatureError
from .oip.tensors import OIPError
from .payload import PayloadError, decode_request, encode_output
from .protocol import STREAM_FAILED_HEADER, TOO_LARGE_HEADER, RequestItem, ResponseItem
from .reload import Reloader, code_of, own_modules
from .sdk import convert, weights
from .sdk.errors import PredictionException
from .steps import NEXT_HEADER, Steps

CLIENT_GONE = 499  # the answer to a cancelled request, which nobody reads
_NOTHING_CANCELLED: frozenset[str] = frozenset()


class ServiceError(Exception):
    """Why the handler did not load or a batch failed as a whole: ``error`` (one line for the
    server's log and the client) and ``traceback`` (the user's, or "" when ours)."""

    def __init__(self, error: str, details: str = "") -> None:
        super().__init__(error)
        self.error = error
        self.traceback = details


class LoadFailed(ServiceError):
    """The handler could not be imported or initialised."""


class BatchFailed(ServiceError):
    """The handler raised, or returned the wrong number of results, for a whole batch."""


class HandlerService:
    """One loaded handler: ``serve`` answers a batch of request items with response items."""

    def __init__(
        self, handler: LoadedHandler, context: Context, max_response_bytes: int | None = None
    ) -> None:
        self.handler = handler
        self.context = context
        self.max_response_bytes = max_response_bytes  # a larger answer is a 413
        self.load_s = 0.0
        # installed packages the handler pulled in: what this environment's template preloads
        self.imports: list[str] = []
        # the last batch's handler phases, [name, start_ms, duration_ms] (traced batches of
        # handlers that have phases; else None): the RESULT carries them to the server
        self.phases: list[list[Any]] | None = None
        self._otel = tracing.Bridge()
        self.init: dict[str, Any] = {}  # INIT's meta, which a hot reload loads the handler from
        # the code the handler runs, {"digest", "files"} (READY and RELOADED carry it)
        self.code: dict[str, Any] | None = None
        self.reloader = Reloader(self)  # hot reload's steps (mserve_worker/reload.py)

    @property
    def style(self) -> str:
        return self.handler.style

    @classmethod
    def load(cls, init: dict[str, Any]) -> HandlerService:
        """Load the handler INIT's meta names (docs/protocol.md) in this process, which it
        makes the model's: the model folder becomes the working directory and comes first on
        ``sys.path``. Raises :class:`LoadFailed`."""
        started = time.monotonic()
        before = set(sys.modules)  # forked from a template: what it preloaded is not news
        model_dir = init["model_dir"]
        sys.path.insert(0, model_dir)  # under -I nothing else puts the model on the path
        compat.install(after=model_dir)  # `import ts...` finds ours, before an installed one
        stand_ins.install()  # `import mlrun` / `redhareapi` find ours only where missing
        _log_shadowing()
        os.chdir(model_dir)
        weights.enable(init.get("warm_tier") is True)  # map checkpoints (docs/warm-tier.md)
        # where legacy checkpoints' mappable copies go, and how big one may be (convert.py)
        convert.configure(init.get("mapped_dir"), init.get("mapped_max_bytes"))
        context = Context(
            model_name=init["model_name"],
            model_dir=model_dir,
            manifest=init["manifest"],
            batch_size=init["batch_size"],
            gpu_id=init.get("gpu_id"),
            server_name=init.get("server_name", "mserve"),
            server_version=init.get("server_version", ""),
            limit_max_image_pixels=init.get("limit_max_image_pixels", True),
            model_yaml_config=init.get("model_yaml_config"),
            model_version=init.get("model_version", ""),
            worker_id=init.get("worker_id", ""),
        )
        _sequence_headers(context, init.get("sequence_headers"))
        for declared in init.get("model_metrics") or ():  # the server's metrics config
            context.metrics.add_metric_to_cache(
                declared["name"], declared.get("unit", ""), declared.get("dimensions"),
                declared.get("type"),
            )  # fmt: skip
        if init.get("continuous_batching") is True:
            context._mserve_steps = Steps()  # type: ignore[attr-defined]
        if init.get("inference_log"):  # the server logs this model: v2 model classes fill it
            context._mserve_inference_log = {}  # type: ignore[attr-defined]
        try:
            handler = load_handler(init["handler"], model_dir, context, init.get("handler_style"))
            # the model config's signature, and the server's envelope
            oip_serving.for_context(context, handler.style, init.get("service_envelope") or "")
        except (HandlerLoadError, SignatureError) as exc:
            raise LoadFailed(str(exc)) from None
        except BaseException as exc:  # the user's module raised while importing or initialising
            text = traceback.format_exc()
            print(text, file=sys.stderr)
            _print_refusal(exc)
            raise LoadFailed(_error_text(exc), text) from None
        max_response = init.get("max_response_bytes")
        service = cls(handler, context, max_response if type(max_response) is int else None)
        service.imports = loaded_packages(
            [model_dir, os.path.dirname(os.path.abspath(__file__))], before
        )
        service.init = init
        service.code = code_of(model_dir, own_modules(model_dir), handler)
        service.load_s = round(time.monotonic() - started, 4)
        return service

    def serve(
        self,
        batch_id: int,
        items: list[RequestItem],
        cancelled: Collection[str] = _NOTHING_CANCELLED,
    ) -> tuple[list[ResponseItem], float | None, list[dict[str, Any]] | None]:
        """The batch's answers, one per item in order, the handler's time on it in ms (None
        when it was not called) and the metrics it recorded; the requests in ``cancelled``
        (their callers left) are answered 499 without running. Raises :class:`BatchFailed`
        when the batch fails as a whole."""
        handler, context = self.handler, self.context
        stream = getattr(context, "_mserve_stream", None)
        if stream is not None:
            stream.reset(batch_id)
        steps = getattr(context, "_mserve_steps", None)
        if steps is not None:
            steps.begin(items, cancelled, context)
        responses: list[ResponseItem | None] = [None] * len(items)
        decoded: dict[int, Any] = {}
        prepared: dict[int, oip_serving.Prepared] = {}  # v1/v2 requests
        # one handler call per operation and API, in arrival order
        groups: dict[tuple[str, str], list[int]] = {}
        oip = oip_serving.for_context(context, handler.style)  # made when the handler loaded
        with_api = False  # a v1/v2 request is in the batch
        for i, item in enumerate(items):
            if item.request_id in cancelled:  # its caller is gone: the answer would reach nobody
                responses[i] = ResponseItem(CLIENT_GONE, b"", "")
                continue
            api = ""
            if item.cached:  # a request still generating: its state is the handler's
                decoded[i] = {}
                groups.setdefault((item.op, api), []).append(i)
                continue
            try:
                if item.api:
                    with_api = True
                    prepared[i] = oip.prepare(item)
                    decoded[i], api = prepared[i].row, prepared[i].api
                elif item.op in ("", "explain") and oip.enveloped:
                    # the server's service_envelope reads TorchServe's paths too
                    prepared[i] = oip.prepare_enveloped(item)
                    decoded[i], api = prepared[i].row, prepared[i].api
                else:
                    decoded[i] = decode_request(  # headers only for a missing content type: read,
                        item.content_type,  # a packed BATCH entry's are split (protocol.py)
                        () if item.content_type else item.headers,
                        item.body,
                        item.params,
                    )
                if oip.bare and api != "v2" and item.op in ("", "explain"):
                    decoded[i] = oip_serving.bare_row(decoded[i])
            except OIPError as exc:
                responses[i] = ResponseItem(exc.status, _text(exc.message), "")
                continue
            except PayloadError as exc:
                responses[i] = _bad_body(str(exc))
                continue
            groups.setdefault((item.op, api), []).append(i)
        traced = tracing.traced_by_server(items)
        phases: list[tracing.Phase] | None = [] if traced else None
        context._mserve_phases = phases  # type: ignore[attr-defined]  # BaseHandler's record
        # without the server tracing, a client's traceparent still parents the handler's spans
        # where opentelemetry is installed (looked for once): enter() is None otherwise
        restore = self._otel.enter(items[0]) if items else None
        started = time.perf_counter()
        try:
            failure = self._serve_groups(groups, items, decoded, prepared, responses, stream)
        finally:
            if restore is not None:
                restore()
            context._mserve_phases = None  # type: ignore[attr-defined]
        self.phases = tracing.phase_offsets(phases, started) if phases else None
        if failure is not None:
            raise failure
        for i, item in enumerate(items) if with_api else ():  # v1/v2 errors in OIP's shape
            response = responses[i]
            if item.api and response is not None and response.status >= 400 and (
                response.status != CLIENT_GONE and not _streamed(stream, i)
            ):  # fmt: skip
                responses[i] = oip_serving.error_response(response)
        # to the microsecond; round(x, 3) formats the float through snprintf, the dearer way
        handler_ms = int((time.perf_counter() - started) * 1e6 + 0.5) / 1000 if groups else None
        metrics = context.metrics
        recorded = None
        if isinstance(metrics, Metrics) and metrics._entries:  # NaN and infinities are not JSON
            recorded = [m for m in metrics.drain() if math.isfinite(m["value"])]
        return [r for r in responses if r is not None], handler_ms, recorded

    def _serve_groups(
        self, groups: dict[tuple[str, str], list[int]], items: list[RequestItem],
        decoded: dict[int, Any], prepared: dict[int, oip_serving.Prepared],
        responses: list[ResponseItem | None], stream: streaming.Stream | None,
    ) -> BatchFailed | None:  # fmt: skip
        """One handler call per group; the batch's failure when it failed as a whole."""
        handler, context = self.handler, self.context
        for (op, api), indexes in groups.items():
            failure = _serve_group(
                op, indexes, items, decoded, handler, context, responses,
                self.max_response_bytes, api, prepared,
            )  # fmt: skip
            if failure is None:
                continue
            if len(groups) == 1:
                return BatchFailed(failure["error"], failure["traceback"])
            # A batch mixing operations: only the requests of the failed one share its fate.
            for i in indexes:
                responses[i] = _failed(failure["error"], i, stream)
        return None

    def apart(self, stream: streaming.Stream) -> HandlerService:
        """This service on a context of its own, streaming through ``stream``: for one batch run
        beside others (mserve_worker/inflight.py), whose ``serve`` and ``take_inference_log``
        then see that batch alone."""
        view = copy.copy(self)
        context = view.context = self.context.for_batch()
        context._mserve_stream = stream  # type: ignore[attr-defined]
        if hasattr(context, "_mserve_inference_log"):
            context._mserve_inference_log = {}  # type: ignore[attr-defined]
        return view

    def take_inference_log(self) -> list[list[Any]] | None:
        """What the last batch's requests chose to log, as ``[request id, record]`` pairs (v2
        model classes' ``logged_results``); None when the server does not log the model or
        none did. By id, not index: the handler sees each (operation, API) group of a batch
        as a batch of its own."""
        records = getattr(self.context, "_mserve_inference_log", None)
        if not records:
            return None
        out = [[i, r] for i, r in records.items()]
        records.clear()
        return out

    def shutdown(self) -> None:
        """Run the handler's stop hook (its ``shutdown()``, a kernel's ``on_kernel_shutdown``)."""
        self.handler.shutdown()


def _log_shadowing() -> None:
    """Say where an installed package wins over mserve's own ``ts`` or stand-ins, or loses."""
    log = logging.getLogger("mserve_worker")
    shadowed = compat.shadowed_torchserve()
    if shadowed is not None:
        log.info(
            "torchserve %s is installed in this environment; handlers importing ts.* get "
            "mserve's ts (docs/handlers.md)",
            shadowed,
        )
    for name, where in stand_ins.real_packages():
        log.info(
            "%s is installed (%s); handlers importing %s get that package, not mserve's "
            "stand-in, which is used only where %s is missing (docs/handlers.md)",
            name, where, name, name,
        )  # fmt: skip


def _sequence_headers(context: Context, names: Any) -> None:
    """The server's names of the sequence headers (ts_header_key_sequence_*), when it sent them."""
    if not isinstance(names, dict):
        return
    for part in ("id", "start", "end"):
        name = names.get(part)
        if isinstance(name, str) and name:
            setattr(context, f"header_key_sequence_{part}", name)


def _error_text(exc: BaseException) -> str:
    """The exception in a line; a file the sandbox refused says what grants it."""
    hint = _refusal_hint(exc)
    return f"{type(exc).__name__}: {exc}" + (f" ({hint})" if hint else "")


def _refusal_hint(exc: BaseException) -> str | None:
    from . import confine  # here: only a failure pays for ctypes

    return confine.refusal_hint(exc)


def _print_refusal(exc: BaseException) -> None:
    """Below the traceback in the log, what grants the file the sandbox refused, if it did."""
    hint = _refusal_hint(exc)
    if hint:
        print(f"sandbox: {hint}", file=sys.stderr)


def _serve_group(
    op: str,
    indexes: list[int],
    items: list[Any],
    decoded: dict[int, Any],
    handler: LoadedHandler,
    context: Context,
    responses: list[ResponseItem | None],
    max_response_bytes: int | None = None,
    api: str = "",
    prepared: dict[int, oip_serving.Prepared] | None = None,
) -> dict[str, str] | None:
    """Call the handler for the requests at ``indexes`` (all asking for ``op`` through ``api``)
    and fill in their responses; returns the failure (``error``, ``traceback``) when the call
    failed."""
    # A request the kserve/json envelope split is several rows of the batch, each with the
    # request's headers; rows[k] is the request of row k.
    rows: list[int] = [] if prepared else indexes  # without v1/v2 requests: one row each
    data: list[Any] = [] if prepared else [decoded[i] for i in indexes]
    for i in indexes if prepared else ():
        split = prepared.get(i)
        if split is not None and split.rows is not None:
            rows.extend([i] * split.rows)
            data.extend(decoded[i])
        else:
            rows.append(i)
            data.append(decoded[i])
    context.start_batch([items[i] for i in rows], op)
    context.protocol = api
    stream = getattr(context, "_mserve_stream", None)
    if stream is not None:
        stream.begin(rows, context)
    logged = hasattr(context, "_mserve_inference_log")  # the server logs this model
    try:
        outputs = handler.handle(data, context)
    except Abandoned:  # its callers all left and its coroutine was cancelled: nobody reads this
        for i in indexes:
            responses[i] = ResponseItem(CLIENT_GONE, b"", "")
        return None
    except PredictionException as exc:  # the handler chose the batch's answer
        traceback.print_exc()
        for i in indexes:
            responses[i] = _prediction_error(exc, i, stream)
        return None
    except Exception as exc:  # the per-batch boundary: the worker keeps serving
        traceback.print_exc()
        _print_refusal(exc)
        return {"error": _error_text(exc), "traceback": traceback.format_exc()}
    finally:
        if stream is not None:
            stream.end()  # send_intermediate_predict_response is refused from here on
    if not isinstance(outputs, list) or len(outputs) != len(data):
        if isinstance(outputs, list):
            found = f"{len(outputs)} results"
        else:
            found = "None" if outputs is None else type(outputs).__name__
        message = (
            "handler must return a list with one result per request:"
            f" got {found} for a batch of {len(data)}"
        )
        if len(rows) != len(indexes):
            message += " (each instance of an enveloped request is one)"
        print(message, file=sys.stderr)
        return {"error": message, "traceback": ""}
    steps = getattr(context, "_mserve_steps", None)
    if steps is not None:
        try:
            steps.judge(context, outputs)
        except Exception as exc:  # a stopping criterion is the handler's code
            traceback.print_exc()
            return {"error": _error_text(exc), "traceback": traceback.format_exc()}
        steps.mark(context, bool(prepared))  # v1/v2 answers read their request's processor
        marks = steps.marks
    else:
        marks = None
    broken: dict[int, str] | None = None
    if stream is not None:
        iterators = streaming.iterators_in(outputs)
        if iterators:  # mserve's own streaming: each item of a returned iterator is a chunk
            broken = stream.drain(iterators)
            for j in iterators:
                outputs[j] = b""  # every item went out as a chunk; the RESULT closes the stream
    j = 0  # the request's first row
    for i in indexes:
        split = prepared.get(i) if prepared else None
        n = split.rows if split is not None and split.rows is not None else 1
        first, j = j, j + n
        if broken and any(k in broken for k in range(first, j)):
            error = next(broken[k] for k in range(first, j) if k in broken)
            responses[i] = _failed(error, i, stream)
            continue
        if api and prepared and not _streamed(stream, i):
            request = context._request(first)
            if split is None or split.rows is None:
                output = outputs[first]
            else:  # a split request: it fails as its first failed instance does
                failed = next(
                    (k for k in range(first, j)
                     if context._request(k).get_response_status_code() >= 400), None,
                )  # fmt: skip
                if failed is None:
                    output = outputs[first:j]
                else:
                    request, output = context._request(failed), outputs[failed]
            responses[i] = _oip_answer(
                context, prepared[i], output, request, op, items[i].request_id
            )
            if max_response_bytes is not None and len(responses[i].body) > max_response_bytes:
                size = str(len(responses[i].body))
                responses[i] = ResponseItem(413, b"", "", [[TOO_LARGE_HEADER, size]])
            continue
        request = context._touched(first)  # None: the handler set nothing per request
        override = "" if request is None else request.get_response_content_type() or ""
        try:
            body, content_type = encode_output(outputs[first], override)
        except PayloadError as exc:
            print(f"request {items[i].request_id}: {exc}", file=sys.stderr)
            responses[i] = _failed(str(exc), i, stream)
            continue
        if max_response_bytes is not None and len(body) > max_response_bytes:
            responses[i] = ResponseItem(413, b"", "", [[TOO_LARGE_HEADER, str(len(body))]])
            continue
        if request is None:
            mark = marks.get(first) if marks else None
            headers = [] if mark is None else [[NEXT_HEADER, mark]]
            responses[i] = ResponseItem(200, body, content_type, headers)
        else:
            headers = request.response_header_pairs()
            status = request.get_response_status_code()
            responses[i] = ResponseItem(status, body, content_type, headers)
        if logged and not isinstance(outputs[first], (bytes, bytearray, memoryview, str)):
            responses[i].json_body = True  # encoded here: the server's log need not parse it
    return None


def _streamed(stream: streaming.Stream | None, i: int) -> bool:
    return stream is not None and i in stream.started


def _oip_answer(
    context: Context, prepared: oip_serving.Prepared, output: Any, request: Any, op: str,
    request_id: str,
) -> ResponseItem:  # fmt: skip
    """A v1/v2 request's answer; an output that cannot be sent fails that request alone."""
    oip = oip_serving.for_context(context, "")  # made when the batch was read
    headers = request.response_header_pairs()
    try:
        return oip.answer(prepared, output, request.get_response_status_code(), headers, op)
    except OIPError as exc:
        print(f"request {request_id}: {exc.message}", file=sys.stderr)
        return ResponseItem(exc.status, _text(exc.message), "")


def _prediction_error(
    exc: PredictionException, i: int, stream: streaming.Stream | None
) -> ResponseItem:
    """Each request of the batch gets the exception's status and message, in TorchServe's body;
    a status HTTP cannot carry becomes a 500 that names it. A request that already streamed a
    chunk cannot change its status any more: its stream ends broken, as any failure's does."""
    code, message = exc.error_code, str(exc.message)
    if isinstance(code, bool) or not isinstance(code, int) or not 100 <= code <= 599:
        message = f"{message} (PredictionException code {code!r} is not an HTTP status)"
        code = 500
    if stream is not None and i in stream.started:
        return _failed(f"PredictionException {code}: {message}", i, stream)
    body = {"code": code, "type": "InternalServerException", "message": message}
    return ResponseItem(code, json.dumps(body).encode(), "application/json")


def _failed(error: str, i: int, stream: streaming.Stream | None) -> ResponseItem:
    """The 500 answer of request ``i``; one that already streamed a chunk says so in a header,
    so that the server ends the response where the client can see it broke."""
    headers = []
    if stream is not None and i in stream.started:
        headers = [[STREAM_FAILED_HEADER, error]]
    return ResponseItem(500, _text(error), "text/plain; charset=utf-8", headers)


def _bad_body(message: str) -> ResponseItem:
    """A body the worker cannot decode for the handler (malformed JSON, a bad charset or
    multipart): 400 in the envelope every other error of the server has, so that clients that
    parse error bodies can parse this one too."""
    body = {"code": 400, "type": "BadRequestException", "message": message}
    return ResponseItem(400, json.dumps(body).encode(), "application/json")


def _text(message: str) -> bytes:
    """An error's words as UTF-8. A lone surrogate (from a body's ``"\\ud800"`` or undecodable
    bytes, quoted in an exception's text) has no UTF-8 bytes: it goes out as its escape, so that
    the request fails with its message instead of the worker with UnicodeEncodeError."""
    return message.encode("utf-8", "backslashreplace")

"""Running a workflow's DAG for one request.

Every node is a registered model (a function of the handler file runs as a model whose handler
is that function), so each node's request goes through that model's queue, batching, workers and
sandbox like any prediction. What passes between nodes is TorchServe's:

- the start node gets the client's request as it came (body, content type, headers, query);
- a node with one parent gets that parent's answer as its ``body``, as bytes;
- a node with several parents gets one field per parent, named after it, each the bytes of
  that parent's answer (a ``multipart/form-data`` request: ``data[0]["m1"]``);
- the answer is the leaf's answer, or with several leaves a JSON object of their answers by
  leaf name (each parsed as JSON when it is JSON, else its text).

A node runs once all its parents have answered, so parallel branches run at once. Each try of
a node is bounded by its ``timeout-ms``; a failed try is tried again up to ``retry-attempts``
times; a node that still fails fails the request, naming the node.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from mserve_worker.protocol import RequestItem
from server.errors import ModelNotFound, ModelVersionNotFound, MserveError
from server.models.registry import Registry
from server.streaming import ChunkStream
from server.tenants import Tenant
from server.workflows.errors import NodeFailed
from server.workflows.spec import Node, WorkflowSpec

log = logging.getLogger(__name__)

OCTET_STREAM = "application/octet-stream"
# the client's headers a node's request keeps; these describe the client's body, not the
# parent's answer it carries
_BODY_HEADERS = frozenset(
    ("content-type", "content-length", "transfer-encoding", "content-encoding")
)


@dataclass(frozen=True)
class Request:
    """What the client sent to ``/wfpredict``."""

    request_id: str
    content_type: str
    headers: list[list[str]]
    body: bytes
    params: dict[str, str]
    # who sent it (server/tenants/): each node's request is that tenant's, charged to its
    # quotas (the overall one and the node's model's) and served in its fair-queue lane
    tenant: Tenant | None = None


@dataclass(frozen=True)
class Output:
    body: bytes
    content_type: str


async def run(
    workflow: str, spec: WorkflowSpec, models: dict[str, str], registry: Registry,
    request: Request, max_response_bytes: int,
) -> tuple[bytes, str]:  # fmt: skip
    """Run the DAG; the answer's body and content type. ``models``: node -> registered model."""
    tasks: dict[str, asyncio.Future[Output]] = {}

    async def node_task(node: Node) -> Output:
        parents = [await tasks[p] for p in node.parents]
        make = _item_maker(node, request, parents)
        return await _call(
            workflow, node, models[node.name], registry, make, max_response_bytes, request.tenant
        )

    for node in spec.nodes:  # parents first: each task finds its parents' tasks
        tasks[node.name] = asyncio.ensure_future(node_task(node))
    try:
        await asyncio.gather(*tasks.values())
    except BaseException:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        raise
    leaves = {name: tasks[name].result() for name in spec.leaves}
    if len(leaves) == 1:
        out = next(iter(leaves.values()))
        return out.body, out.content_type or OCTET_STREAM
    combined = {name: _as_json(out) for name, out in leaves.items()}
    return json.dumps(combined).encode(), "application/json"


def _as_json(out: Output) -> object:
    try:
        return json.loads(out.body)
    except ValueError:  # not JSON: its text
        return out.body.decode("utf-8", "replace")


def _item_maker(node: Node, request: Request, parents: list[Output]) -> Callable[[], RequestItem]:
    """A new request item for each try of ``node`` (a try may change its headers)."""
    rid = f"{request.request_id}:{node.name}"
    if not node.parents:
        return lambda: RequestItem(
            request_id=rid, content_type=request.content_type, headers=list(request.headers),
            body=request.body, params=request.params or None,
        )  # fmt: skip
    headers = [h for h in request.headers if h[0].lower() not in _BODY_HEADERS]
    if len(parents) == 1:
        body, content_type = parents[0].body, OCTET_STREAM
    else:
        body, content_type = _form(dict(zip(node.parents, (p.body for p in parents), strict=True)))
    return lambda: RequestItem(
        request_id=rid, content_type=content_type, headers=list(headers), body=body
    )


def _form(fields: dict[str, bytes]) -> tuple[bytes, str]:
    """A multipart/form-data body of plain fields: the worker gives each one's bytes."""
    boundary = secrets.token_hex(16)
    while any(boundary.encode() in value for value in fields.values()):
        boundary = secrets.token_hex(16)
    parts = []
    for name, value in fields.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
            + value
            + b"\r\n"
        )
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), (
        f"multipart/form-data; boundary={boundary}"
    )


async def _call(
    workflow: str, node: Node, model_name: str, registry: Registry,
    make: Callable[[], RequestItem], max_response_bytes: int, tenant: Tenant | None = None,
) -> Output:  # fmt: skip
    what = f"workflow {workflow}: node {node.name} (model {model_name})"
    tries = 1 + node.settings.retry_attempts
    timeout_s = node.settings.timeout_ms / 1000
    error: NodeFailed | None = None
    for attempt in range(1, tries + 1):
        try:
            return await asyncio.wait_for(
                _once(what, model_name, registry, make(), max_response_bytes, tenant), timeout_s
            )
        except asyncio.TimeoutError:
            error = NodeFailed(
                f"{what} did not answer within timeout-ms={node.settings.timeout_ms}", 504
            )
        except NodeFailed as exc:
            error = exc
        except (ModelNotFound, ModelVersionNotFound) as exc:  # unregistered under the workflow
            raise NodeFailed(f"{what} failed: {exc.message}", 503) from exc
        except MserveError as exc:  # a 429's Retry-After only: other headers are the node's
            retry_after = exc.headers().get("Retry-After")
            error = NodeFailed(f"{what} failed: {exc.message}", exc.status, retry_after)
        if attempt < tries:
            log.warning("%s (try %d of %d); trying again", error.message, attempt, tries)
    assert error is not None
    if tries > 1:
        error.message = f"{error.message} (after {tries} tries)"
        error.args = (error.message,)
    raise error


async def _once(
    what: str, model_name: str, registry: Registry, item: RequestItem, max_response_bytes: int,
    tenant: Tenant | None = None,
) -> Output:  # fmt: skip
    model = registry.get(model_name)
    job = model.enqueue(item, None, tenant)
    try:
        result = await job.future
    except asyncio.CancelledError:  # timeout-ms passed, or the request was given up
        model.withdraw(job)
        raise
    if type(result) is ChunkStream:  # a streamed answer, gathered whole
        body = bytearray()
        async for chunk in result.chunks():
            body += chunk
            if len(body) > max_response_bytes:
                raise NodeFailed(
                    f"{what} streamed more than max_response_size_bytes={max_response_bytes}",
                    413,
                )
        status, content = result.status, bytes(body)
    else:
        status, content = result.status, bytes(result.body)
    if status >= 400:
        text = content[:2000].decode("utf-8", "replace")
        raise NodeFailed(f"{what} failed with status {status}: {text}", status)
    return Output(content, result.content_type)

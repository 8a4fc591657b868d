"""TorchServe's workflow APIs over REST: ``/workflows`` on the management port (register, list,
describe, unregister) and ``/wfpredict/{name}`` on the inference port. The listeners' token
authorization covers both (the management key, the inference key); registering and
unregistering obey model API control as models do (``enable_model_api``)."""

from __future__ import annotations

from server.errors import ModelApiDisabled
from server.http import Answer, Connection, Request, json_answer
from server.inference import request_id
from server.operations import TS_METHOD_NOT_ALLOWED, int_param
from server.tracing import client_request_id
from server.workflows.execute import Request as WorkflowRequest
from server.workflows.registry import Workflows


class WorkflowAPI:
    def __init__(self, workflows: Workflows, model_api: bool, max_response_bytes: int) -> None:
        self.workflows = workflows
        self.model_api = model_api
        self.max_response_bytes = max_response_bytes

    # --- management ------------------------------------------------------------------------

    def manage(self, conn: Connection, req: Request) -> None:
        """``/workflows`` and ``/workflows/{name}`` on the management port."""
        parts, workflows = req.parts, self.workflows
        if len(parts) == 1:
            if req.allow("GET", "POST") == "GET":
                limit = int_param(req.query, "limit", None)
                start = max(0, int_param(req.query, "next_page_token", None) or 0)
                conn.answer_json(req, 200, workflows.page(req.query, limit, start))
            else:
                self._check_model_api("registering", ("GET",))
                conn.answer_later(req, self._register(req))
            return
        if len(parts) != 2:
            raise req.not_found()
        if req.allow("GET", "DELETE") == "GET":
            conn.answer_json(req, 200, workflows.describe(parts[1]))
        else:
            self._check_model_api("unregistering", ("GET",))
            conn.answer_later(req, self._unregister(parts[1]))

    def _check_model_api(self, action: str, allowed: tuple[str, ...]) -> None:
        if self.model_api:
            return
        if self.workflows.registry.config.torchserve:
            raise ModelApiDisabled(TS_METHOD_NOT_ALLOWED, allowed)
        raise ModelApiDisabled(
            f"{action} workflows through the API is disabled (model API control): start mserve"
            " with --enable-model-api or set enable_model_api to true",
            allowed,
        )

    async def _register(self, req: Request) -> Answer:
        query = req.query
        timeout = int_param(query, "response_timeout", 1)
        startup = int_param(query, "startup_timeout", 1)
        workflow = await self.workflows.register(
            query.get("url"),
            query.get("workflow_name") or None,
            float(timeout) if timeout is not None else None,
            float(startup) if startup is not None else None,
        )
        return json_answer(
            200,
            {"status": f"Workflow {workflow.name} has been registered and scaled successfully."},
        )

    async def _unregister(self, name: str) -> Answer:
        await self.workflows.unregister(name)
        return json_answer(200, {"status": f'Workflow "{name}" unregistered'})

    # --- inference -------------------------------------------------------------------------

    def predict(self, conn: Connection, req: Request, name: str) -> None:
        """``/wfpredict/{name}``: the request runs through the workflow's DAG."""
        self.workflows.get(name)  # an unknown workflow: 404 at once
        known = req.known
        rid = known.get("x-request-id")
        rid = (client_request_id(rid) if rid is not None else None) or request_id()
        request = WorkflowRequest(
            request_id=rid,
            content_type=known.get("content-type") or "",
            headers=[list(h) for h in req.headers],
            body=bytes(req.body),
            params=dict(req.query) if req.query_string else {},
            tenant=req.tenant,
        )
        conn.answer_later(req, self._predict(name, request))

    async def _predict(self, name: str, request: WorkflowRequest) -> Answer:
        body, content_type = await self.workflows.predict(name, request, self.max_response_bytes)
        return 200, [["Content-Type", content_type], ["X-Request-Id", request.request_id]], body

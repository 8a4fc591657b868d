"""docs/reference/rest.md, generated from the OpenAPI documents the server answers
``GET /api-description`` with (server/rest/description.py): every path, method, parameter and
status, for the inference and management ports."""

from __future__ import annotations

from typing import Any

from server.rest.description import describe

_METHODS = ("get", "post", "put", "delete", "options", "head", "patch")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _schema(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    kind = schema.get("type", "")
    if "enum" in schema:
        kind += " (" + ", ".join(str(v) for v in schema["enum"]) + ")"
    if "minimum" in schema or "maximum" in schema:  # the bounds the server checks
        low = ("> " if schema.get("exclusiveMinimum") else "") + str(schema.get("minimum", ""))
        kind += f" ({low} to {schema.get('maximum', 'any')})"
    return kind


def _operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f"### `{method.upper()} {path}`", "", _cell(op.get("summary", "")), ""]
    params = op.get("parameters", [])
    if params:
        out += ["| Parameter | In | Type | Required | Meaning |", "|---|---|---|---|---|"]
        for p in params:
            out.append(
                f"| `{p['name']}` | {p['in']} | {_cell(_schema(p.get('schema', {})))}"
                f" | {'yes' if p.get('required') else 'no'} | {_cell(p.get('description', ''))} |"
            )
        out.append("")
    content = op.get("requestBody", {}).get("content", {})
    body = content.get("application/json", {}).get("schema", {})
    if body.get("properties"):  # a JSON body of named fields (the traffic, canary, shadow)
        out += [_cell(body.get("description", "")), "",
                "| Body field | Type | Required | Meaning |", "|---|---|---|---|"]  # fmt: skip
        for name, field in body["properties"].items():
            required = "yes" if name in body.get("required", ()) else "no"
            out.append(
                f"| `{name}` | {_cell(_schema(field))} | {required}"
                f" | {_cell(field.get('description', ''))} |"
            )
        out.append("")
    out += ["| Status | Meaning |", "|---|---|"]
    for status, answer in op.get("responses", {}).items():
        out.append(f"| {status} | {_cell(answer.get('description', ''))} |")
    return [*out, ""]


def render() -> str:
    out = [
        "# REST APIs",
        "",
        "Generated at build time from the OpenAPI 3 documents the server itself answers",
        "`GET /api-description` (and `OPTIONS /`) with on each port, so they match what runs.",
        'Every error answer is a JSON body `{"code", "type", "message"}`. Fetch the',
        "documents from a running server to generate a client:",
        "",
        "```bash",
        "curl http://127.0.0.1:8080/api-description > inference.json",
        'curl http://127.0.0.1:8081/api-description -H "Authorization: Bearer $KEY" \\',
        "    > management.json",
        "```",
        "",
    ]
    for api, port in (("inference", 8080), ("management", 8081)):
        doc = describe(api)
        out += [f"## The {api} API (port {port})", ""]
        for path, item in sorted(doc["paths"].items()):
            for method in _METHODS:
                if method in item:
                    out += _operation(path, method, item[method])
    return "\n".join(out)

"""A workflow's specification (the YAML file of its ``.war``), parsed and checked.

TorchServe's format::

    models:
      min-workers: 1          # defaults of every model below
      batch-size: 4
      m1:
        url: m1.mar           # the model store, or a URL (as a registration's url)
        max-workers: 2        # overrides the default for this model
    dag:
      pre: [m1, m2]           # node: the nodes its output goes to
      m1: [post]
      m2: [post]

A DAG node is a model of ``models``, else a function of the archive's handler file. The DAG
must have one start node (the request goes there) and no cycle; its leaves make the answer.
Everything is checked here, before any model is registered: a bad spec registers nothing.
"""

from __future__ import annotations

import ast
import logging
from dataclasses import dataclass, replace
from typing import Any

import yaml

from archiver.manifest import is_valid_model_name
from server.workflows.errors import InvalidWorkflow

log = logging.getLogger(__name__)

# TorchServe's model properties (its docs/workflows.md), with its defaults
DEFAULTS = {
    "min-workers": 1,
    "max-workers": 1,
    "batch-size": 1,
    "max-batch-delay": 50,
    "retry-attempts": 1,
    "timeout-ms": 10_000,
}
# TorchServe registers every model of a workflow as <workflow>__<node>
NODE_SEPARATOR = "__"


@dataclass(frozen=True)
class NodeSettings:
    min_workers: int
    max_workers: int
    batch_size: int
    max_batch_delay_ms: int
    retry_attempts: int  # tries after the first one
    timeout_ms: int  # one try

    @classmethod
    def of(cls, values: dict[str, int]) -> NodeSettings:
        return cls(
            min_workers=values["min-workers"],
            max_workers=max(values["max-workers"], values["min-workers"]),
            batch_size=values["batch-size"],
            max_batch_delay_ms=values["max-batch-delay"],
            retry_attempts=values["retry-attempts"],
            timeout_ms=values["timeout-ms"],
        )


@dataclass(frozen=True)
class Node:
    name: str
    url: str | None  # the model's archive; None: a function of the handler file
    settings: NodeSettings
    parents: tuple[str, ...]
    children: tuple[str, ...]

    @property
    def is_function(self) -> bool:
        return self.url is None


@dataclass(frozen=True)
class WorkflowSpec:
    nodes: tuple[Node, ...]  # in an order where every node comes after its parents
    start: str
    leaves: tuple[str, ...]
    defaults: NodeSettings
    dag_text: str  # the DAG as TorchServe's describe shows it: {pre=[m1, m2], m1=[post]}

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)


def handler_functions(source: str, handler: str) -> set[str]:
    """The names the handler file defines at its top (functions, classes, assignments,
    imports), read without running it: a DAG node that is no model must be one of them."""
    try:
        tree = ast.parse(source, filename=handler)
    except SyntaxError as exc:
        raise InvalidWorkflow(
            f"the workflow's handler {handler} is not valid Python: {exc.msg} (line {exc.lineno})"
        ) from None
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    return names


def _settings(values: dict[str, Any], base: dict[str, int], where: str) -> dict[str, int]:
    out = dict(base)
    for key, value in values.items():
        if key not in DEFAULTS:
            continue
        if type(value) is not int or value < 0:
            raise InvalidWorkflow(f"{where}: {key} should be an integer >= 0, found {value!r}")
        if key in ("batch-size", "timeout-ms") and value < 1:
            raise InvalidWorkflow(f"{where}: {key} should be at least 1, found {value}")
        out[key] = value
    return out


def parse_spec(
    text: str, spec_file: str, workflow: str, handler_source: str, handler: str
) -> WorkflowSpec:
    """Parse and check the spec of ``workflow``; raises InvalidWorkflow naming what is wrong."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidWorkflow(f"workflow spec {spec_file} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidWorkflow(f"workflow spec {spec_file}: expected a mapping with models and dag")
    models_section = data.get("models")
    dag_section = data.get("dag")
    if not isinstance(models_section, dict):
        raise InvalidWorkflow(f"workflow spec {spec_file}: 'models' is missing or not a mapping")
    if not isinstance(dag_section, dict) or not dag_section:
        raise InvalidWorkflow(
            f"workflow spec {spec_file}: 'dag' is missing, empty or not a mapping"
        )

    defaults = _settings(
        {k: v for k, v in models_section.items() if k in DEFAULTS}, DEFAULTS,
        f"workflow spec {spec_file}, models",
    )  # fmt: skip
    models: dict[str, tuple[str, dict[str, int]]] = {}
    for name, entry in models_section.items():
        if name in DEFAULTS:
            continue
        where = f"workflow spec {spec_file}, model {name}"
        if not isinstance(entry, dict):
            raise InvalidWorkflow(
                f"{where}: expected a mapping with its url, found {entry!r} (the models section"
                f" takes {', '.join(DEFAULTS)} and one mapping per model)"
            )
        url = entry.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidWorkflow(
                f"{where}: 'url' (its .mar in the model store, or a URL) is missing"
            )
        unknown = sorted(str(k) for k in entry if k != "url" and k not in DEFAULTS)
        if unknown:  # TorchServe ignores them too
            log.warning("%s: ignoring %s (known: url, %s)", where, ", ".join(unknown),
                        ", ".join(DEFAULTS))  # fmt: skip
        models[str(name)] = (url, _settings(entry, defaults, where))

    functions = handler_functions(handler_source, handler)
    children: dict[str, list[str]] = {}
    for parent, targets in dag_section.items():
        parent = str(parent)
        if targets is None:
            targets = []
        if not isinstance(targets, list):
            raise InvalidWorkflow(
                f"workflow spec {spec_file}, dag: {parent} should list the nodes its output"
                f" goes to ([a, b], or [] for none), found {targets!r}"
            )
        kids = children.setdefault(parent, [])
        for target in targets:
            if target is None or not str(target).strip():
                continue  # TorchServe skips empty entries
            target = str(target).strip()
            if target == parent:
                raise InvalidWorkflow(f"workflow spec {spec_file}, dag: {parent} feeds itself")
            if target not in kids:
                kids.append(target)
            children.setdefault(target, [])
    parents: dict[str, list[str]] = {name: [] for name in children}
    for parent, kids in children.items():
        for kid in kids:
            parents[kid].append(parent)

    for name in children:
        model_name = f"{workflow}{NODE_SEPARATOR}{name}"
        if not is_valid_model_name(model_name):
            raise InvalidWorkflow(
                f"workflow spec {spec_file}, dag: node {name!r} makes the model name"
                f" {model_name!r}, which is not a valid model name"
            )
        if name not in models and name not in functions:
            raise InvalidWorkflow(
                f"workflow spec {spec_file}, dag: node {name!r} is neither a model of the"
                f" models section ({', '.join(models) or 'none'}) nor a function of the handler"
                f" {handler}"
            )
    starts = [n for n, p in parents.items() if not p]
    if len(starts) != 1:
        raise InvalidWorkflow(
            f"workflow spec {spec_file}, dag: a workflow has one start node, where requests"
            f" enter; found {len(starts)} ({', '.join(starts) or 'every node has a parent'})"
        )
    order = _topological(children, parents)
    if len(order) != len(children):
        looped = sorted(set(children) - set(order))
        raise InvalidWorkflow(
            f"workflow spec {spec_file}, dag: not acyclic (a cycle through {', '.join(looped)})"
        )

    default_settings = NodeSettings.of(defaults)
    # a function runs in one worker of its own, one request at a time (TorchServe's choice)
    function_settings = replace(
        default_settings, min_workers=1, max_workers=1, batch_size=1, max_batch_delay_ms=0
    )
    nodes = []
    for name in order:
        if name in models:
            url, values = models[name]
            settings = NodeSettings.of(values)
        else:
            url, settings = None, function_settings
        nodes.append(Node(name, url, settings, tuple(parents[name]), tuple(children[name])))
    leaves = tuple(n for n in order if not children[n])
    dag_text = "{" + ", ".join(f"{k}=[{', '.join(v)}]" for k, v in children.items() if v) + "}"
    return WorkflowSpec(tuple(nodes), starts[0], leaves, default_settings, dag_text)


def _topological(children: dict[str, list[str]], parents: dict[str, list[str]]) -> list[str]:
    waiting = {name: len(p) for name, p in parents.items()}
    ready = [name for name, count in waiting.items() if count == 0]
    order: list[str] = []
    while ready:
        name = ready.pop(0)
        order.append(name)
        for kid in children[name]:
            waiting[kid] -= 1
            if waiting[kid] == 0:
                ready.append(kid)
    return order

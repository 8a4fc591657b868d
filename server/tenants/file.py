"""The tenants file: who may call the inference API, with which keys, weight and quotas.

YAML, read with its line numbers kept, so a mistake is named by its line::

    tenants:
      team-a:
        keys: [sha256:9f86d0...]        # sha256 of each key: `python -m server.tenants`
        weight: 3                       # its share of a model's queue under contention
        quota: {requests_per_second: 50, burst: 100, in_flight: 32}
        models:                         # per model, on top of the tenant's own quota
          mlp: {requests_per_second: 10, burst: 20, in_flight: 4}
          llm: {tokens_per_second: 200, token_burst: 2000}   # generated tokens
      default:                          # the server's own inference key (optional entry)
        weight: 1

Keys are stored hashed: the file never holds a key a reader could send. ``default`` is the
tenant of the server's inference key (key_file.json): an entry of that name sets its weight and
quotas, and may add keys of its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.errors import ConfigError

DEFAULT = "default"
MAX_FILE_BYTES = 1024 * 1024
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # a metric label and a log field
HASH = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")
QUOTA_FIELDS = ("requests_per_second", "burst", "in_flight", "tokens_per_second", "token_burst")
TENANT_FIELDS = ("keys", "weight", "quota", "models")


@dataclass(frozen=True)
class Quota:
    """Requests per second (a token bucket holding up to ``burst``), requests in flight, and
    for generative models generated tokens per second (a bucket holding up to ``token_burst``,
    charged as tokens are produced: server/tenants/tokens.py); None: no bound."""

    requests_per_second: float | None = None
    burst: float | None = None
    in_flight: int | None = None
    tokens_per_second: float | None = None
    token_burst: float | None = None


@dataclass(frozen=True)
class TenantSpec:
    name: str
    key_hashes: tuple[str, ...] = ()
    weight: float = 1.0
    quota: Quota = Quota()
    models: dict[str, Quota] = field(default_factory=dict)


class _Problem(ConfigError):
    pass


def read_bytes(path: Path) -> bytes:
    """The tenants file's bytes, at most MAX_FILE_BYTES; ConfigError naming it otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read tenants_file {path}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"tenants_file {path} is larger than {MAX_FILE_BYTES} bytes")
    return data


def read(path: Path, known_models: Callable[[], Iterable[str] | None]) -> dict[str, TenantSpec]:
    """The tenants of ``path``, by name; ConfigError naming the file and line of a mistake.
    ``known_models``: the registered model names, which quotas may name (None: not known yet,
    at start before the startup models are registered)."""
    data = read_bytes(path)
    try:
        return parse(data.decode("utf-8"), known_models, str(path))
    except UnicodeDecodeError:
        raise ConfigError(f"tenants_file {path} is not UTF-8 text") from None


def parse(
    text: str, known_models: Callable[[], Iterable[str] | None], where: str = "tenants_file"
) -> dict[str, TenantSpec]:
    import yaml  # here: slow to import, paid only by a server with a tenants file

    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}{line}: not valid YAML: {problem}") from None

    def fail(node: Any, message: str) -> _Problem:
        return _Problem(f"{where} line {node.start_mark.line + 1}: {message}")

    if root is None or not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{where}: expected a mapping with a 'tenants' key")
    top = _mapping(root, fail, ("tenants",), "the file")
    if "tenants" not in top:
        raise fail(root, "no 'tenants' key")
    tenants_node = top["tenants"][1]
    entries = _mapping(tenants_node, fail, None, "'tenants'")
    names = known_models()
    models = None if names is None else set(names)
    specs: dict[str, TenantSpec] = {}
    seen_keys: dict[str, str] = {}
    for name, (name_node, node) in entries.items():
        if not NAME.match(name):
            raise fail(name_node, f"tenant name {name!r} should be 1-63 letters, digits, . _ -")
        fields = _mapping(node, fail, TENANT_FIELDS, f"tenant {name!r}")
        keys: list[str] = []
        if "keys" in fields:
            keys_node = fields["keys"][1]
            if not isinstance(keys_node, yaml.SequenceNode):
                raise fail(keys_node, f"tenant {name!r}: 'keys' should be a list of sha256 hashes")
            for item in keys_node.value:
                value = item.value if isinstance(item, yaml.ScalarNode) else None
                match = HASH.match(str(value).strip().lower()) if value is not None else None
                if match is None:
                    raise fail(
                        item, f"tenant {name!r}: a key should be stored as its sha256 hash"
                        " ('sha256:' and 64 hex digits; `python -m server.tenants` makes a key"
                        " and its hash), not as the key itself",
                    )  # fmt: skip
                digest = match.group(1)
                if digest in seen_keys:
                    raise fail(
                        item, f"tenant {name!r}: duplicate key (also a key of tenant"
                        f" {seen_keys[digest]!r})",
                    )  # fmt: skip
                seen_keys[digest] = name
                keys.append(digest)
        elif name != DEFAULT:
            raise fail(node, f"tenant {name!r} has no 'keys'")
        weight = 1.0
        if "weight" in fields:
            weight = _number(fields["weight"][1], fail, f"tenant {name!r}: 'weight'")
            if weight <= 0:
                raise fail(fields["weight"][1], f"tenant {name!r}: 'weight' should be above 0")
        quota = Quota()
        if "quota" in fields:
            quota = _quota(fields["quota"][1], fail, f"tenant {name!r}: 'quota'")
        per_model: dict[str, Quota] = {}
        if "models" in fields:
            for model, (model_node, q) in _mapping(
                fields["models"][1], fail, None, f"tenant {name!r}: 'models'"
            ).items():
                if models is not None and model not in models:
                    known = ", ".join(sorted(models)) or "none registered"
                    raise fail(
                        model_node,
                        f"tenant {name!r}: unknown model {model!r} in its quotas (models: {known})",
                    )
                per_model[model] = _quota(q, fail, f"tenant {name!r}: model {model!r}")
        specs[name] = TenantSpec(name, tuple(keys), weight, quota, per_model)
    return specs


def _mapping(
    node: Any, fail: Callable[[Any, str], _Problem], allowed: Iterable[str] | None, what: str
) -> dict[str, tuple[Any, Any]]:
    import yaml

    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise fail(node, f"{what} should be a mapping")
    out: dict[str, tuple[Any, Any]] = {}
    allowed = tuple(allowed) if allowed is not None else None
    for key_node, value_node in node.value:
        key = str(key_node.value)
        if key in out:
            raise fail(key_node, f"{what}: duplicate entry {key!r}")
        if allowed is not None and key not in allowed:
            raise fail(key_node, f"{what}: unknown field {key!r} (fields: {', '.join(allowed)})")
        out[key] = (key_node, value_node)
    return out


def _number(node: Any, fail: Callable[[Any, str], _Problem], what: str) -> float:
    try:
        value = float(node.value)
    except (TypeError, ValueError):
        raise fail(node, f"{what} should be a number, found {node.value!r}") from None
    if not math.isfinite(value):
        raise fail(node, f"{what} should be a finite number, found {node.value!r}")
    return value


def _quota(node: Any, fail: Callable[[Any, str], _Problem], what: str) -> Quota:
    fields = _mapping(node, fail, QUOTA_FIELDS, what)
    values: dict[str, float] = {}
    for key, (_key_node, value_node) in fields.items():
        value = _number(value_node, fail, f"{what}: {key!r}")
        if value <= 0:
            raise fail(value_node, f"{what}: {key!r} should be above 0")
        values[key] = value
    if "burst" in values and "requests_per_second" not in values:
        raise fail(node, f"{what}: 'burst' needs 'requests_per_second'")
    if "token_burst" in values and "tokens_per_second" not in values:
        raise fail(node, f"{what}: 'token_burst' needs 'tokens_per_second'")
    rate = values.get("requests_per_second")
    in_flight = values.get("in_flight")
    if in_flight is not None and in_flight != int(in_flight):
        raise fail(fields["in_flight"][1], f"{what}: 'in_flight' should be a whole number")
    burst = values.get("burst", max(1.0, rate) if rate is not None else None)
    token_rate = values.get("tokens_per_second")
    token_burst = values.get("token_burst", max(1.0, token_rate) if token_rate else None)
    return Quota(
        rate, burst, None if in_flight is None else int(in_flight), token_rate, token_burst
    )

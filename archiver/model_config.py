"""Validate the model config YAML (``--config-file``) at archive time, not at serve time.

The server settings TorchServe reads from this file are checked for type and range. Every other
top-level key is handler configuration (TorchServe hands the whole file to the handler), so it is
kept, except a key so close to a known one that it is almost surely a typo.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from archiver.errors import InvalidModelConfig
from archiver.jsonschema_import import import_jsonschema

if TYPE_CHECKING:
    import jsonschema

_INT0 = {"type": "integer", "minimum": 0}
_INT1 = {"type": "integer", "minimum": 1}
_BOOL = {"type": "boolean"}

# Keys the server side understands, with TorchServe's names and meanings.
SERVER_KEYS: dict[str, dict[str, Any]] = {
    "minWorkers": _INT0,
    "maxWorkers": _INT0,
    "batchSize": _INT1,
    "maxBatchDelay": _INT0,
    "responseTimeout": _INT1,
    "startupTimeout": _INT1,
    "deviceType": {"enum": ["cpu", "gpu", "neuron"]},
    "deviceIds": {"type": "array", "items": _INT0},
    "parallelLevel": _INT1,
    "parallelType": {"enum": ["pp", "tp", "pptp", "custom"]},
    "torchrun": {"type": "object"},
    "maxRetryTimeoutInSec": _INT0,
    "clientTimeoutInMills": _INT0,
    "jobQueueSize": _INT1,
    "useJobTicket": _BOOL,
    "continuousBatching": _BOOL,
    "sequenceBatching": _BOOL,
    "sequenceMaxIdleMSec": _INT0,
    "sequenceTimeoutMSec": _INT0,
    "maxSequenceJobQueueSize": _INT1,
    "maxNumSequence": _INT1,
    "asyncCommunication": _BOOL,
    "useVenv": _BOOL,
    "isolatedEnv": _BOOL,  # mserve: the model's environment does not see the server's packages
    "retryOnWorkerDeath": _BOOL,  # mserve: a dead worker's requests get one more try
    # mserve: a batch waits for more requests only while its worker is busy (busy, the
    # default), or up to maxBatchDelay whatever the worker does (fill, TorchServe's way)
    "batchWait": {"enum": ["busy", "fill"]},
    # mserve: server environment variables the model's workers get although the server's
    # worker_env_deny holds them back (exact names)
    "allowedEnvVars": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "handler": {"type": "object"},
}

_SCHEMA = {
    "type": "object",
    "properties": SERVER_KEYS,
    "additionalProperties": True,
}


def _describe(error: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
    if error.validator == "type":
        return f"'{where}' should be {error.validator_value}, found {error.instance!r}"
    if error.validator == "minimum":
        return f"'{where}' should be >= {error.validator_value}, found {error.instance!r}"
    if error.validator == "enum":
        return f"'{where}' should be one of {error.validator_value}, found {error.instance!r}"
    return f"'{where}': {error.message}"


def _typo_of(key: str) -> str | None:
    """The known key that ``key`` most likely misspells, if any."""
    if key in SERVER_KEYS:
        return None
    lowered = {k.lower(): k for k in SERVER_KEYS}
    if key.lower() in lowered:
        return lowered[key.lower()]
    close = difflib.get_close_matches(key, list(SERVER_KEYS), n=1, cutoff=0.85)
    return close[0] if close else None


def validate_model_config(data: Any, source: str) -> dict[str, Any]:
    """Check a parsed model config; return it as a dict (empty file -> empty config)."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidModelConfig(source, f"expected a mapping of keys, found {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise InvalidModelConfig(source, f"key {key!r} is not a string")
        typo = _typo_of(key)
        if typo:
            raise InvalidModelConfig(source, f"unknown key '{key}'", hint=f"did you mean '{typo}'?")
    jsonschema = import_jsonschema()  # here: paid only by a model that has a config file

    errors = list(jsonschema.Draft202012Validator(_SCHEMA).iter_errors(data))
    if errors:
        raise InvalidModelConfig(source, _describe(jsonschema.exceptions.best_match(errors)))
    lo, hi = data.get("minWorkers"), data.get("maxWorkers")
    if lo is not None and hi is not None and lo > hi:
        raise InvalidModelConfig(source, f"minWorkers ({lo}) is greater than maxWorkers ({hi})")
    return data


def load_model_config(path: Path) -> dict[str, Any]:
    """Read and validate a model config file, with errors that name the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidModelConfig(str(path), "not UTF-8 text") from exc
    import yaml  # here: slow to import, paid only by a model that has a config file

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidModelConfig(str(path), f"YAML syntax error{where}: {problem}") from exc
    return validate_model_config(data, str(path))

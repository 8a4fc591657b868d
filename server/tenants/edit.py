"""Changing the tenants through the management API (docs/tenants.md): the file stays the one
source of truth. A change is made to the file's current text (read now, so a hand edit already
saved is kept), checked by the same parser as a reload (:func:`server.tenants.file.parse`),
written atomically (a temporary file in the same folder, then a rename), and applied by the
reload path (:meth:`Tenants.check_reload`), as a hand edit would be.

The text is edited with ruamel.yaml's round trip: comments, the order of tenants and fields, the
flow or block style of each mapping and list, and quotes are kept; what it rewrites is the
indentation of block lists (written two spaces in from their key, as docs/tenants.md shows them)
and a comment that sat inside a removed tenant or key goes with it.

A key made here is returned once; only its sha256 goes in the file. A key is named by its id,
``sha256:`` and the hash's first 12 hex digits: the hash of a random 256-bit key, so safe to show.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from server.errors import BadRequest, ConfigError, MserveError, PathNotFound
from server.tenants.file import DEFAULT, HASH, NAME, Quota, parse, read_bytes
from server.tenants.registry import Tenant, Tenants, key_hash

log = logging.getLogger(__name__)

ID_DIGITS = 12  # of a key's hash, in its id
MIN_ID_DIGITS = 8  # a shorter id given to revoke is refused: too easy to mistake
BODY_FIELDS = ("weight", "quota", "models")  # what a body may set (keys are made here)


class TenantNotFound(PathNotFound):
    type = "TenantNotFoundException"


class TenantConflict(MserveError):
    """The change cannot be made to the file as it is: the tenant exists already, the file does
    not read now (a hand edit half done), or it cannot be written."""

    status = 409
    type = "ConflictStatusException"


def required(current: Tenants | None) -> Tenants:
    """The server's tenants (``server.tenants.current``), or a 404 saying there are none."""
    if current is None:
        raise PathNotFound(
            "the server has no tenants_file: tenants are set in that file (docs/tenants.md)"
        )
    return current


def key_id(digest: str) -> str:
    return f"sha256:{digest[:ID_DIGITS]}"


def _quota(quota: Quota) -> dict[str, Any]:
    """A quota's fields that are set, as the file spells them."""
    return {k: v for k, v in asdict(quota).items() if v is not None}


def _keys_of(current: Tenants, tenant: Tenant) -> list[str]:
    return sorted(key_id(d) for d, t in current.by_hash.items() if t is tenant)


def listing(current: Tenants) -> dict[str, Any]:
    """The tenants in force: name, weight, quotas and how many keys (never a key)."""
    rows = []
    for tenant in current.by_name.values():
        rows.append({
            "name": tenant.name, "weight": tenant.weight,
            "keys": len(_keys_of(current, tenant)), "quota": _quota(tenant.limits.quota),
            "models": {m: _quota(lim.quota) for m, lim in tenant.model_limits.items()},
        })  # fmt: skip
    return {"file": str(current.path), "tenants": rows}


def detail(current: Tenants, name: str, queues: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """One tenant in force with its keys' ids and its live usage: requests served (taken to a
    worker) and refused by model, and each quota's requests in flight and bucket level.
    ``queues``: (model name, a version's queue), whose ``served`` counts by tenant."""
    tenant = _tenant(current, name)
    served: dict[str, int] = {}
    for model, queue in queues:
        n = getattr(queue, "served", {}).get(name, 0)
        if n:
            served[model] = served.get(model, 0) + n
    return {
        "name": tenant.name, "weight": tenant.weight, "keys": _keys_of(current, tenant),
        "quota": _quota(tenant.limits.quota),
        "models": {m: _quota(lim.quota) for m, lim in tenant.model_limits.items()},
        "usage": {
            "served": served, "refused": dict(tenant.refused), **_live(tenant.limits),
            "models": {m: _live(lim) for m, lim in tenant.model_limits.items()},
        },
    }  # fmt: skip


def _live(lim: Any) -> dict[str, Any]:
    """A quota's requests in flight and its buckets' levels now: requests its rate lets in, and
    generated tokens (below 0: a debt); None where the quota does not bound them (in flight is
    counted only under an ``in_flight`` quota)."""
    now = time.monotonic()
    levels = []
    for bucket in (lim.bucket, lim.token_bucket):
        if bucket is not None:
            bucket.wait_s(now)  # refilled to now
        levels.append(None if bucket is None else round(bucket.tokens, 3))
    return {"in_flight": lim.in_flight if lim.quota.in_flight else None,
            "bucket_tokens": levels[0], "generated_tokens_left": levels[1]}  # fmt: skip


def _tenant(current: Tenants, name: str) -> Tenant:
    tenant = current.by_name.get(name)
    if tenant is None:
        known = ", ".join(sorted(current.by_name))
        raise TenantNotFound(f"no tenant {name!r} (tenants: {known})")
    return tenant


# --- changes ------------------------------------------------------------------------------


def add_tenant(current: Tenants, body: Any) -> dict[str, Any]:
    """A new tenant from ``body`` (``name`` and the optional fields of :data:`BODY_FIELDS`)
    with a key made here: the answer holds the key, once."""
    fields = _body(body, ("name", *BODY_FIELDS))
    name = fields.pop("name", None)
    if not isinstance(name, str) or not NAME.match(name):
        raise BadRequest(f"body: 'name' should be 1-63 letters, digits, . _ - (found {name!r})")
    key = secrets.token_urlsafe(32)
    digest = key_hash(key)

    def change(tenants: Any) -> None:
        if name in tenants or name == DEFAULT:
            raise TenantConflict(f"tenant {name!r} exists already: PUT /tenants/{name} changes it")
        entry = _new_map()
        entry["keys"] = _block_list([f"sha256:{digest}"])
        _set_fields(entry, fields)
        tenants[name] = entry

    _change(current, change, f"tenant {name} added")
    return {"name": name, "key": key, "id": key_id(digest), **_summary(current, name)}


def change_tenant(current: Tenants, name: str, body: Any) -> dict[str, Any]:
    """Set a tenant's ``weight``, ``quota`` or ``models``; a field left out stays, one sent as
    null is removed (its default: weight 1, no quota)."""
    fields = _body(body, BODY_FIELDS)
    _tenant(current, name)

    def change(tenants: Any) -> None:
        entry = tenants.get(name)
        if entry is None:  # the default tenant without an entry of its own
            entry = tenants[name] = _new_map()
        _set_fields(entry, fields)

    _change(current, change, f"tenant {name} changed ({', '.join(fields) or 'nothing'})")
    return _summary(current, name)


def remove_tenant(current: Tenants, name: str) -> dict[str, Any]:
    """Remove a tenant and its keys (they stop working at once)."""
    _tenant(current, name)
    if name == DEFAULT:
        raise BadRequest(
            "the default tenant is the server's own inference key's: it cannot be removed"
            " (PUT /tenants/default changes its weight and quotas)"
        )

    def change(tenants: Any) -> None:
        del tenants[name]

    _change(current, change, f"tenant {name} removed")
    return {"name": name, "removed": True}


def add_key(current: Tenants, name: str) -> dict[str, Any]:
    """A new key for the tenant, beside its others (for rotation): the answer holds the key,
    once."""
    _tenant(current, name)
    key = secrets.token_urlsafe(32)
    digest = key_hash(key)

    def change(tenants: Any) -> None:
        entry = tenants.get(name)
        if entry is None:
            entry = tenants[name] = _new_map()
        keys = entry.get("keys")
        if keys is None:
            entry["keys"] = _block_list([f"sha256:{digest}"])
        else:
            keys.append(f"sha256:{digest}")

    _change(current, change, f"tenant {name}: key {key_id(digest)} added")
    return {"name": name, "key": key, "id": key_id(digest), "keys": len(_ids(current, name))}


def revoke_key(current: Tenants, name: str, given: str) -> dict[str, Any]:
    """Remove one of the tenant's keys, named by its id (or a longer prefix of its hash, or the
    whole hash): it stops working at once. A tenant left with no key stays, unreachable."""
    _tenant(current, name)
    wanted = given.strip().lower().removeprefix("sha256:")
    if len(wanted) < MIN_ID_DIGITS or not re.fullmatch(r"[0-9a-f]{1,64}", wanted):
        raise BadRequest(
            f"key id {given!r} should be 'sha256:' and at least {MIN_ID_DIGITS} hex digits of"
            " the key's hash (GET /tenants/{name} lists its keys' ids)"
        )
    matched: list[str] = []

    def change(tenants: Any) -> None:
        keys = (tenants.get(name) or {}).get("keys") or []
        found = [i for i, k in enumerate(keys) if _digest(k).startswith(wanted)]
        if not found:
            ids = ", ".join(_ids(current, name)) or "none"
            raise TenantNotFound(f"tenant {name!r} has no key {given!r} (its keys: {ids})")
        if len(found) > 1:
            raise BadRequest(f"key id {given!r} matches {len(found)} keys of tenant {name!r}:"
                             " give more of its hash")  # fmt: skip
        matched.append(_digest(keys[found[0]]))
        del keys[found[0]]

    _change(current, change, f"tenant {name}: key sha256:{wanted[:ID_DIGITS]} revoked")
    return {"name": name, "revoked": key_id(matched[0]), "keys": len(_ids(current, name))}


def _ids(current: Tenants, name: str) -> list[str]:
    return _keys_of(current, _tenant(current, name))


def _digest(value: Any) -> str:
    match = HASH.match(str(value).strip().lower())
    return match.group(1) if match else ""


def _summary(current: Tenants, name: str) -> dict[str, Any]:
    row = next(r for r in listing(current)["tenants"] if r["name"] == name)
    return {k: v for k, v in row.items() if k != "name"}


def _body(body: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The body's fields, their shapes checked (numbers where numbers go); the values
    themselves are checked by the file's parser, with its words."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"body: should be a JSON object with {', '.join(allowed)}")
    for key in body:
        if key not in allowed:
            raise BadRequest(f"body: unknown field {key!r} (fields: {', '.join(allowed)})")
    fields = dict(body)
    if "weight" in fields and fields["weight"] is not None:
        _number(fields["weight"], "weight")
    if fields.get("quota") is not None:
        _numbers(fields["quota"], "quota")
    if fields.get("models") is not None:
        models = fields["models"]
        if not isinstance(models, Mapping):
            raise BadRequest("body: 'models' should be an object: model name -> quota")
        for model, quota in models.items():
            _numbers(quota, f"models.{model}")
    return fields


def _numbers(value: Any, where: str) -> None:
    if not isinstance(value, Mapping):
        raise BadRequest(f"body: {where!r} should be an object of quota fields")
    for key, number in value.items():
        _number(number, f"{where}.{key}")


def _number(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"body: {where!r} should be a number, found {value!r}")


def _set_fields(entry: Any, fields: dict[str, Any]) -> None:
    for key in BODY_FIELDS:
        if key not in fields:
            continue
        value = fields[key]
        if value is None:
            entry.pop(key, None)
        elif key == "weight":
            entry[key] = _plain(value)
        elif key == "quota":
            entry[key] = _flow_map({k: _plain(v) for k, v in value.items()})
        else:
            models = _new_map()
            for model, quota in value.items():
                models[model] = _flow_map({k: _plain(v) for k, v in quota.items()})
            entry[key] = models


def _plain(value: float) -> float | int:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _new_map() -> Any:
    from ruamel.yaml.comments import CommentedMap

    return CommentedMap()


def _flow_map(values: dict[str, Any]) -> Any:
    out = _new_map()
    out.update(values)
    out.fa.set_flow_style()
    return out


def _block_list(values: list[str]) -> Any:
    from ruamel.yaml.comments import CommentedSeq

    return CommentedSeq(values)


def _yaml() -> Any:
    from ruamel.yaml import YAML  # here: imported by a server whose tenants are changed

    yaml = YAML()  # round trip: comments, order, styles and quotes kept
    yaml.preserve_quotes = True
    yaml.width = 4096  # no line folded
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml


def _change(current: Tenants, change: Callable[[Any], None], what: str) -> None:
    """Apply ``change`` to the tenants mapping of the file's current text, check the result as
    a reload would, write it, and reload. Synchronous on purpose: two changes never interleave,
    nor a change and the watcher's reload (they share the event loop); the file is small
    (MAX_FILE_BYTES)."""
    path = current.path
    text = _read(path)
    try:
        # its model names unchecked: a quota naming a model unregistered since is a mistake
        # of the new text (400 naming it), which the change may be the one to remove
        parse(text, lambda: None, str(path))
    except ConfigError as exc:
        raise TenantConflict(
            f"{exc.message}: the file does not read now, so no change is made to it; fix it"
            " first (the tenants in force are the last ones read)"
        ) from None
    from ruamel.yaml.error import YAMLError

    yaml = _yaml()
    try:
        data = yaml.load(text)
    except YAMLError as exc:  # read by PyYAML above, but not by ruamel.yaml (YAML 1.2)
        raise TenantConflict(
            f"tenants_file {path} cannot be edited here ({exc}); edit it by hand"
        ) from None
    if data.get("tenants") is None:
        data["tenants"] = _new_map()
    change(data["tenants"])
    out = io.StringIO()
    yaml.dump(data, out)
    new_text = out.getvalue()
    try:
        parse(new_text, current.known_models, str(path))
    except ConfigError as exc:
        # "path line N: tenant 'x': ..." of a text not written: the line means nothing
        raise BadRequest(re.sub(r"^.*? line \d+: ", "", exc.message)) from None
    _write(path, new_text)
    if current.check_reload() is None:  # the same size and mtime as before (a coarse clock)
        current.load()
    log.info("tenants: %s through the management API; %s written", what, path)


def _read(path: Path) -> str:
    try:
        data = read_bytes(path)
    except ConfigError as exc:  # the file is not the request's fault: a conflict
        raise TenantConflict(exc.message) from None
    return data.decode("utf-8", "replace")


def _write(path: Path, text: str) -> None:
    """Replace the file by ``text`` at once (a reader sees the old file or the new one), with
    the old one's permissions. A symlink (a mounted ConfigMap's) is followed: its target is
    replaced."""
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(target).st_mode & 0o7777
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:
        raise TenantConflict(f"cannot write tenants_file {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise TenantConflict(f"cannot write tenants_file {path}: {exc.strerror}") from None

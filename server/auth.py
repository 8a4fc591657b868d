"""Token authorization, on by default, with TorchServe's three keys and key file.

At start the server makes a management key, an inference key and an API key (32 random bytes
each, URL-safe base64: 256 bits, where TorchServe's keys carry 48) and writes them to
``<run_dir>/key_file.json`` (mode 0600) in TorchServe's layout, so scripts that read
``.management.key`` or ``.inference.key`` from that file keep working. Clients send
``Authorization: Bearer <key>``: the inference key on the inference port, the management key on
the management port (and on the metrics port when ``metrics_need_token``). The API key only
rotates the other two: ``GET /token?type=management|inference`` on the management port.
Keys are compared in constant time; the management and inference keys expire
(``token_expiration_min``, 60 as in TorchServe; per kind with
``{inference,management}_token_expiration_min``) and a rotation starts a new term.

A refusal is 401 with ``WWW-Authenticate: Bearer`` and TorchServe's error body (type
``InvalidKeyException``); TorchServe answers 400. Probes (``token_exempt_paths``: ``/ping``,
``/v2/health/*`` and the API description by default) need no key.

Fixed keys (``token_key_file``): replicas behind one Service must accept the same key, which
random per-process keys cannot give. The file (a Kubernetes Secret, mounted) holds the
inference and management keys, and optionally the API key, in key_file.json's layout; such keys
never expire and ``GET /token`` refuses to rotate them, since a rotation would reach one
replica only.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server import tenants
from server.config import split_address
from server.errors import BadRequest, ConfigError, Unauthorized
from server.rundir import write_json_atomic

if TYPE_CHECKING:
    from server.tenants import Tenant

log = logging.getLogger(__name__)

KINDS = ("management", "inference")  # the keys that expire and rotate
API = "API"  # the key that rotates them (TorchServe's name in its key file)
KEY_BYTES = 32
# A fixed key's bounds: long enough not to be guessed, short enough for a header; printable
# ASCII without spaces, so it survives a header and a shell.
FIXED_KEY_MIN_CHARS = 16
FIXED_KEY_MAX_CHARS = 512
FIXED_KEY_FILE_MAX_BYTES = 64 * 1024


@dataclass
class _Key:
    value: str
    expires: float | None  # epoch seconds; None: never (the API key)
    encoded: bytes = b""  # ``value`` as bytes, what each request is compared with

    def __post_init__(self) -> None:
        self.encoded = self.value.encode()

    def entry(self) -> dict[str, str]:
        out = {"key": self.value}
        if self.expires is not None:
            out["expiration time"] = _iso(self.expires)
        return out


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _new_key() -> str:
    return secrets.token_urlsafe(KEY_BYTES)


def bearer(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (scheme in any case), else None."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def read_key_file(path: Path) -> dict[str, str]:
    """The fixed keys of ``token_key_file``: ``{"inference": {"key": "..."}, "management":
    {"key": "..."}, "API": {"key": "..."}}`` (key_file.json's layout; a plain string in place
    of ``{"key": ...}`` also works; ``API`` may be left out). Expiry times in it are ignored."""
    where = f"token_key_file {path}"
    try:
        with open(path, "rb") as f:
            data = f.read(FIXED_KEY_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror}") from None
    if len(data) > FIXED_KEY_FILE_MAX_BYTES:
        raise ConfigError(f"{where} is larger than {FIXED_KEY_FILE_MAX_BYTES} bytes")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected an object with 'inference' and 'management' keys")
    keys = {}
    for kind in (*KINDS, API):
        entry = doc.get(kind)
        if entry is None:
            if kind == API:
                continue
            raise ConfigError(f"{where} has no '{kind}' key")
        value = entry.get("key") if isinstance(entry, dict) else entry
        if not isinstance(value, str):
            raise ConfigError(f"{where}: '{kind}' should be a string or {{\"key\": string}}")
        if not FIXED_KEY_MIN_CHARS <= len(value) <= FIXED_KEY_MAX_CHARS:
            raise ConfigError(
                f"{where}: the '{kind}' key has {len(value)} characters; it should have"
                f" {FIXED_KEY_MIN_CHARS} to {FIXED_KEY_MAX_CHARS}"
            )
        if not all("!" <= c <= "~" for c in value):
            raise ConfigError(f"{where}: the '{kind}' key should be printable ASCII without spaces")
        keys[kind] = value
    return keys


class Keys:
    """The server's keys and their file; rotation rewrites the file. ``fixed``: keys given by
    the operator (``token_key_file``), which never expire and are not rotated."""

    def __init__(
        self, path: Path, lifetimes_s: Mapping[str, float],
        clock: Callable[[], float] = time.time, fixed: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.path = path
        self.lifetimes_s = dict(lifetimes_s)
        self.clock = clock
        self.fixed = fixed is not None
        now = clock()
        if fixed is not None:
            self._keys = {kind: _Key(fixed[kind], None) for kind in KINDS}
            self._keys[API] = _Key(fixed.get(API) or _new_key(), None)
            return
        self._keys = {kind: _Key(_new_key(), now + lifetimes_s[kind]) for kind in KINDS}
        self._keys[API] = _Key(_new_key(), None)

    def write(self) -> None:
        write_json_atomic(self.path, {k: key.entry() for k, key in self._keys.items()}, 0o600)

    def remove(self) -> None:
        """TorchServe deletes its key file when it stops; so do we (the keys die with us)."""
        self.path.unlink(missing_ok=True)

    def rotate(self, kind: str) -> dict[str, Any]:
        """A new key of ``kind`` with a new term; the old one stops working at once."""
        if kind not in KINDS:
            raise BadRequest(
                f"parameter 'type' should be one of {', '.join(KINDS)}, found {kind!r}"
            )
        if self.fixed:
            raise BadRequest(
                "the keys are fixed (token_key_file) and are not rotated through the API:"
                " change the file and restart the server"
            )
        key = self._keys[kind] = _Key(_new_key(), self.clock() + self.lifetimes_s[kind])
        self.write()
        log.info("the %s key was rotated (GET /token); it expires %s", kind, _iso(key.expires or 0))
        return {kind: key.entry()}

    def check(self, kind: str, sent: str | None, realm: str) -> None:
        """Raise Unauthorized unless ``sent`` is the live key of ``kind``."""
        key = self._keys[kind]
        if (
            sent is not None
            and hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), key.encoded)
            and (key.expires is None or self.clock() < key.expires)
        ):
            return  # the common case, checked without building any message
        what = "the API key" if kind == API else f"the {kind} key"
        if sent is None:
            raise Unauthorized(
                f"token authorization is on: send {what} as 'Authorization: Bearer <key>'"
                f" (the keys are in {self.path})", realm, None,
            )  # fmt: skip
        if not hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), key.encoded):
            raise Unauthorized(f"the key sent is not {what}", realm, "invalid_token")
        if key.expires is not None and self.clock() >= key.expires:
            raise Unauthorized(
                f"{what} expired at {_iso(key.expires)}; get a new one with"
                f" GET /token?type={kind} on the management port, sending the API key",
                realm, "invalid_token",
            )  # fmt: skip


class Guard:
    """What one listener asks of each request before routing it."""

    def __init__(self, keys: Keys, kind: str, api: str, exempt_paths: tuple[str, ...]) -> None:
        self.keys = keys
        self.kind = kind
        self.realm = f"mserve {api} API"
        # paths as the router sees them: "/v2/health/live" -> ["v2", "health", "live"]
        self.exempt = {tuple(p.strip("/").split("/")) for p in exempt_paths}
        self.rotates = api == "management"

    def check(self, parts: list[str], method: str, authorization: str | None) -> Tenant | None:
        """The request's tenant while the server has tenants (server/tenants/), else None."""
        path = tuple(parts)
        if path in self.exempt or (
            method == "OPTIONS" and path == ("",) and ("api-description",) in self.exempt
        ):
            return None
        kind = API if self.rotates and path == ("token",) else self.kind
        return check_tenant(self.keys, kind, bearer(authorization), self.realm)


def check_tenant(keys: Keys, kind: str, sent: str | None, realm: str) -> Tenant | None:
    """Raise Unauthorized unless ``sent`` is the live key of ``kind`` or, for the inference
    key while the server has tenants, a tenant's key; the tenant it names (the server's own
    inference key: the default tenant), or None without tenants."""
    current = tenants.current
    if current is None or kind != "inference":
        keys.check(kind, sent, realm)
        return None
    tenant = current.of_key(sent)
    if tenant is not None:
        return tenant
    keys.check(kind, sent, realm)  # an unknown key is refused here, as without tenants
    if sent is not None:  # it is, once checked
        current.own_key(sent)  # not hashed again
    return current.default


def open_warning(urls: dict[str, str], model_api: bool) -> str | None:
    """What to say when token authorization is off and an API listens beyond loopback: anyone
    who reaches it can call it without a key, and register models (their code runs here)."""
    exposed = [f"{api} ({url})" for api, url in urls.items()
               if not _loopback(split_address(url.split("://", 1)[-1], api)[1])]  # fmt: skip
    if not exposed:
        return None
    runs_code = " and register models, which runs their code here" if model_api else ""
    return (
        f"token authorization is OFF and the {', '.join(exposed)} API listens beyond this"
        f" machine: anyone who reaches it can call it without a key{runs_code}; remove"
        " --disable-token-auth / disable_token_authorization to require keys"
    )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

"""Registration by URL: fetch an http(s) archive into the run dir, bounded and held to the
allow-list, then hand it to the same checks and safe extraction as any local archive.

Why a module of its own: a registration URL is input from the network. Every hop (redirects
included) must match ``allowed_urls`` unless the operator named the URL on the command line; the
body is streamed to a temp file beside its target and renamed into place, counted against
``download_max_bytes`` and hashed as it arrives; the wait for the upstream is bounded by
``download_timeout_s`` (connect, and between two reads) and ``download_total_timeout_s``. Each
download runs on a daemon thread of its own (``DOWNLOAD_THREADS`` at once), so a slow upstream
holds neither the event loop, nor the default executor that unpacking and environment builds
use, nor a stopping server.

The cache: ``<run_dir>/downloads/<key>/<sha256>.archive``, ``key`` from the URL as recorded
(credentials, query and fragment removed). A registration with a ``sha256`` pin whose file is
already there uses it without the network; so does a snapshot restore, which records the digest.
A registration without a pin always downloads (the upstream may have changed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from server.config import ServerConfig
from server.errors import (
    ArchiveNotAllowed,
    BadRequest,
    DigestMismatch,
    DownloadFailed,
    DownloadTimedOut,
    DownloadTooLarge,
    InternalError,
)

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

MAX_REDIRECTS = 10  # hops followed, each one checked against the allow-list
CHUNK_BYTES = 1 << 20
LOG_EVERY_S = 5.0  # progress lines in the log, at most this often per download
DOWNLOAD_THREADS = 4  # downloads at once; more wait their turn ("waiting to download")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".mar", ".zip")
_MB = 1_000_000


def is_remote(url: str) -> bool:
    """Whether ``url`` is fetched over the network (http or https)."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in ("http", "https")


def check_remote_url(url: str) -> None:
    """Refuse (400) an http(s) URL that cannot be fetched as written, naming the problem."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # out of range or not a number: ValueError
    except ValueError as exc:
        raise BadRequest(f"url {_scrubbed(url)!r} is not a valid URL: {exc}") from None
    if not parts.hostname:
        raise BadRequest(f"url {_scrubbed(url)!r} is not a valid URL: it names no host")


def _scrubbed(url: str) -> str:
    """A URL that would not parse, without what may be a password or a query secret."""
    return re.sub(r"//[^/@]*@", "//", url).split("?", 1)[0].split("#", 1)[0]


def _without_userinfo(url: str) -> tuple[str, str, str, str]:
    """(scheme, host[:port], path, query) of ``url``, user name and password left out."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port is not None else host
    return parts.scheme.lower(), netloc, parts.path, parts.query


def recorded_url(url: str) -> str:
    """``url`` as shown, logged and written to the snapshot: without user name, password, query
    or fragment, which may carry secrets (signed URLs keep theirs in the query)."""
    try:
        scheme, netloc, path, _ = _without_userinfo(url)
    except ValueError:  # it will not be fetched (check_remote_url); still never shown whole
        return _scrubbed(url)
    return urlunsplit((scheme, netloc, path, "", ""))


def url_allowed(url: str, patterns: tuple[str, ...]) -> bool:
    """TorchServe's rule: the whole URL must match one of the regular expressions, ignoring case.
    Unlike TorchServe, the URL is matched without its user name and password, so that
    ``http://trusted.host@elsewhere/`` cannot pass for ``http://trusted\\.host/.*``."""
    if is_remote(url):
        try:
            url = urlunsplit((*_without_userinfo(url), ""))
        except ValueError:
            return False
    return any(re.fullmatch(p, url, re.IGNORECASE) for p in patterns)


def relative_path_refusal(url: str) -> str | None:
    """TorchServe's refusal of a registration ``url`` holding ``..``, in its words ("Relative
    path is not allowed in url: ..."), or None. A ``..`` counts as a segment of the name or of
    a URL's path, as written or percent-decoded (an http server decodes ``%2e%2e`` and climbs
    with it); TorchServe refuses any ``..`` in the string, even inside a file name
    (``a..b.mar``), which names no other folder and passes here. A URL is shown as recorded
    (no credentials, no query)."""
    segments = url.split("/")  # a name or path in the model store
    if "://" in url:
        try:
            path = urlsplit(url).path
        except ValueError:
            return None  # not a URL at all: refused as such where it is read
        segments = [*path.split("/"), *unquote(path).split("/")]
    if ".." not in segments:
        return None
    return f"Relative path is not allowed in url: {recorded_url(url) if is_remote(url) else url}"


def provisional_name(url: str) -> str:
    """The name a download is listed under in describe until its manifest is read: the URL's
    file name without the archive suffix (the name TorchServe falls back to)."""
    name = unquote(urlsplit(url).path).rsplit("/", 1)[-1]
    for suffix in _ARCHIVE_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)] or "download"
    return name or "download"


def _megabytes(n: int) -> str:
    return f"{n / _MB:.1f}"


class Progress:
    """One download's state, written by its thread and read by describe on the event loop (plain
    attribute reads and writes of ints and strings, which need no lock)."""

    def __init__(self, name: str, url: str, at_startup: bool) -> None:
        self.name = name
        self.url = url
        self.at_startup = at_startup
        self.received = 0
        self.total: int | None = None
        self.stage = "waiting to download"
        self.cancelled = threading.Event()

    def received_bytes(self, n: int) -> None:
        self.received = n
        if self.total is not None:
            self.stage = f"downloading {_megabytes(n)} of {_megabytes(self.total)} MB"
        else:
            self.stage = f"downloading {_megabytes(n)} MB"

    def describe(self) -> dict[str, Any]:
        """The fields of a model's describe that mean something before its archive is read."""
        return {
            "modelName": self.name,
            "modelVersion": None,
            "modelUrl": self.url,
            "loadedAtStartup": self.at_startup,
            "status": "LOADING",
            "stage": self.stage,
            "downloadedBytes": self.received,
            "downloadTotalBytes": self.total,
            "workers": [],
        }


@dataclass(frozen=True)
class Downloaded:
    path: Path
    sha256: str
    url: str  # as recorded (see recorded_url)


class _Cancelled(Exception):
    """The registration waiting for this download went away (client left, server stopping)."""


class Downloader:
    """The registration downloads of one server: their threads, their progress, their cache."""

    def __init__(self, config: ServerConfig) -> None:
        self.folder = config.run_path / "downloads"
        self.patterns = config.allowed_urls
        self.max_bytes = config.download_max_bytes
        self.timeout_s = config.download_timeout_s
        self.total_timeout_s = config.download_total_timeout_s
        self._slots = threading.BoundedSemaphore(DOWNLOAD_THREADS)
        self._active: list[Progress] = []

    def check_allowed(self, url: str) -> None:
        """Refuse ``url`` (403) unless it matches ``allowed_urls``."""
        if url_allowed(url, self.patterns):
            return
        shown = recorded_url(url)
        if not self.patterns:
            raise ArchiveNotAllowed(
                f"Given URL {shown} does not match any allowed URL(s): allowed_urls is empty, so"
                " only archives in the model store and allowed_paths can be registered"
                " (TorchServe's default allows any URL: allowed_urls=file://.*|http(s)?://.*)"
            )
        raise ArchiveNotAllowed(
            f"Given URL {shown} does not match any allowed URL(s) (the allowed_urls patterns)"
        )

    def in_progress(self, name: str) -> list[dict[str, Any]]:
        """Describe entries of the downloads registering ``name``."""
        return [p.describe() for p in self._active if p.name == name]

    @contextlib.contextmanager
    def tracking(self, url: str, name: str | None, at_startup: bool) -> Iterator[Progress]:
        """List a registration in describe (under ``name``, or the URL's file name) while its
        archive downloads and unpacks."""
        check_remote_url(url)
        progress = Progress(name or provisional_name(url), recorded_url(url), at_startup)
        self._active.append(progress)
        try:
            yield progress
        finally:
            self._active.remove(progress)

    async def fetch(
        self, url: str, progress: Progress, *, sha256: str | None, trusted: bool
    ) -> Downloaded:
        """Download ``url`` (or take it from the cache, see the module's docstring). ``trusted``
        (the operator's ``--models``) lifts the allow-list; the scheme must still be http(s)."""
        if not trusted:
            self.check_allowed(url)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Downloaded] = loop.create_future()

        def settle(result: Downloaded | None, error: BaseException | None) -> None:
            if done.cancelled():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def run() -> None:
            result, error = None, None
            try:
                with self._slots:
                    result = self._fetch(url, sha256, trusted, progress)
            except BaseException as exc:  # handed to the awaiting registration, raised there
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(settle, result, error)

        # a daemon thread: a server stopping mid-download does not wait for a slow upstream
        threading.Thread(target=run, name=f"download {progress.name}", daemon=True).start()
        try:
            return await done
        except asyncio.CancelledError:
            progress.cancelled.set()  # the thread stops at its next chunk or timeout
            raise

    def discard(self, url: str, sha256: str) -> None:
        """Delete the cached download of ``url`` with this digest (its model was unregistered and
        no other registered model uses it), so that ``downloads/`` does not grow without end."""
        folder = self._folder(url)
        (folder / f"{sha256}.archive").unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other digests (or a download) still in it
            folder.rmdir()
        log.info("removed the cached download of %s (sha256 %s)", url, sha256)

    def close(self) -> None:
        """Stop every download: each thread ends at its next chunk or read timeout (or with the
        process: they are daemon threads)."""
        for progress in self._active:
            progress.cancelled.set()

    def _folder(self, recorded: str) -> Path:
        return self.folder / hashlib.sha256(recorded.encode()).hexdigest()[:32]

    # --- in the download thread ------------------------------------------------------------

    def _fetch(self, url: str, pin: str | None, trusted: bool, progress: Progress) -> Downloaded:
        shown = progress.url
        if progress.cancelled.is_set():  # gone while this waited for a download slot
            raise _Cancelled(shown)
        folder = self._folder(shown)
        if pin is not None:
            cached = folder / f"{pin}.archive"
            if cached.is_file():
                progress.stage = "checking the cached download"
                if _file_sha256(cached) == pin:
                    log.info("%s: using the cached download %s (sha256 %s)", shown, cached, pin)
                    return Downloaded(cached, pin, shown)
                log.warning("%s: cached download %s is damaged; downloading again", shown, cached)
        tmp = folder / f".download-{os.getpid()}-{secrets.token_hex(4)}"
        started = time.monotonic()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.glob(".download-*"):  # left by a server stopped mid-download
                if not stale.name.startswith(f".download-{os.getpid()}-"):
                    stale.unlink(missing_ok=True)
            digest, size = self._stream(url, tmp, trusted, progress)
            if pin is not None and digest != pin:
                raise DigestMismatch(
                    f"{shown}: the downloaded archive's sha256 is {digest}, the sha256 parameter"
                    f" asks for {pin}"
                )
            target = folder / f"{digest}.archive"
            os.replace(tmp, target)
        except OSError as exc:  # the run dir's disk, not the upstream
            raise InternalError(
                f"{shown}: cannot write the download into {folder}: {exc.strerror or exc}"
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)
        log.info(
            "downloaded %s: %s MB in %.1f s, sha256 %s",
            shown, _megabytes(size), time.monotonic() - started, digest,
        )  # fmt: skip
        progress.stage = "unpacking"
        return Downloaded(target, digest, shown)

    def _stream(self, url: str, tmp: Path, trusted: bool, progress: Progress) -> tuple[str, int]:
        """GET ``url`` following allowed redirects, body into ``tmp``: (sha256, size)."""
        import httpx  # only a server that downloads pays for the import

        shown = progress.url
        deadline = time.monotonic() + self.total_timeout_s
        timeout = httpx.Timeout(self.timeout_s)
        try:
            with httpx.Client(timeout=timeout, follow_redirects=False) as client:
                # identity: the bytes as stored, so that Content-Length and the digest are theirs
                request = client.build_request("GET", url, headers={"Accept-Encoding": "identity"})
                for _hop in range(MAX_REDIRECTS + 1):
                    progress.stage = "connecting"
                    response = client.send(request, stream=True)
                    try:
                        if response.next_request is None:
                            return self._body(response, tmp, progress, deadline)
                        request = response.next_request
                    finally:
                        response.close()
                    self._check_hop(shown, str(request.url), trusted)
                    log.info("%s: redirected to %s", shown, recorded_url(str(request.url)))
            raise DownloadFailed(f"{shown}: more than {MAX_REDIRECTS} redirects")
        except httpx.TimeoutException as exc:
            what = "connecting" if isinstance(exc, httpx.ConnectTimeout) else "waiting for data"
            raise DownloadTimedOut(
                f"{shown}: timed out {what} after {self.timeout_s:g} s (download_timeout_s)"
            ) from exc
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            raise BadRequest(f"{shown}: {exc}") from exc
        except httpx.HTTPError as exc:  # refused, reset, broken framing, DNS
            raise DownloadFailed(f"{shown}: download failed: {_cause(exc)}") from exc

    def _check_hop(self, shown: str, target: str, trusted: bool) -> None:
        if urlsplit(target).scheme.lower() not in ("http", "https"):
            raise ArchiveNotAllowed(
                f"{shown} redirected to {recorded_url(target)}: only http and https are followed"
            )
        if not trusted and not url_allowed(target, self.patterns):
            raise ArchiveNotAllowed(
                f"{shown} redirected to {recorded_url(target)}, which does not match any allowed"
                " URL(s) (the allowed_urls patterns)"
            )

    def _body(
        self, response: httpx.Response, tmp: Path, progress: Progress, deadline: float
    ) -> tuple[str, int]:
        shown = progress.url
        if response.status_code >= 400 or response.status_code < 200:
            raise DownloadFailed(
                f"{shown}: the server answered {response.status_code}"
                f" {response.reason_phrase}".rstrip()
            )
        length = response.headers.get("Content-Length")
        if length is not None and length.isdigit():
            progress.total = int(length)
            if progress.total > self.max_bytes:
                raise DownloadTooLarge(
                    f"{shown}: the archive is {progress.total} bytes, over download_max_bytes"
                    f" ({self.max_bytes})"
                )
        progress.received_bytes(0)
        log.info("downloading %s (%s)", shown, _size_text(progress.total))
        digest = hashlib.sha256()
        size = 0
        last_log = time.monotonic()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as sink:
            for chunk in response.iter_raw():  # as the network delivers (64 KiB reads)
                if progress.cancelled.is_set():
                    raise _Cancelled(shown)
                size += len(chunk)
                if size > self.max_bytes:
                    raise DownloadTooLarge(
                        f"{shown}: the archive is over download_max_bytes ({self.max_bytes}"
                        " bytes); stopped there"
                    )
                digest.update(chunk)
                sink.write(chunk)
                progress.received_bytes(size)
                now = time.monotonic()
                if now > deadline:
                    raise DownloadTimedOut(
                        f"{shown}: not finished after {self.total_timeout_s:g} s"
                        f" (download_total_timeout_s); {_megabytes(size)} MB received"
                    )
                if now - last_log >= LOG_EVERY_S:
                    last_log = now
                    log.info("%s: %s", shown, progress.stage)
        if progress.total is not None and size != progress.total:
            raise DownloadFailed(
                f"{shown}: the server sent {size} of the {progress.total} bytes it announced"
            )
        return digest.hexdigest(), size


def _size_text(total: int | None) -> str:
    return f"{_megabytes(total)} MB" if total is not None else "size not announced"


def _cause(exc: httpx.HTTPError) -> str:
    """What went wrong (``[Errno 111] Connection refused``); the class name when httpx gives no
    text."""
    return str(exc) or type(exc).__name__


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def parse_sha256(raw: str | None) -> str | None:
    """The ``sha256`` registration parameter: 64 hex digits (any case), or None."""
    if raw is None or raw == "":
        return None
    value = raw.strip().lower()
    if not SHA256_HEX.fullmatch(value):
        raise BadRequest(
            f"parameter 'sha256' should be 64 hex digits (a SHA-256 digest), found {raw!r}"
        )
    return value

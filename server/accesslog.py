"""access.log: one line per request, in mserve's layout (text or JSON) or TorchServe's
(server/linefile.py buffers the lines)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from server.linefile import ISO_SECONDS, LineFile

# A prediction's facts (server/http/request.py Request.tag): request id, trace id, model,
# version, worker id
Tag = tuple[str, str, str, str, str]


class AccessLogFile(LineFile):
    def __init__(
        self, path: Path, max_lines: int = 512, torchserve: bool = False, json_lines: bool = False
    ) -> None:
        """``torchserve``: TorchServe's access_log.log line, ``<time> - /client "POST /p
        HTTP/1.1" 200 12`` (the last number: milliseconds). ``json_lines``: one JSON object per
        line (``log_format: json``), for log shippers."""
        super().__init__(path, max_lines, ISO_SECONDS if torchserve else "%Y-%m-%d %H:%M:%S")
        self._torchserve = torchserve
        self._json = json_lines and not torchserve

    def add_line(
        self, remote: str, method: str, target: str, version: str, status: int, length: int,
        elapsed_s: float, tag: Tag | None = None, tenant: str | None = None,
    ) -> None:  # fmt: skip
        """``tag``: a prediction's ids (the text line ends with its request and trace ids,
        ``-`` where there is none). ``tenant``: who sent it, while the server has tenants
        (server/tenants/): the text line's last field then."""
        if self._torchserve:
            self.append(
                f"{self.stamp()} - /{remote} "
                f'"{method} {target} HTTP/{version}" {status} {int(elapsed_s * 1000)}\n'
            )
        elif self._json:
            self.append(
                json_line(remote, method, target, version, status, length, elapsed_s, tag, tenant)
            )
        else:
            ids = f" {tag[0]} {tag[1] or '-'}" if tag is not None else " - -"
            if tenant is not None:
                ids += f" {tenant}"
            self.append(
                f"{self.stamp()} {remote} "
                f'"{method} {target} HTTP/{version}" {status} {length} {elapsed_s:.6f}{ids}\n'
            )


def json_line(
    remote: str, method: str, target: str, version: str, status: int, length: int,
    elapsed_s: float, tag: Tag | None, tenant: str | None = None,
) -> str:  # fmt: skip
    record = {
        "time": _iso_now(),
        "level": "INFO",
        "logger": "access",
        "remote": remote,
        "method": method,
        "path": target,
        "protocol": f"HTTP/{version}",
        "status": status,
        "bytes": length,
        "latency_ms": round(elapsed_s * 1000, 3),
    }
    if tag is not None:
        request_id, trace_id, model, model_version, worker = tag
        record["request_id"] = request_id
        if trace_id:
            record["trace_id"] = trace_id
        record["model"] = model
        record["version"] = model_version
        if worker:
            record["worker"] = worker
    if tenant is not None:
        record["tenant"] = tenant
    return json.dumps(record, ensure_ascii=False) + "\n"


def _iso_now() -> str:
    """Now in ISO 8601 with milliseconds and the UTC offset, as log shippers parse it."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now))
    zone = time.strftime("%z", time.localtime(now))
    return f"{stamp}.{int((now % 1) * 1000):03d}{zone[:3]}:{zone[3:]}"

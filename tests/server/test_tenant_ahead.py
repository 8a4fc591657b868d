"""A tenant's request that comes while another tenant's batches wait in the worker runs before
them (docs/tenants.md, "Fair queuing"): the server sends it ahead, the worker runs it once its
current batch ends and says so (STARTED), and every answer still reaches its own caller; a
worker lost while it runs that batch fails that batch's callers only, the batches it passed
never ran and are served by its replacement.

Real servers with a tenants file, one worker, batches of 2 taking 0.5 s each (the handler
answers with the number of the batch it ran in; a request "crash" ends its process)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server.tenants import key_hash
from tests.server.conftest import Server, http, wait_until

KEYS = {name: f"key-of-{name}-0123456789" for name in ("noisy", "quiet")}
NOISY = 16  # 8 batches of 2: 4 sent to the worker at once (a lone tenant's depth), 4 queued


def start(tmp_path: Path, make_archive: Callable[..., Path],
          start_server: Callable[..., Server]) -> Server:  # fmt: skip
    (tmp_path / "ordered.yaml").write_text(
        "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 2\nmaxBatchDelay: 50\n"
    )
    make_archive("ordered", "ordered:handle", "ordered", "-c", str(tmp_path / "ordered.yaml"))
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n" + "".join(
        f"  {name}:\n    keys: [sha256:{key_hash(key)}]\n" for name, key in KEYS.items()
    ))  # fmt: skip
    return start_server("ordered=ordered.mar", config={
        "disable_token_authorization": False, "tenants_file": str(tenants)})  # fmt: skip


def served(server: Server, tenant: str) -> float:
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    found = re.search(
        rf'^mserve_tenant_requests_served_total\{{model="ordered",tenant="{tenant}"\}} (\S+)$',
        text, re.M,
    )  # fmt: skip
    return float(found.group(1)) if found else 0.0


def quiet_beside_noisy(server: Server, quiet_body: str) -> dict[str, tuple[int, Any]]:
    """The noisy tenant's NOISY requests at once; once four of its batches are in the worker,
    one request of the quiet tenant. Every answer by body: (status, JSON or raw body)."""
    answers: dict[str, tuple[int, Any]] = {}

    def ask(tenant: str, body: str) -> None:
        reply = http("POST", server.url("inference", "/predictions/ordered"), body.encode(),
                     {"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "text/plain"})  # fmt: skip
        answers[body] = (
            reply.status,
            json.loads(reply.body) if reply.status == 200 else reply.body,
        )

    threads = [threading.Thread(target=ask, args=("noisy", f"n{i}")) for i in range(NOISY)]
    for thread in threads:
        thread.start()
    # the worker runs the first batch and holds three more; the other eight requests wait here
    wait_until(lambda: served(server, "noisy") >= 8, 30, "four batches sent to the worker")
    ask("quiet", quiet_body)
    for thread in threads:
        thread.join(60)
    return answers


def test_a_quiet_tenants_request_runs_before_the_batches_the_worker_holds(
    tmp_path: Path, make_archive: Callable[..., Path], start_server: Callable[..., Server]
) -> None:
    answers = quiet_beside_noisy(start(tmp_path, make_archive, start_server), "q")
    assert all(status == 200 for status, _ in answers.values()), answers
    assert all(answer["body"] == body for body, (_, answer) in answers.items())  # its own
    ran = {body: answer["batch"] for body, (_, answer) in answers.items()}
    # in arrival order it would have run fifth, behind the four batches sent before it came;
    # it runs when the batch running then ends (third at worst, if that one ended before it came)
    assert ran["q"] <= 3, sorted(ran.items(), key=lambda kv: kv[1])
    noisy = [ran[f"n{i}"] for i in range(NOISY)]
    assert ran["q"] not in noisy  # a batch of its own
    # the noisy batches it passed still ran, each once: batches of at most two, numbered on
    # from 1 with none missing (an answer matched to the wrong batch would break this)
    assert max(noisy.count(n) for n in noisy) <= 2
    assert sorted({*noisy, ran["q"]}) == list(range(1, max(noisy) + 1))


def test_a_worker_lost_in_a_batch_sent_ahead_fails_that_batch_only(
    tmp_path: Path, make_archive: Callable[..., Path], start_server: Callable[..., Server]
) -> None:
    """The batch sent ahead is the one running when its worker dies (the worker said STARTED):
    its caller gets the worker's death; the noisy batches it passed, which never ran, go back to
    the queue and are all answered by the replacement worker."""
    answers = quiet_beside_noisy(start(tmp_path, make_archive, start_server), "crash")
    status, body = answers.pop("crash")
    assert status == 500, (status, body)
    assert b"died" in body or b"exited" in body, body
    assert {status for status, _ in answers.values()} == {200}, answers
    assert all(answer["body"] == body for body, (_, answer) in answers.items())

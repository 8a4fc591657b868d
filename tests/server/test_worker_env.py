"""Workers do not get the server's secrets: the worker_env_deny list, the model config's
allowedEnvVars, mserve's own variables, exec'd and forked workers and their template."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
from pathlib import Path

import psutil
import pytest

from server.config import DEFAULT_DENY
from server.workers.env_vars import WorkerEnvironment, hide_own_environ
from tests.server.conftest import HANDLERS, Server, template_ready, wait_until

OPEN = {"disable_token_authorization": True, "enable_model_api": True}
SECRETS = {
    "MY_API_TOKEN": "s3cret-token",
    "HF_TOKEN": "hf-s3cret",
    "DB_PASSWORD": "pw-s3cret",
    "AWS_SECRET_ACCESS_KEY": "aws-s3cret",
    "TS_SOMETHING": "ts-s3cret",
    "MSERVE_ACCESS_LOG": "true",  # one of mserve's own settings (a valid one: the server reads it)
    "PLAIN": "1",
    "TOKENIZERS_PARALLELISM": "false",  # not a secret, though it has TOKEN in it
}


def test_the_deny_list_matches_names_as_globs_without_regard_to_case() -> None:
    env = WorkerEnvironment.split(
        {"hf_token": "a", "X_Secret_Y": "b", "PATH": "/bin", "MSERVE_KEY_FILE": "k",
         "TOKENIZERS_PARALLELISM": "false", "SSH_AUTH_SOCK": "s", "AWS_REGION": "r"},
        DEFAULT_DENY, deny_regex="AWS_.*",
    )  # fmt: skip
    assert sorted(env.base) == ["PATH", "TOKENIZERS_PARALLELISM"]
    assert sorted(env.withheld) == [
        "AWS_REGION", "MSERVE_KEY_FILE", "SSH_AUTH_SOCK", "X_Secret_Y", "hf_token"
    ]  # fmt: skip
    # allowed by exact name; mserve's own never; names not withheld add nothing
    assert env.for_model(["hf_token", "MSERVE_KEY_FILE", "PATH", "HF_TOKEN"], "m:1") == {
        "hf_token": "a"
    }
    # the regex must match the whole name, as TorchServe's does
    assert "XAWS_REGION" in WorkerEnvironment.split({"XAWS_REGION": "r"}, (), "AWS_.*").base


def _environ_of(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode("latin-1")


def _check(server: Server, model: str, allowed: bool) -> dict:
    reply = server.predict(model, {})
    assert reply.status == 200, reply.body
    report = reply.json()
    names = set(report["names"])
    expect_absent = {"MY_API_TOKEN", "DB_PASSWORD", "AWS_SECRET_ACCESS_KEY", "TS_SOMETHING",
                     "MSERVE_ACCESS_LOG"}  # fmt: skip
    assert not names & expect_absent, names & expect_absent
    assert {"PLAIN", "TOKENIZERS_PARALLELISM", "PATH"} <= names
    assert report["values"]["PLAIN"] == "1"
    assert report["values"]["HF_TOKEN"] == ("hf-s3cret" if allowed else None)
    return report


@pytest.fixture
def archives(make_archive) -> None:
    make_archive("env_probe", "env_probe:handle", "plain")
    make_archive("env_probe", "env_probe:handle", "allowed",
                 "--config-file", str(HANDLERS / "env_probe" / "allow_hf_token.yaml"))  # fmt: skip


def test_exec_workers_get_neither_secrets_nor_mserve_settings(archives, start_server) -> None:
    server = start_server(
        "plain=plain.mar", "allowed=allowed.mar",
        config={**OPEN, "fork_workers": False}, env=SECRETS,
    )  # fmt: skip
    plain = _check(server, "plain", allowed=False)
    allowed = _check(server, "allowed", allowed=True)
    # what the kernel holds for each worker (its /proc/<pid>/environ) has none of it either
    for report in (plain, allowed):
        environ = _environ_of(report["pid"])
        assert "s3cret" not in environ.replace("hf-s3cret", "") and "PLAIN=1" in environ
    assert "HF_TOKEN=hf-s3cret" in _environ_of(allowed["pid"])
    assert "HF_TOKEN" not in _environ_of(plain["pid"])
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert (
        "workers do not get 6 of the server's environment variables (worker_env_deny):"
        " AWS_SECRET_ACCESS_KEY, DB_PASSWORD, HF_TOKEN, MSERVE_ACCESS_LOG, MY_API_TOKEN,"
        " TS_SOMETHING"
    ) in log
    assert "model allowed:1.0 gets HF_TOKEN from the server's environment (allowedEnvVars)" in log
    assert (
        "model allowed:1.0: allowedEnvVars names MSERVE_ACCESS_LOG; mserve's own variables"
        " never reach workers"
    ) in log
    assert "s3cret" not in log  # names are logged, never values


def test_forked_workers_and_their_template_get_none_of_them(archives, start_server) -> None:
    server = start_server(
        "plain=plain.mar", "allowed=allowed.mar",
        config={**OPEN, "worker_preload": []}, env=SECRETS,
    )  # fmt: skip
    wait_until(lambda: template_ready(server), 120, "the worker template")
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    template = int(re.search(r"worker template for .* ready \(pid (\d+)", log).group(1))
    environ = _environ_of(template)
    assert "s3cret" not in environ and "MSERVE_" not in environ and "PLAIN=1" in environ
    for model in ("plain", "allowed"):
        # the first worker was exec'd while the template warmed up: a replacement is forked
        first = server.worker_pids(model)[0]
        os.kill(first, signal.SIGKILL)
        wait_until(
            lambda m=model, f=first: server.worker_pids(m) not in ([f], [None], [])
            and server.predict(m, {}).status == 200, 30, f"a forked worker for {model}",
        )  # fmt: skip
        [pid] = server.worker_pids(model)
        assert psutil.Process(pid).ppid() == template
        report = _check(server, model, allowed=model == "allowed")
        assert report["pid"] == pid


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every process's /proc/<pid>/environ")
def test_a_worker_cannot_read_the_servers_environ(archives, start_server) -> None:
    """/proc/<server>/environ holds what the server was started with; the server makes itself
    non-dumpable, so a worker running as the same user cannot read it."""
    server = start_server("plain=plain.mar", config={**OPEN, "fork_workers": False}, env=SECRETS)
    report = server.predict("plain", {"read_environ_of": server.pid}).json()
    assert "read" not in report and report["read_error"] == "Permission denied"


def _sibling_reads_environ(hide: bool) -> bool:
    """In a child running as nobody (after hide_own_environ() when ``hide``), whether its own
    child, the same user, can read the first one's /proc/<pid>/environ."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 2
        try:
            os.setgid(65534)
            os.setuid(65534)
            # changing user made it non-dumpable: dumpable again, as a process that user started
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
            if hide:
                hide_own_environ()
            target = os.getpid()
            reader = os.fork()
            if reader == 0:
                try:
                    Path(f"/proc/{target}/environ").read_bytes()
                    os.write(write_end, b"1")
                except OSError:
                    os.write(write_end, b"0")
                os._exit(0)
            os.waitpid(reader, 0)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as f:
        return f.read() == b"1"


@pytest.mark.skipif(os.geteuid() != 0 or not sys.platform.startswith("linux"),
                    reason="needs root to become another user (and Linux)")  # fmt: skip
def test_hide_own_environ_keeps_same_user_processes_out() -> None:
    """What the test above checks through a server, where it cannot run: as root. Another
    process of the same (unprivileged) user reads /proc/<pid>/environ, unless it was hidden."""
    assert _sibling_reads_environ(hide=False)
    assert not _sibling_reads_environ(hide=True)

"""Server config precedence and errors (pure parsing, no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.config import load_config
from server.errors import ConfigError


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("job_queue_size: 10\nbatch_size: 2\nmax_batch_delay_ms: 7\n")
    env = {"MSERVE_JOB_QUEUE_SIZE": "20", "MSERVE_BATCH_SIZE": "3"}
    config = load_config(cfg, {"batch_size": 4}, env)
    assert config.max_batch_delay_ms == 7  # file over default
    assert config.job_queue_size == 20  # env over file
    assert config.batch_size == 4  # flag over env
    assert config.response_timeout_s == 120.0  # default
    assert config.inference_address == "127.0.0.1:8080"
    assert config.management_address.startswith("127.0.0.1:")


def test_config_file_from_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("allowed_paths: [/srv/models, /data]\n")
    config = load_config(None, {}, {"MSERVE_CONFIG": str(cfg), "MSERVE_ACCESS_LOG": "off"})
    assert config.allowed_paths == ("/srv/models", "/data")
    assert config.access_log is False


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("jobqueue: 1\n", {}, "unknown key 'jobqueue'"),
        ("", {"MSERVE_JOB_QUEUE": "1"}, "environment (MSERVE_*): unknown key 'MSERVE_JOB_QUEUE'"),
        ("batch_size: many\n", {}, "'batch_size' should be a positive integer, found 'many'"),
        ("response_timeout_s: 0\n", {}, "'response_timeout_s' should be a positive finite number"),
        ("batch_size: 0\n", {}, "'batch_size' should be a positive integer, found 0"),
        (
            "",
            {"MSERVE_JOB_QUEUE_SIZE": "0"},
            "'job_queue_size' should be a positive integer, found '0'",
        ),
        (
            "max_request_size_bytes: 0\n",
            {},
            "'max_request_size_bytes' should be a positive integer",
        ),
        (
            "max_response_size_bytes: 0\n",
            {},
            "'max_response_size_bytes' should be a positive integer",
        ),
        ("max_connections: 0\n", {}, "'max_connections' should be a positive integer, found 0"),
        (
            "default_workers_per_model: -1\n",
            {},
            "'default_workers_per_model' should be a non-negative integer, found -1",
        ),
        ("max_batch_delay_ms: -5\n", {}, "'max_batch_delay_ms' should be a non-negative integer"),
        ("batch_wait: often\n", {}, "'batch_wait' should be one of busy, fill, found 'often'"),
        (
            "startup_timeout_s: -1\n",
            {},
            "'startup_timeout_s' should be a positive finite number, found -1",
        ),
        (
            "",
            {"MSERVE_READ_TIMEOUT_S": "nan"},
            "'read_timeout_s' should be a positive finite number, found 'nan'",
        ),
        (
            "keepalive_timeout_s: .inf\n",
            {},
            "'keepalive_timeout_s' should be a positive finite number, found inf",
        ),
        ("job_queue_size: .inf\n", {}, "'job_queue_size' should be a positive integer, found inf"),
        (
            "inference_address: localhost:http\n",
            {},
            "inference_address: 'localhost:http' is not host:port",
        ),
        ("metrics_address: 127.0.0.1:70000\n", {}, "port 70000 is out of range"),
        ("- a\n", {}, "expected a mapping of keys"),
        ("access_log: maybe\n", {}, "'access_log' should be true or false, found 'maybe'"),
        ("allowed_paths: 5\n", {}, "'allowed_paths' should be a list, found 5"),
        ("a: [\n", {}, "is not valid YAML"),
        (
            "worker_env_deny_regex: 'AWS_('\n",
            {},
            "worker_env_deny_regex: 'AWS_(' is not a valid regular expression: missing ),"
            " unterminated subpattern at position 4",
        ),
        ("worker_env_deny: 5\n", {}, "'worker_env_deny' should be a list, found 5"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, text: str, env: dict, message: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(cfg, {}, env)
    assert message in info.value.message


def test_worker_env_deny_from_yaml_and_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("worker_env_deny: ['*_TOKEN', 'AWS_*']\n")
    assert load_config(cfg, {}, {}).worker_env_deny == ("*_TOKEN", "AWS_*")
    config = load_config(None, {}, {"MSERVE_WORKER_ENV_DENY": "*_KEY, DB_*"})
    assert config.worker_env_deny == ("*_KEY", "DB_*")
    assert "*SECRET*" in load_config(None, {}, {}).worker_env_deny  # the default


def test_zero_is_allowed_where_it_means_something() -> None:
    config = load_config(None, {"default_workers_per_model": 0, "max_batch_delay_ms": 0,
                                "number_of_gpu": 0}, {})  # fmt: skip
    assert (config.default_workers_per_model, config.max_batch_delay_ms) == (0, 0)
    assert config.number_of_gpu == 0

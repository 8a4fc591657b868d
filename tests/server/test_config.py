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
        ("batch_size: many\n", {}, "'batch_size' should be a non-negative integer, found 'many'"),
        ("response_timeout_s: 0\n", {}, "'response_timeout_s' should be a positive number"),
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
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, text: str, env: dict, message: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(cfg, {}, env)
    assert message in info.value.message

"""TorchServe's config.properties: Java's properties syntax, each key's mapping, TS_ variables,
and where the file sits among the config layers (pure parsing, no server needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server.config import ServerConfig, load_config
from server.errors import ConfigError
from server.ts_config import load_ts_config, newest_snapshot, parse_properties


def values(text: str) -> dict[str, str]:
    return {k: p.value for k, p in parse_properties(text, Path("c.properties")).items()}


def config_from(tmp_path: Path, text: str, env: dict[str, str] | None = None, **kw):  # type: ignore[no-untyped-def]
    path = tmp_path / "config.properties"
    path.write_text(text)
    ts = load_ts_config(path, env or {})
    return load_config(kw.get("yaml"), kw.get("flags"), env or {}, ts_layers=list(ts.layers)), ts


def test_java_separators_comments_and_whitespace() -> None:
    text = (
        "# a comment\n"
        "  ! another comment\n"
        "\n"
        "a=1\n"
        "b: 2\n"
        "c 3\n"
        "  d  =  spaced value  \n"
        "e\n"
        "f=x=y:z\n"
        "a=again\n"
    )
    assert values(text) == {
        "a": "again",  # the last of a repeated key wins
        "b": "2",
        "c": "3",
        "d": "spaced value  ",  # leading whitespace of the value goes, trailing stays
        "e": "",
        "f": "x=y:z",
    }


def test_continuation_lines_and_their_edges() -> None:
    text = (
        "models={\\\n"
        '    "m": 1\\\n'
        "}\n"
        "# a comment ending in a backslash does not continue \\\n"
        "after=comment\n"
        "even=two\\\\\n"
        "next=line\n"
        "hash=a\\\n"
        "  #not a comment\n"
        "blank=a\\\n"
        "\n"
        "last=tail\\"
    )
    assert values(text) == {
        "models": '{"m": 1}',
        "after": "comment",
        "even": "two\\",  # an even number of backslashes does not continue the line
        "next": "line",
        "hash": "a#not a comment",
        "blank": "a",
        "last": "tail",
    }


def test_escapes_in_keys_and_values() -> None:
    text = "key\\ with\\=odd\\:chars=v\nesc=tab\\there\\nnew\\\\back\\q\\u00e9\\u0041\n"
    assert values(text) == {"key with=odd:chars": "v", "esc": "tab\there\nnew\\backqéA"}


def test_crlf_and_cr_line_ends() -> None:
    assert values("a=1\r\nb=2\rc=3") == {"a": "1", "b": "2", "c": "3"}


def test_malformed_unicode_escape_names_file_and_line() -> None:
    with pytest.raises(ConfigError, match=r"c.properties line 3: malformed \\uxxxx escape"):
        values("a=1\n\nb=bad\\u12g4\n")


def test_line_numbers_point_at_the_start_of_a_continued_value(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text("# header\nmodel_store=/srv\njob_queue_size=1\\\n  0x\n")
    ts = load_ts_config(path, {})
    with pytest.raises(ConfigError) as err:
        load_config(None, {}, {}, ts_layers=list(ts.layers))
    assert str(err.value) == (
        f"{path} line 3 (job_queue_size): 'job_queue_size' should be a positive integer,"
        " found '10x'"
    )


def test_keys_map_onto_the_server_config(tmp_path: Path) -> None:
    config, ts = config_from(
        tmp_path,
        "inference_address=http://0.0.0.0:8085\n"
        "management_address=http://127.0.0.1:9081\n"
        "metrics_address=http://localhost\n"
        "model_store=/srv/models\n"
        "load_models=a.mar, b=b.mar\n"
        "default_workers_per_model=3\n"
        "default_response_timeout=30\n"
        "default_startup_timeout=45\n"
        "job_queue_size=12\n"
        "number_of_gpu=0\n"
        "max_request_size=1000\n"
        "max_response_size=2000\n"
        "install_py_dep_per_model=false\n"
        "allowed_urls=https://s3.amazonaws.com/.*,file:///srv/.*\n"
        "disable_token_authorization=true\n"
        "enable_model_api=TRUE\n"
        "certificate_file=cert.pem\n"
        "private_key_file=key.pem\n"
        "metrics_mode=Log\n"
        "metrics_config=metrics.yaml\n",
    )
    assert config.inference_address == "0.0.0.0:8085"
    assert config.management_address == "127.0.0.1:9081"
    assert config.metrics_address == "localhost:80"  # TorchServe's port for a bare http host
    assert config.model_store == "/srv/models"
    assert config.load_models == ("a.mar", "b=b.mar")
    assert config.default_workers_per_model == 3
    assert config.response_timeout_s == 30.0
    assert config.startup_timeout_s == 45.0
    assert config.job_queue_size == 12
    assert config.number_of_gpu == 0
    assert config.max_request_size_bytes == 1000
    assert config.max_response_size_bytes == 2000
    assert config.install_py_dep_per_model is False
    assert config.allowed_urls == ("https://s3.amazonaws.com/.*", "file:///srv/.*")
    assert config.disable_token_authorization is True
    assert config.enable_model_api is True
    assert (config.certificate_file, config.private_key_file) == ("cert.pem", "key.pem")
    assert (config.metrics_mode, config.metrics_config) == ("log", "metrics.yaml")
    assert ts.warnings() == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [("load_models=standalone\n", ()), ("load_models=ALL\n", ("all",))],
)
def test_load_models_keywords(tmp_path: Path, text: str, expected: tuple[str, ...]) -> None:
    assert config_from(tmp_path, text)[0].load_models == expected


def test_torchserves_default_for_installing_requirements(tmp_path: Path) -> None:
    """TorchServe installs a model's requirements only when told to: a file that does not say
    so keeps that default here too (mserve's own default is true)."""
    assert config_from(tmp_path, "job_queue_size=1\n")[0].install_py_dep_per_model is False
    assert config_from(tmp_path, "install_py_dep_per_model=true\n")[0].install_py_dep_per_model
    assert load_config(None, {}, {}).install_py_dep_per_model is True


def test_default_workers_zero_means_the_servers_default(tmp_path: Path) -> None:
    assert config_from(tmp_path, "default_workers_per_model=0\n")[0].default_workers_per_model == 1


def test_models_json_per_version(tmp_path: Path) -> None:
    config, _ = config_from(
        tmp_path,
        "models={\\\n"
        '  "noop": {\\\n'
        '    "1.0": {"defaultVersion": true, "marName": "noop.mar", "minWorkers": 2,\\\n'
        '            "maxWorkers": 4, "batchSize": 8, "maxBatchDelay": 0,\\\n'
        '            "responseTimeout": 60, "somethingNew": 1}\\\n'
        "  }\\\n"
        "}\n",
    )
    entry = config.model_entry("noop", "1.0")
    assert entry is not None
    assert dict(entry.settings) == {
        "minWorkers": 2,
        "maxWorkers": 4,
        "batchSize": 8,
        "responseTimeout": 60,
    }  # fmt: skip  (maxBatchDelay 0 means "not set", as TorchServe reads it)
    assert (entry.default_version, entry.mar_name) == (True, "noop.mar")
    assert config.model_entry("noop", "2.0") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models={oops\n", "'models' is not valid JSON"),
        ('models={"m": {"1.0": {"batchSize": "x"}}}\n', "m 1.0 batchSize should be an integer"),
        ('models={"m": [1]}\n', "model 'm' should map versions to settings"),
        (
            'models={"m": {"1.0": {"batchWait": "wait"}}}\n',
            "m 1.0 batchWait should be one of busy, fill, found 'wait'",
        ),
        ('models={"m": {"1.0": {"defaultVersion": 1}}}\n', "defaultVersion should be true"),
        ('model_snapshot={"models": {"m": {"1.0": {}}}}\n', "m 1.0 has no marName"),
        ("job_queue_size=many\n", "'job_queue_size' should be a positive integer"),
        ("enable_model_api=yes\n", "enable_model_api should be true or false, found 'yes'"),
        ("max_request_size=0\n", "'max_request_size_bytes' should be a positive integer"),
    ],
)
def test_bad_values_name_file_line_and_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"config.properties line 1.*{re.escape(message)}"):
        config_from(tmp_path, text)


def test_https_addresses_need_the_certificate_keys_and_unix_ones_are_refused(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as err:
        config_from(tmp_path, "\ninference_address=https://0.0.0.0:8443\n")
    assert str(err.value) == (
        "inference_address is https://0.0.0.0:8443: serving https needs certificate_file and"
        " private_key_file (PEM files)"
    )
    config, _ = config_from(tmp_path, (
        "inference_address=https://127.0.0.1:8443\nmanagement_address=https://localhost\n"
        "certificate_file=/etc/ts/cert.pem\nprivate_key_file=/etc/ts/key.pem\n"
    ))  # fmt: skip
    assert config.inference_address == "https://127.0.0.1:8443"
    assert config.management_address == "https://localhost:443"  # TorchServe's default port
    assert (config.certificate_file, config.private_key_file) == (
        "/etc/ts/cert.pem", "/etc/ts/key.pem"
    )  # fmt: skip
    with pytest.raises(ConfigError, match="unix socket addresses are not supported"):
        config_from(tmp_path, "management_address=unix:/tmp/ts.sock\n")


def test_token_and_model_api_keys(tmp_path: Path) -> None:
    config, ts = config_from(tmp_path, "token_expiration_min=30\nmodel_api_enabled=true\n")
    assert (config.token_expiration_min, config.enable_model_api) == (30.0, True)
    assert ts.warnings() == []
    defaults, _ = config_from(tmp_path, "")
    assert (defaults.disable_token_authorization, defaults.enable_model_api) == (False, False)
    env = {"TS_DISABLE_TOKEN_AUTHORIZATION": "true", "TS_TOKEN_EXPIRATION_TIME_MIN": "5"}
    config, _ = config_from(tmp_path, "enable_envvars_config=true\n", env)
    assert (config.disable_token_authorization, config.token_expiration_min) == (True, 5.0)


def test_grpc_hosts_and_ports_map_onto_our_addresses(tmp_path: Path) -> None:
    """TorchServe's gRPC APIs: a host key and a port key each; ours one host:port each."""
    config, ts = config_from(tmp_path, (
        "grpc_inference_address=0.0.0.0\ngrpc_inference_port=9070\ngrpc_management_port=9071\n"
        "grpc_inference_max_connection_age_ms=60000\n"
    ))  # fmt: skip
    assert (config.grpc_inference_address, config.grpc_management_address) == (
        "0.0.0.0:9070", "127.0.0.1:9071"
    )  # fmt: skip
    assert ts.no_effect == ("grpc_inference_max_connection_age_ms",)
    defaults, _ = config_from(tmp_path, "")
    assert (defaults.grpc, defaults.grpc_inference_address, defaults.grpc_management_address) == (
        True, "127.0.0.1:7070", "127.0.0.1:7071"
    )  # fmt: skip
    ipv6, _ = config_from(tmp_path, "grpc_management_address=::1\n")
    assert ipv6.grpc_management_address == "[::1]:7071"
    with pytest.raises(ConfigError, match="TorchServe's gRPC address is a host, no scheme"):
        config_from(tmp_path, "grpc_inference_address=http://0.0.0.0\n")
    with pytest.raises(ConfigError) as err:
        config_from(tmp_path, "enable_grpc_ssl=true\n")
    assert str(err.value) == (
        "enable_grpc_ssl is true (or a grpc_*_address is https://): serving gRPC over TLS needs"
        " certificate_file and private_key_file (PEM files)"
    )
    tls, _ = config_from(tmp_path, (
        "enable_grpc_ssl=true\ncertificate_file=/etc/ts/cert.pem\nprivate_key_file=/etc/ts/key.pem\n"
    ))  # fmt: skip
    assert tls.enable_grpc_ssl
    env = {"TS_GRPC_MANAGEMENT_PORT": "9171"}
    config, _ = config_from(tmp_path, "enable_envvars_config=true\n", env)
    assert config.grpc_management_address == "127.0.0.1:9171"


def test_one_port_for_two_apis_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="inference_address and management_address are both"):
        config_from(
            tmp_path,
            "inference_address=http://0.0.0.0:8080\nmanagement_address=http://0.0.0.0:8080\n",
        )


def test_blacklist_env_vars_becomes_the_worker_env_deny_regex(tmp_path: Path) -> None:
    """TorchServe's regular expression is kept whole (Java and Python read the usual ones
    alike), on top of the deny-list; empty means none; a broken one names the line."""
    config, _ = config_from(tmp_path, "blacklist_env_vars=AWS_.*|.*_KEY\n")
    assert config.worker_env_deny_regex == "AWS_.*|.*_KEY"
    assert config.worker_env_deny == ServerConfig().worker_env_deny
    assert config_from(tmp_path, "blacklist_env_vars=\n")[0].worker_env_deny_regex is None
    with pytest.raises(ConfigError) as caught:
        config_from(tmp_path, "# comment\nblacklist_env_vars=AWS_(\n")
    assert str(caught.value).endswith(
        "line 2: blacklist_env_vars=AWS_( is not a valid regular expression:"
        " missing ), unterminated subpattern at position 4"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("decode_input_request=false\n", "mserve always decodes JSON and text bodies"),
    ],
)
def test_keys_that_would_be_silently_wrong_are_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    expected = f"line 1: {text.strip()} is not supported: {message}"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        config_from(tmp_path, text)
    key = text.split("=")[0]
    default = "true" if key == "decode_input_request" else ""
    config_from(tmp_path, f"{key}={default}\n")  # the default value is accepted


def test_service_envelope_from_the_file_the_ts_variable_and_yaml(tmp_path: Path) -> None:
    """KServe's TorchServe runtime sets TS_SERVICE_ENVELOPE with enable_envvars_config=true."""
    assert config_from(tmp_path, "service_envelope=kservev2\n")[0].service_envelope == "kservev2"
    env = {"TS_SERVICE_ENVELOPE": "kserve"}
    config, _ = config_from(tmp_path, "enable_envvars_config=true\n", env)
    assert config.service_envelope == "kserve"
    assert config_from(tmp_path, "service_envelope=\n")[0].service_envelope == ""
    assert load_config(None, None, {}).service_envelope == ""
    yaml = tmp_path / "m.yaml"
    yaml.write_text("service_envelope: json\n")
    assert load_config(yaml, None, {}).service_envelope == "json"


def test_unknown_service_envelope_is_refused_naming_key_and_value(tmp_path: Path) -> None:
    choices = "'', kserve, kservev2, json, body"
    with pytest.raises(ConfigError) as caught:
        config_from(tmp_path, "service_envelope=kfserving\n")
    assert str(caught.value) == (
        f"{tmp_path / 'config.properties'} line 1 (service_envelope): 'service_envelope' should"
        f" be one of {choices}, found 'kfserving'"
    )
    with pytest.raises(ConfigError, match=re.escape("environment variable TS_SERVICE_ENVELOPE")):
        config_from(tmp_path, "enable_envvars_config=true\n", {"TS_SERVICE_ENVELOPE": "v1"})
    yaml = tmp_path / "m.yaml"
    yaml.write_text("service_envelope: v3\n")
    with pytest.raises(ConfigError, match=re.escape(f"one of {choices}, found 'v3'")):
        load_config(yaml, None, {})


def test_one_warning_lists_the_keys_without_effect_and_one_the_unknown(tmp_path: Path) -> None:
    _, ts = config_from(
        tmp_path,
        "vmargs=-Xmx4g\nnumber_of_netty_threads=4\nasync_logging=true\ncors_allowed_origin=*\n"
        "frobnicate=1\nzzz=2\nversion=0.12.0\ntsConfigFile=x\nenable_envvars_config=false\n",
    )
    assert ts.warnings() == [
        f"{ts.path}: these TorchServe keys have no effect on mserve (JVM, Netty, gRPC, plugins"
        " and other TorchServe-only parts; see docs/migration.md): async_logging,"
        " cors_allowed_origin, number_of_netty_threads, vmargs",
        f"{ts.path}: unknown keys, ignored as TorchServe ignores them: frobnicate, zzz",
    ]


def test_ts_variables_only_with_enable_envvars_config(tmp_path: Path) -> None:
    env = {"TS_JOB_QUEUE_SIZE": "7", "TS_INFERENCE_ADDRESS": "http://127.0.0.1:9999"}
    config, _ = config_from(tmp_path, "job_queue_size=3\n", env)
    assert config.job_queue_size == 3
    config, _ = config_from(tmp_path, "job_queue_size=3\nenable_envvars_config=true\n", env)
    assert (config.job_queue_size, config.inference_address) == (7, "127.0.0.1:9999")


def test_ts_allowed_urls_needs_use_env_allowed_urls(tmp_path: Path) -> None:
    env = {"TS_ALLOWED_URLS": "https://evil/.*"}
    text = "enable_envvars_config=true\nallowed_urls=https://good/.*\n"
    assert config_from(tmp_path, text, env)[0].allowed_urls == ("https://good/.*",)
    text += "use_env_allowed_urls=true\n"
    assert config_from(tmp_path, text, env)[0].allowed_urls == ("https://evil/.*",)


def test_bad_ts_variable_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="environment variable TS_JOB_QUEUE_SIZE"):
        config_from(tmp_path, "enable_envvars_config=true\n", {"TS_JOB_QUEUE_SIZE": "x"})


def test_dollar_variable_references(tmp_path: Path) -> None:
    config, _ = config_from(tmp_path, "model_store=$$STORE$$/models\n", {"STORE": "/srv"})
    assert config.model_store == "/srv/models"
    with pytest.raises(ConfigError) as err:
        config_from(tmp_path, "model_store=$$NOPE$$\n")
    assert str(err.value).endswith(
        "line 1: model_store refers to the environment variable NOPE ($$NOPE$$), which is not set"
    )


def test_precedence_properties_below_yaml_env_and_flags(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("batch_size: 2\njob_queue_size: 20\n")
    config, _ = config_from(
        tmp_path,
        "job_queue_size=10\nmodel_store=/from/properties\ndefault_response_timeout=9\n"
        "number_of_gpu=4\n",
        {"MSERVE_MODEL_STORE": "/from/env", "MSERVE_NUMBER_OF_GPU": "1"},
        yaml=yaml_file,
        flags={"number_of_gpu": 2},
    )
    assert config.response_timeout_s == 9.0  # properties over defaults
    assert config.job_queue_size == 20  # YAML over properties
    assert config.model_store == "/from/env"  # MSERVE_ over properties
    assert config.number_of_gpu == 2  # flags over all


def test_an_empty_snapshot_still_counts_as_one(tmp_path: Path) -> None:
    """TorchServe loads no load_models when its snapshot records no models: the snapshot is
    there (an empty tuple), not absent (None)."""
    assert config_from(tmp_path, "model_snapshot={}\n")[0].model_snapshot == ()
    assert config_from(tmp_path, "load_models=a.mar\n")[0].model_snapshot is None


def test_models_key_in_yaml_too(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("models:\n  m:\n    '1.0': {batchSize: 4}\n")
    config = load_config(yaml_file, {}, {})
    entry = config.model_entry("m", "1.0")
    assert entry is not None and entry.get("batchSize") == 4


def test_newest_snapshot_by_timestamp(tmp_path: Path) -> None:
    for name in (
        "20240101120000000-startup.cfg",
        "20240301090000000-snapshot.cfg",
        "20240201000000000-shutdown.cfg",
        "99999999999999999-notes.txt",
        "readme",
    ):
        (tmp_path / name).write_text("")  # fmt: skip
    assert newest_snapshot(tmp_path).name == "20240301090000000-snapshot.cfg"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no TorchServe config snapshot"):
        newest_snapshot(empty)


def test_kserves_one_port_file_works_once_a_variable_moves_an_api(tmp_path: Path) -> None:
    """KServe's TorchServe layout puts both APIs on 8085 (behind its wrapper); the mserve
    runtime moves them with MSERVE_* variables, and the check applies to the final values."""
    text = "inference_address=http://0.0.0.0:8085\nmanagement_address=http://0.0.0.0:8085\n"
    env = {"MSERVE_INFERENCE_ADDRESS": "0.0.0.0:8080",
           "MSERVE_MANAGEMENT_ADDRESS": "127.0.0.1:8081"}  # fmt: skip
    config, _ = config_from(tmp_path, text, env)
    assert (config.inference_address, config.management_address) == (
        "0.0.0.0:8080", "127.0.0.1:8081")  # fmt: skip
    # a wildcard and a loopback address on one port clash as well
    with pytest.raises(ConfigError, match="metrics_address and grpc_inference_address are both"):
        config_from(tmp_path, text, {**env, "MSERVE_METRICS_ADDRESS": "0.0.0.0:7070",
                                     "MSERVE_GRPC_INFERENCE_ADDRESS": "127.0.0.1:7070"})  # fmt: skip


def test_every_setting_a_snapshot_writes_is_read_back_and_restored_as_registered() -> None:
    """One table (server/config/model_settings.py) names the settings for the snapshot writer, the
    entry reader and the restore: what one writes, the others take back unchanged."""
    from server.config import parse_model_entries
    from server.config.model_settings import (
        ENTRY_SETTINGS,
        ModelSettings,
        request_fields,
        snapshot_fields,
    )

    settings = ModelSettings(
        batch_size=4, max_batch_delay_ms=20, response_timeout_s=30.0, startup_timeout_s=90.0,
        min_workers=0, max_workers=3, job_queue_size=10, device_ids=None, batch_wait="fill",
    )  # fmt: skip
    written = snapshot_fields(settings)
    assert written == {
        "minWorkers": 0, "maxWorkers": 3, "batchSize": 4, "maxBatchDelay": 20,
        "responseTimeout": 30, "startupTimeout": 90, "batchWait": "fill",
        "weightsScan": "warn",  # a restore can only make it stricter (server/weights/policy.py)
        "archiveSignatures": "off",  # the same (server/signatures.py)
    }  # fmt: skip
    snapshot = {"models": {"m": {"1.0": {"marName": "m.mar", **written}}}}
    (entry,) = parse_model_entries(snapshot, "model_snapshot", "snap.cfg")
    assert {s.key: entry.get(s.key) for s in ENTRY_SETTINGS} == written
    assert request_fields(entry.get) == {
        "initial_workers": 0, "max_workers": 3, "batch_size": 4, "max_batch_delay_ms": 20,
        "response_timeout_s": 30.0, "startup_timeout_s": 90.0, "batch_wait": "fill",
        "archive_signatures": "off",
    }  # fmt: skip
    with pytest.raises(ConfigError) as info:
        parse_model_entries({"m": {"1.0": {"batchWait": "soon"}}}, "models", "cfg")
    assert info.value.message == (
        "cfg: 'models': m 1.0 batchWait should be one of busy, fill, found 'soon'"
    )

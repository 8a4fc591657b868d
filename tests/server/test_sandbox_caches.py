"""The model caches confined workers read (server/workers/sandbox_caches.py): what the
server's environment names, its user's own ``~/.cache``, the ``sandbox_read_paths`` setting;
and refusals that name what grants a path (mserve_worker/confine.py's refusal_hint)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from mserve_worker.confine import landlock_abi
from server.config import ServerConfig, load_config
from server.errors import ConfigError
from server.workers.sandbox import Sandbox
from server.workers.sandbox_caches import find_caches
from tests.server.conftest import Server

torch = pytest.importorskip("torch")
needs_landlock = pytest.mark.skipif(landlock_abi() < 4, reason="needs Landlock ABI 4+ (Linux)")

# what torchvision's resnet50 asks torch.hub for; served from the cache, never downloaded
RESNET = "https://download.pytorch.org/models/resnet50-0676ba61.pth"
# the server's own cache variables, unset so that the test's environment cannot change them
UNSET = dict.fromkeys(("TORCH_HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE",
                       "HUGGINGFACE_HUB_CACHE", "HF_ASSETS_CACHE", "TRANSFORMERS_CACHE"))  # fmt: skip


def _weights(folder: Path) -> None:
    """resnet50's file name in a torch hub cache, holding a tiny state dict."""
    (folder / "checkpoints").mkdir(parents=True)
    torch.save({"w": torch.tensor([1.0, 2.0])}, folder / "checkpoints" / "resnet50-0676ba61.pth")


def _message(server: Server, model: str, target: dict) -> str:
    reply = server.predict(model, target)
    assert reply.status == 500, (model, reply.body)
    return reply.json()["message"]


def _answered(text: str, home: Path) -> str:
    """``text`` as an answer shows it: the server's home and temporary folder by name."""
    return text.replace(str(home), "~").replace(tempfile.gettempdir(), "<tmp>")


@needs_landlock
def test_workers_read_the_users_caches_and_the_granted_paths_and_no_more(
    make_archive, start_server, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    _weights(home / ".cache" / "torch" / "hub")
    hf = home / ".cache" / "huggingface"
    config_json = hf / "hub" / "models--org--m" / "snapshots" / "abc" / "config.json"
    config_json.parent.mkdir(parents=True)
    config_json.write_text('{"hidden": 4}')
    (hf / "token").write_text("hf_secret")  # the user's login: not for models
    granted, outside = tmp_path / "granted", tmp_path / "outside"
    for folder in (granted, outside):
        folder.mkdir()
        (folder / "vocab.txt").write_text("words")
    make_archive("model_caches", "hub_weights:handle", "hub")
    make_archive("hostile", "hostile:read_file", "reader")
    make_archive("hostile", "hostile:write_file", "writer")
    server = start_server(
        "hub=hub.mar", "reader=reader.mar", "writer=writer.mar",
        config={"sandbox_read_paths": [str(granted)]}, env={**UNSET, "HOME": str(home)},
    )  # fmt: skip

    # torch looks where the server user's weights are, its HOME being the worker's scratch
    loaded = json.loads(server.predict("hub", {"url": RESNET}).body)
    assert loaded == {
        "hub_dir": str(home / ".cache" / "torch" / "hub"),
        "weights": {"w": [1.0, 2.0]},
        "hf_hub_cache": str(hf / "hub"),
    }
    assert server.predict("reader", {"path": str(config_json)}).body == b'{"hidden": 4}'
    assert server.predict("reader", {"path": str(granted / "vocab.txt")}).body == b"words"

    # not granted: the refusal names the setting that grants it
    for path in (outside / "vocab.txt", hf / "token"):
        assert _message(server, "reader", {"path": str(path)}) == _answered(
            f"handler of reader:1.0 failed: PermissionError: [Errno 13] Permission denied:"
            f" '{path}' (the sandbox keeps this worker out of {path}; for models to read it,"
            " grant it with the server setting sandbox_read_paths (every model) or the model"
            " config's sandbox.readPaths (this model; sandbox.writePaths to write))",
            home,
        )
    # the caches are read-only: a download into one fails, saying what grants writing
    new = home / ".cache" / "torch" / "hub" / "checkpoints" / "new.pth"
    assert _message(server, "writer", {"path": str(new)}).endswith(
        _answered(
            f"Permission denied: '{new}' (the sandbox lets this worker read {new} but not write"
            " it; grant writing with the model config's sandbox.writePaths (a model cache such"
            " as TORCH_HOME or HF_HUB_CACHE is read-only))",
            home,
        )
    )
    assert not new.exists()
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert f"sandbox: the sandbox keeps this worker out of {outside / 'vocab.txt'};" in log

    shown = server.manage("GET", "/models/reader").json()[0]["sandbox"]
    assert shown["readShared"] == [str(home / ".cache" / "torch"), str(hf / "hub"), str(granted)]


@needs_landlock
def test_a_torch_home_the_environment_names_is_where_workers_look(
    make_archive, start_server, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    _weights(home / "baked" / "hub")
    unreadable = home / ".cache" / "huggingface" / "hub"  # the user's own, closed to others
    unreadable.mkdir(parents=True)
    unreadable.chmod(0o700)
    closed = tmp_path / "closed"  # granted, but by its mode for its owner alone
    closed.mkdir(mode=0o700)
    (closed / "vocab.txt").write_text("words")
    make_archive("model_caches", "hub_weights:handle", "hub")
    make_archive("hostile", "hostile:read_file", "reader")
    # "~" as a Dockerfile's ENV leaves it: the server's home, not the worker's
    env = {**UNSET, "HOME": str(home), "TORCH_HOME": "~/baked"}
    config = {"sandbox_read_paths": [str(closed)]}
    server = start_server("hub=hub.mar", "reader=reader.mar", config=config, env=env)
    loaded = json.loads(server.predict("hub", {"url": RESNET}).body)
    assert loaded["hub_dir"] == str(home / "baked" / "hub")
    assert loaded["weights"] == {"w": [1.0, 2.0]}
    if os.geteuid() != 0:  # the server's user: the modes let it in
        assert loaded["hf_hub_cache"] == str(unreadable)
        assert server.predict("reader", {"path": str(closed / "vocab.txt")}).body == b"words"
        return
    # under a uid per model, a home cache others cannot read is left out, a granted folder is
    # kept; each is named at the first registration, and the refusal says whose permissions
    assert loaded["hf_hub_cache"] is None
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert (
        f"sandbox: {unreadable} is not readable by other users ({unreadable} stops them):"
        " workers under their own uid do not use it and cache in their scratch folder" in log
    )
    assert (
        f"sandbox: {closed} (sandbox_read_paths) is not readable by other users ({closed} stops"
        " them): workers under their own uid will be refused reading it" in log
    )
    uid = server.manage("GET", "/models/reader").json()[0]["sandbox"]["uid"]
    assert _message(server, "reader", {"path": str(closed / "vocab.txt")}).endswith(
        _answered(
            f"(this worker runs as uid {uid}, which the permissions of {closed / 'vocab.txt'}"
            " do not let in (the sandbox grants it): give that uid access (chmod, a group, an"
            " ACL) or set sandbox_uid_range: off)",
            home,
        )
    )


def test_which_caches_are_granted(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for folder in ("torch", "huggingface/hub", "huggingface/assets"):
        (home / ".cache" / folder).mkdir(parents=True)
    caches = find_caches({}, ("/data/vocab",), str(home), "/srv")
    cache = str(home / ".cache")
    assert caches.read == (
        (f"{cache}/torch", "~/.cache/torch"),
        (f"{cache}/huggingface/hub", "~/.cache/huggingface/hub"),
        (f"{cache}/huggingface/assets", "~/.cache/huggingface/assets"),
        ("/data/vocab", "sandbox_read_paths"),
    )
    assert caches.env == {"TORCH_HOME": f"{cache}/torch", "HF_HUB_CACHE": f"{cache}/huggingface/hub",
                          "HF_ASSETS_CACHE": f"{cache}/huggingface/assets"}  # fmt: skip
    # a named cache replaces the user's own for its library; relative paths are the server's
    named = find_caches(
        {"TORCH_HOME": "weights/torch", "HF_HOME": "/models/hf", "TRANSFORMERS_CACHE": "~/tf"},
        (), str(home), "/srv",
    )  # fmt: skip
    assert named.read == (
        ("/srv/weights/torch", "TORCH_HOME"),
        ("/models/hf", "HF_HOME"),
        (f"{home}/tf", "TRANSFORMERS_CACHE"),
    )
    assert named.env == {"TORCH_HOME": "/srv/weights/torch", "TRANSFORMERS_CACHE": f"{home}/tf"}
    assert find_caches({"XDG_CACHE_HOME": "/cache"}, (), str(home), "/").paths == ["/cache"]


def test_the_read_paths_setting_is_checked(tmp_path: Path) -> None:
    config = load_config(environ={"MSERVE_SANDBOX_READ_PATHS": "/data/a, /data/b"})
    assert config.sandbox_read_paths == ("/data/a", "/data/b")
    run = tmp_path / "run"
    for value, message in (
        ("data", "sandbox_read_paths must hold absolute paths, found 'data'"),
        (str(run / "logs"), f"sandbox_read_paths names {run / 'logs'}, which holds or is inside"
                            f" the server's own files ({run})"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            Sandbox(ServerConfig(run_dir=str(run), sandbox_read_paths=(value,)), abi=7)
        assert message in str(err.value)
    # a cache variable naming the server's own files is not granted
    sandbox = Sandbox(
        ServerConfig(run_dir=str(run)), abi=7, environ={"XDG_CACHE_HOME": str(tmp_path)}
    )
    assert str(tmp_path) not in sandbox.caches.paths

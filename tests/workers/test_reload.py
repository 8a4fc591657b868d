"""Hot reload inside the worker: the RELOAD and RELOADED frames byte for byte (docs/protocol.md,
Hot reload), the keep store's lifetimes, and the runtime driven over its socket from a plain
copy of the child-side modules, reloading a handler folder the test edits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mserve_worker import protocol
from mserve_worker.protocol import Frame, Kind, ProtocolError, Reloaded, RequestItem
from mserve_worker.sdk.keep import KeepStore
from tests.workers.test_protocol import decode_all
from tests.workers.test_runtime import HANDLERS, Peer, _spawn

# -- frames --------------------------------------------------------------------------------------


def test_reload_frame_bytes_match_the_docs() -> None:
    expected = bytes.fromhex("4d53 06 0b 0000 0000001f 00000000 0000") + (
        b'{"reload_id":3,"step":"commit"}'
    )
    assert protocol.encode_bytes(protocol.reload_frame(3, "commit")) == expected
    assert protocol.parse_reload(decode_all(expected)[0]) == (3, "commit")


def test_a_failed_prepare_names_the_file_and_line_on_the_wire() -> None:
    answer = Reloaded(3, "prepare", False, "SyntaxError: invalid syntax (handler.py, line 7)",
                      "", "handler.py", 7)  # fmt: skip
    meta = (
        b'{"reload_id":3,"step":"prepare","ok":false,'
        b'"error":"SyntaxError: invalid syntax (handler.py, line 7)","traceback":"",'
        b'"file":"handler.py","line":7}'
    )
    expected = bytes.fromhex("4d53 06 0c 0000 00000092 00000000 0000") + meta
    assert protocol.encode_bytes(protocol.reloaded_frame(answer)) == expected
    assert protocol.parse_reloaded(decode_all(expected)[0]) == answer


def test_a_prepared_answer_carries_the_new_code() -> None:
    code = {"digest": "sha256:ab", "files": ["handler.py"]}
    answer = Reloaded(4, "prepare", True, code=code, load_s=0.01, kept=2)
    frame = protocol.reloaded_frame(answer)
    assert frame.meta == {"reload_id": 4, "step": "prepare", "ok": True, "code": code,
                          "load_s": 0.01, "kept": 2}  # fmt: skip
    (decoded,) = decode_all(protocol.encode_bytes(frame))
    assert protocol.parse_reloaded(decoded) == answer


def test_the_reload_frames_split_at_every_offset_decode_the_same() -> None:
    data = protocol.encode_bytes(protocol.reload_frame(9, "abort")) + protocol.encode_bytes(
        protocol.reloaded_frame(Reloaded(9, "abort", True))
    )
    for cut in range(len(data) + 1):
        decoder = protocol.Decoder()
        frames = decoder.feed(data[:cut]) + decoder.feed(data[cut:])
        assert [f.kind for f in frames] == [Kind.RELOAD, Kind.RELOADED]


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (Frame(Kind.RELOAD, {"step": "prepare"}), "RELOAD lacks the required field 'reload_id'"),
        (Frame(Kind.RELOAD, {"reload_id": 1, "step": "go"}),
         "RELOAD step must be one of prepare, commit, abort, got 'go'"),
        (Frame(Kind.RELOADED, {"reload_id": 1, "step": "prepare", "ok": "yes"}),
         "RELOADED ok must be true or false, got 'yes'"),
        (Frame(Kind.RELOADED, {"reload_id": 1, "step": "prepare", "ok": False}),
         "RELOADED lacks the required field 'error'"),
        (Frame(Kind.RELOADED, {"reload_id": 1, "step": "commit", "ok": True, "code": "x"}),
         "RELOADED code must be an object with a string digest"),
        (Frame(Kind.RELOADED, {"reload_id": 1, "step": "prepare", "ok": False, "error": "e",
                               "file": "h.py", "line": -1}),
         "RELOADED line must be a non-negative integer, got -1"),
        (Frame(Kind.RESULT, {}), "expected a RELOADED frame, got RESULT"),
    ],
)  # fmt: skip
def test_a_malformed_reload_frame_is_refused_with_what_is_wrong(frame: Frame, message: str) -> None:
    parse = protocol.parse_reload if frame.meta.get("ok") is None and frame.kind == Kind.RELOAD \
        else protocol.parse_reloaded  # fmt: skip
    with pytest.raises(ProtocolError) as caught:
        parse(frame)
    assert str(caught.value) == message


# -- the keep store ------------------------------------------------------------------------------


def test_the_keep_store_keeps_what_the_new_code_asks_for_and_releases_the_rest() -> None:
    store = KeepStore()
    made: list[str] = []

    def factory(name: str):
        return lambda: made.append(name) or name

    assert store.keep("weights", factory("weights")) == "weights"
    store.keep("tokenizer", factory("tokenizer"))
    store.begin()  # a reload: the new code asks for the weights only, and something new
    assert store.keep("weights", factory("weights-again")) == "weights"
    store.keep("cache", factory("cache"))
    keys = store.end()
    assert store.abort(keys) == 1 and "cache" not in store  # failed: only what it made goes
    assert "tokenizer" in store and "weights" in store
    store.begin()
    store.keep("weights", factory("weights-again"))
    assert store.commit(store.end()) == 1  # switched: the tokenizer nobody asked for goes
    assert "tokenizer" not in store and "weights" in store
    assert made == ["weights", "tokenizer", "cache"]  # the weights were made once


# -- the runtime over its socket -------------------------------------------------------------------

INIT = {"model_name": "hot", "handler": "handler:Handler", "manifest": {"model": {}},
        "batch_size": 1, "gpu_id": None}  # fmt: skip


def _ask(peer: Peer, batch_id: int) -> dict:
    peer.send(protocol.batch_frame(batch_id, [RequestItem("r", "application/json", [], b"{}")]))
    _, (result,) = protocol.parse_result(peer.receive())
    return json.loads(bytes(result.body))


def _reload(peer: Peer, reload_id: int, step: str) -> Reloaded:
    peer.send(protocol.reload_frame(reload_id, step))
    return protocol.parse_reloaded(peer.receive())


def test_what_basehandler_keeps_is_keyed_by_its_whole_model_config(tmp_path: Path) -> None:
    """A model config that changes how the model is built (weightsOnly, pt2, a subclass's own
    setting) changes the key BaseHandler keeps its model under: it is loaded again."""
    from mserve_worker.sdk.base_handler import BaseHandler

    weights = tmp_path / "model.pt"
    weights.write_bytes(b"weights")
    configs = [{}, {"weightsOnly": False}, {"pt2": {"compile": True}}, {"handler": {"k": 1}}]
    keys = []
    for config in [*configs, dict(configs[1])]:
        handler = BaseHandler()
        handler.model_pt_path, handler.manifest, handler.device = str(weights), {}, "cpu"
        handler.model_yaml_config = config
        keys.append(handler._kept_as(str(tmp_path)))
    assert len(set(keys[:4])) == 4 and keys[4] == keys[1]


def test_the_runtime_prepares_beside_the_old_code_and_switches_on_commit(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(HANDLERS / "hot_reload", folder)
    handler = folder / "handler.py"
    source = handler.read_text()
    proc, peer = _spawn(tmp_path)
    try:
        assert peer.receive().kind == Kind.HELLO
        peer.send(Frame(Kind.INIT, {**INIT, "model_dir": str(folder)}))
        ready = peer.receive()
        assert ready.kind == Kind.READY, ready.meta
        assert ready.meta["code"]["files"] == ["handler.py"]
        assert _ask(peer, 1)["answer"] == "v1"
        handler.write_text(source.replace('ANSWER = "v1"', 'ANSWER = "v2"'))
        prepared = _reload(peer, 1, "prepare")
        assert prepared.ok and prepared.kept == 2, prepared
        assert prepared.code is not None and prepared.code != ready.meta["code"]
        assert _ask(peer, 2)["answer"] == "v1"  # the old code serves until the commit
        assert _reload(peer, 1, "commit") == Reloaded(1, "commit", True, code=prepared.code)
        after = _ask(peer, 3)
        assert (after["answer"], after["loads"]) == ("v2", 1)  # weights kept
        handler.write_text(source + "\nraise ImportError('half-written')\n")
        failed = _reload(peer, 2, "prepare")
        line = source.count("\n") + 2
        assert not failed.ok and (failed.file, failed.line) == ("handler.py", line)
        assert failed.error == f"ImportError: half-written (handler.py, line {line})"
        assert _ask(peer, 4)["answer"] == "v2"
        assert _reload(peer, 2, "commit").error == (
            "no reload 2 was prepared in this worker; nothing to commit"
        )
        handler.write_text(source.replace('ANSWER = "v1"', 'ANSWER = "v3"'))
        assert _reload(peer, 3, "prepare").ok
        assert _reload(peer, 3, "abort").ok  # another worker failed: this one drops it
        assert _ask(peer, 5)["answer"] == "v2"
    finally:
        peer.sock.close()
    assert proc.wait(timeout=20) == 0


def test_a_reload_imports_the_handlers_helper_modules_again(tmp_path: Path) -> None:
    """Every module of the model folder is the model's code: a helper the handler imports is
    imported afresh too, and the code digest covers it."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "helpers.py").write_text("WORD = 'old'\n")
    (folder / "handler.py").write_text(
        "import helpers\n\n\ndef handle(data, context):\n"
        "    return [{'answer': helpers.WORD} for _ in data or ()]\n"
    )
    proc, peer = _spawn(tmp_path)
    try:
        assert peer.receive().kind == Kind.HELLO
        init = {**INIT, "handler": "handler:handle", "model_dir": str(folder)}
        peer.send(Frame(Kind.INIT, init))
        ready = peer.receive()
        assert ready.meta["code"]["files"] == ["handler.py", "helpers.py"]
        assert _ask(peer, 1)["answer"] == "old"
        (folder / "helpers.py").write_text("WORD = 'new'\n")
        prepared = _reload(peer, 1, "prepare")
        assert prepared.ok and prepared.code != ready.meta["code"]
        assert _reload(peer, 1, "commit").ok
        assert _ask(peer, 2)["answer"] == "new"
    finally:
        peer.sock.close()
    assert proc.wait(timeout=20) == 0

"""examples/waveglow: the models load NVIDIA's checkpoint layout, and text becomes speech end to end.

The end-to-end tests archive the example with the real model-archiver (small seed-0 checkpoints,
the example's requirements.txt) and serve it from one real mserve for the whole module: the
per-model environment is built once, and every test talks HTTP to the same worker.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import wave
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml

from tests.conftest import ARCHIVER_SCRIPT, REPO
from tests.server.conftest import MSERVE, Reply, Server, concurrently, pid_alive

EXAMPLE = REPO / "examples" / "waveglow"
HOP = 256
RATE = 22050
FRAMES_PER_SYMBOL = 3
MAX_CHARS = 200
# Small, so that a batch of texts is one batch: the three requests arrive within milliseconds.
BATCH_DELAY_MS = 400


@pytest.fixture(scope="module")
def example() -> Iterator[dict[str, ModuleType]]:
    """The example's model modules, imported the way the worker imports them (top-level names)."""
    sys.path.insert(0, str(EXAMPLE))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the models are tiny; more threads only contend on 2 shared cores
    try:
        import make_checkpoints
        import nvidia_checkpoints
        import tacotron2_model
        import waveglow_model

        yield {
            "make": make_checkpoints,
            "io": nvidia_checkpoints,
            "tacotron2": tacotron2_model,
            "waveglow": waveglow_model,
        }
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def checkpoints(example: dict[str, ModuleType], tmp_path_factory) -> tuple[Path, Path]:
    return example["make"].write(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def server(checkpoints: tuple[Path, Path], tmp_path_factory) -> Iterator[Server]:
    tacotron2, waveglow = checkpoints
    root = tmp_path_factory.mktemp("serve")
    store = root / "store"
    store.mkdir()
    config = root / "model-config.yaml"
    config.write_text(yaml.safe_dump({
        "minWorkers": 1, "maxWorkers": 1, "batchSize": 3, "maxBatchDelay": BATCH_DELAY_MS,
        "batchWait": "fill", "responseTimeout": 60,
        "handler": {"max_frames_per_symbol": FRAMES_PER_SYMBOL, "max_decoder_steps": 400,
                    "max_text_chars": MAX_CHARS, "threads": 1},
    }))  # fmt: skip
    extra = [EXAMPLE / f for f in ("tacotron2_model.py", "text_frontend.py",
                                   "nvidia_checkpoints.py")] + [tacotron2]  # fmt: skip
    archive = subprocess.run([
        ARCHIVER_SCRIPT, "--model-name", "tts", "--version", "1.0",
        "--serialized-file", str(waveglow),
        "--model-file", str(EXAMPLE / "waveglow_model.py"),
        "--handler", str(EXAMPLE / "waveglow_handler.py") + ":TextToSpeech",
        "--extra-files", ",".join(str(p) for p in extra),
        "--requirements-file", str(EXAMPLE / "requirements.txt"),
        "-c", str(config), "--export-path", str(store), "-f",
    ], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert archive.returncode == 0, archive.stderr

    settings = {
        "inference_address": "127.0.0.1:0",
        "management_address": "127.0.0.1:0",
        "metrics_address": "127.0.0.1:0",
        "grpc_inference_address": "127.0.0.1:0",
        "grpc_management_address": "127.0.0.1:0",
        "model_store": str(store),
    }
    server_config = root / "mserve.yaml"
    server_config.write_text(yaml.safe_dump(settings))
    run_dir = root / "run"
    args = ["--config", str(server_config), "--run-dir", str(run_dir)]
    started = subprocess.run([MSERVE, "--start", *args, "--models", "tts=tts.mar"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    status = json.loads((run_dir / "status.json").read_text())
    served = Server(run_dir, status, args)
    assert "model tts: ready" in started.stdout + started.stderr, started.stdout + started.stderr
    yield served
    if pid_alive(served.pid):
        served.cli("--stop")


def _speak(server: Server, text: str | dict[str, Any] | bytes, **headers: str) -> Reply:
    return server.predict("tts", text, headers=headers or None)


def _wav(reply: Reply) -> tuple[Any, bytes]:
    """The WAV's header fields and its sample bytes, checked to be a WAV first."""
    assert reply.status == 200, reply.body[:500]
    assert reply.headers["Content-Type"] == "audio/wav"
    with wave.open(io.BytesIO(reply.body)) as audio:
        return audio.getparams(), audio.readframes(audio.getnframes())


# End to end.


def test_a_sentence_becomes_a_wav(server: Server) -> None:
    reply = _speak(server, "Hello world, this is mserve speaking.")
    audio, pcm = _wav(reply)
    assert (audio.nchannels, audio.sampwidth, audio.framerate) == (1, 2, RATE)
    frames = int(reply.headers["X-Mel-Frames"])
    assert 0 < frames <= 400
    assert audio.nframes == frames * HOP
    assert audio.nframes / RATE == pytest.approx(frames * HOP / RATE)
    samples = memoryview(pcm).cast("h")
    assert any(samples), "the WAV is all zeros"
    assert max(abs(s) for s in samples) > 1000
    # The seed is fixed per batch: the same text alone gives the same bytes.
    assert _speak(server, "Hello world, this is mserve speaking.").body == reply.body
    # JSON bodies work too, as TorchServe clients send them.
    again = _speak(server, {"text": "Hello world, this is mserve speaking."})
    assert again.body == reply.body


def test_a_batch_of_three_texts_gives_each_caller_its_own_wav(server: Server) -> None:
    texts = ["Good morning.", "The quick brown fox jumps over the lazy dog.", "It is 1984."]
    alone = [int(_speak(server, t).headers["X-Mel-Frames"]) for t in texts]
    assert len(set(alone)) == 3  # different lengths, so a mix-up would show
    replies = concurrently(*(partial(_speak, server, t) for t in texts))
    bodies = []
    for reply, frames in zip(replies, alone, strict=True):
        audio, _ = _wav(reply)
        assert reply.headers["X-Batch-Size"] == "3", "the three requests were not one batch"
        # Each caller's audio is as long as its own text's alone: padding did not leak.
        assert int(reply.headers["X-Mel-Frames"]) == frames
        assert audio.nframes == frames * HOP
        bodies.append(reply.body)
    assert len(set(bodies)) == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("", "text is empty: send the sentence to speak as the request body"),
        ("   \n\t", "text is empty: send the sentence to speak as the request body"),
        ({"text": ""}, "text is empty: send the sentence to speak as the request body"),
        ({"speech": "hi"}, 'text is empty: send plain text, or JSON {"text": "..."}'),
        ({"text": 42}, 'expected text or JSON {"text": "..."}, found int'),
        (
            "a" * (MAX_CHARS + 1),
            f"text is {MAX_CHARS + 1} characters long; the limit is {MAX_CHARS}",
        ),
        ("@@@ ###", "text '@@@ ###' has no speakable characters"),
    ],
)
def test_bad_text_gets_a_400_with_a_clear_message(server: Server, body: Any, message: str) -> None:
    reply = _speak(server, body)
    assert reply.status == 400
    assert reply.json() == {"code": 400, "type": "BadRequestException", "message": message}


def test_bad_bytes_get_a_400(server: Server) -> None:
    reply = server.predict(
        "tts", b"\xff\xfe\xfa", headers={"Content-Type": "application/octet-stream"}
    )
    assert reply.status == 400
    assert reply.json()["message"] == "text is not valid UTF-8: invalid start byte at byte 0"


def test_a_bad_text_in_a_batch_fails_only_its_caller(server: Server) -> None:
    replies = concurrently(
        *(partial(_speak, server, t) for t in ["First caller.", "", "Third caller, still served."])
    )
    assert replies[1].status == 400
    for reply in (replies[0], replies[2]):
        _wav(reply)
        assert reply.headers["X-Batch-Size"] == "2"


# Units: the models and NVIDIA's checkpoint layout.


def test_small_checkpoints_have_nvidia_keys_and_load_strictly(example, checkpoints) -> None:
    tacotron2_file, waveglow_file = checkpoints
    for path, sample_keys in [
        (tacotron2_file, ["module.embedding.weight",
                          "module.encoder.convolutions.2.1.running_var",
                          "module.encoder.lstm.weight_hh_l0_reverse",
                          "module.decoder.attention_layer.location_layer.location_conv.conv.weight",
                          "module.decoder.gate_layer.linear_layer.bias",
                          "module.postnet.convolutions.4.0.conv.weight"]),
        (waveglow_file, ["module.upsample.weight", "module.WN.0.start.weight_g",
                         "module.WN.7.in_layers.1.weight_v", "module.WN.7.cond_layers.0.bias",
                         "module.WN.3.res_skip_layers.1.weight_v", "module.WN.0.end.weight",
                         "module.convinv.7.conv.weight"]),
    ]:  # fmt: skip
        saved = torch.load(path, weights_only=True)
        assert set(saved) == {"state_dict", "config"}
        assert all(k.startswith("module.") for k in saved["state_dict"])
        assert set(sample_keys) <= set(saved["state_dict"])

    io = example["io"]
    device = torch.device("cpu")
    for loaded, path in [(io.load_tacotron2(tacotron2_file, device), tacotron2_file),
                         (io.load_waveglow(waveglow_file, device), waveglow_file)]:  # fmt: skip
        saved = torch.load(path, weights_only=True)["state_dict"]
        mine = loaded.state_dict()
        assert {"module." + k for k in mine} == set(saved)
        assert all(torch.equal(mine[k[len("module.") :]], v) for k, v in saved.items())


def test_a_checkpoint_that_does_not_match_fails_naming_the_tensor(example, checkpoints, tmp_path):
    saved = torch.load(checkpoints[1], weights_only=True)
    del saved["state_dict"]["module.WN.2.cond_layers.1.weight_g"]
    broken = tmp_path / "broken.pth"
    torch.save(saved, broken)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*WN\.2\.cond_layers\.1\.weight_g"):
        example["io"].load_waveglow(broken, torch.device("cpu"))


def test_published_sizes_give_the_published_shapes(example) -> None:
    """At default sizes our modules have the shapes of NVIDIA's fp32 checkpoints (no weights are
    made: the models are built on the meta device)."""
    tacotron2, waveglow = example["tacotron2"], example["waveglow"]
    with torch.device("meta"):
        t2 = tacotron2.Tacotron2(tacotron2.Tacotron2Config())
        wg = waveglow.WaveGlow(waveglow.WaveGlowConfig())
    t_shapes = {k: tuple(v.shape) for k, v in t2.state_dict().items()}
    w_shapes = {k: tuple(v.shape) for k, v in wg.state_dict().items()}
    assert {
        "embedding.weight": (148, 512),
        "encoder.convolutions.0.0.conv.weight": (512, 512, 5),
        "encoder.lstm.weight_ih_l0": (1024, 512),
        "decoder.prenet.layers.0.linear_layer.weight": (256, 80),
        "decoder.attention_rnn.weight_ih": (4096, 768),
        "decoder.attention_layer.memory_layer.linear_layer.weight": (128, 512),
        "decoder.attention_layer.location_layer.location_conv.conv.weight": (32, 2, 31),
        "decoder.decoder_rnn.weight_ih": (4096, 1536),
        "decoder.linear_projection.linear_layer.weight": (80, 1536),
        "decoder.gate_layer.linear_layer.weight": (1, 1536),
        "postnet.convolutions.0.0.conv.weight": (512, 80, 5),
        "postnet.convolutions.4.1.running_mean": (80,),
    }.items() <= t_shapes.items()
    assert {
        "upsample.weight": (80, 80, 1024),
        "WN.0.start.weight_v": (512, 4, 1),
        "WN.0.in_layers.0.weight_v": (1024, 512, 3),
        "WN.0.cond_layers.0.weight_v": (1024, 640, 1),
        "WN.0.res_skip_layers.7.weight_v": (512, 512, 1),
        "WN.0.end.weight": (8, 512, 1),
        "WN.4.start.weight_v": (512, 3, 1),
        "WN.11.start.weight_v": (512, 2, 1),
        "convinv.0.conv.weight": (8, 8, 1),
        "convinv.4.conv.weight": (6, 6, 1),
        "convinv.11.conv.weight": (4, 4, 1),
    }.items() <= w_shapes.items()
    assert len(t_shapes) == 84 and len(w_shapes) == 12 * (2 + 3 + 3 * 8 * 3 + 1) + 2
    # Sizes read back from the shapes are the published configuration.
    assert tacotron2.Tacotron2Config.from_state_dict(t2.state_dict()) == tacotron2.Tacotron2Config()
    assert waveglow.WaveGlowConfig.from_state_dict(wg.state_dict()) == waveglow.WaveGlowConfig()


def test_batched_mel_equals_the_mel_of_each_text_alone(example, checkpoints) -> None:
    model = example["io"].load_tacotron2(checkpoints[0], torch.device("cpu"))
    torch.manual_seed(3)
    lengths = torch.tensor([17, 9, 4])
    symbols = torch.randint(1, 60, (3, 17)) * (torch.arange(17)[None, :] < lengths[:, None])
    with torch.inference_mode():
        generator = torch.Generator().manual_seed(0)
        mel, mel_lengths = model.infer(symbols, lengths, lengths * 3, generator=generator)
        assert mel_lengths.tolist() == [51, 27, 12]
        for row in range(3):
            n = int(lengths[row])
            generator = torch.Generator().manual_seed(0)
            alone, alone_len = model.infer(symbols[row : row + 1, :n], lengths[row : row + 1],
                                           lengths[row : row + 1] * 3, generator=generator)  # fmt: skip
            assert alone_len.tolist() == [n * 3]
            torch.testing.assert_close(mel[row, :, : n * 3], alone[0], rtol=1e-4, atol=1e-5)


def test_waveglow_gives_hop_length_samples_per_frame(example, checkpoints) -> None:
    model = example["io"].load_waveglow(checkpoints[1], torch.device("cpu"))
    upsample = model.upsample
    mel = torch.randn(2, model.cfg.n_mel_channels, 7)
    with torch.inference_mode():
        audio = model.infer(mel, sigma=0.5, generator=torch.Generator().manual_seed(0))
        reference = upsample(mel)[:, :, : 7 * HOP]
        mine = model._upsample(mel)
    assert audio.shape == (2, 7 * HOP)
    assert torch.isfinite(audio).all()
    torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)


def test_denoiser_keeps_every_length_down_to_one_frame(example, checkpoints) -> None:
    model = example["io"].load_waveglow(checkpoints[1], torch.device("cpu"))
    denoiser = example["waveglow"].Denoiser(model)
    for samples in (HOP, 2 * HOP, 3 * HOP, 40 * HOP):
        audio = torch.randn(2, samples) * 0.1
        with torch.inference_mode():
            assert denoiser(audio, 0.1).shape == (2, samples)
            # Strength 0 takes nothing off: the STFT round trip gives the audio back.
            torch.testing.assert_close(denoiser(audio, 0.0), audio, rtol=0, atol=1e-5)

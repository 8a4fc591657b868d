"""Real-time factor of the text-to-speech example (seconds of audio per second of compute).

Uses the small seed-0 checkpoints (examples/waveglow/make_checkpoints.py), so the figures measure
the serving path and these widths, not the published models. Two ways, at batch 1 and batch 4:

- bare: Tacotron2 + WaveGlow + denoiser in this process, one call per batch;
- mserve: the archived example behind a real mserve, one request at a time (batch 1) or four
  concurrent requests batched by the server (batch 4), timed at the client.

Each figure is the median over ``--rounds`` rounds, after one warm-up round. Both ways use
``--threads`` torch threads (the worker through the handler's ``threads`` setting): the decoder
runs hundreds of tiny steps, where extra threads mostly wait on each other.

Usage: python scripts/bench_waveglow.py [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import wave
from collections.abc import Callable
from pathlib import Path

import harness
import torch
import yaml

EXAMPLE = harness.REPO / "examples" / "waveglow"
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a serving benchmark speaks in random noise",
    "four texts travel together in one batch",
    "each caller gets only its own audio back",
]
RATE = 22050


def median_rtf(rounds: int, run: Callable[[], float]) -> tuple[float, float]:
    """Median real-time factor and median seconds per round; ``run`` returns audio seconds."""
    run()  # warm-up: first-call costs are not what a serving process pays per request
    factors, times = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        audio_s = run()
        elapsed = time.perf_counter() - start
        factors.append(audio_s / elapsed)
        times.append(elapsed)
    return statistics.median(factors), statistics.median(times)


def bare(tacotron2_file: Path, waveglow_file: Path, batch: int, rounds: int) -> tuple[float, float]:
    sys.path.insert(0, str(EXAMPLE))
    from nvidia_checkpoints import load_tacotron2, load_waveglow
    from text_frontend import SYMBOL_IDS
    from waveglow_model import Denoiser

    settings = yaml.safe_load((EXAMPLE / "model-config.yaml").read_text())["handler"]
    device = torch.device("cpu")
    tacotron2 = load_tacotron2(tacotron2_file, device)
    waveglow = load_waveglow(waveglow_file, device)
    denoiser = Denoiser(waveglow)
    texts = [[SYMBOL_IDS[c] for c in s] for s in SENTENCES[:batch]]
    lengths = torch.tensor([len(t) for t in texts])
    symbols = torch.zeros(batch, int(lengths.max()), dtype=torch.long)
    for row, ids in enumerate(texts):
        symbols[row, : len(ids)] = torch.tensor(ids)
    max_steps = (lengths * settings["max_frames_per_symbol"]).clamp(
        max=settings["max_decoder_steps"]
    )

    def run() -> float:
        generator = torch.Generator().manual_seed(settings["seed"])
        with torch.inference_mode():
            mel, mel_lengths = tacotron2.infer(
                symbols, lengths, max_steps, settings["gate_threshold"], generator
            )
            audio = waveglow.infer(mel, settings["sigma"], generator)
            denoiser(audio, settings["denoise_strength"])
        return float(mel_lengths.sum()) * waveglow.cfg.hop_length / RATE

    return median_rtf(rounds, run)


BATCH_SIZES: list[int] = []  # what the handler reported (X-Batch-Size), to show batching worked


def post(url: str, text: str) -> float:
    """POST one text; the seconds of audio in the WAV that comes back."""
    request = urllib.request.Request(
        url, data=text.encode(), method="POST", headers={"Content-Type": "text/plain"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        BATCH_SIZES.append(int(reply.headers["X-Batch-Size"]))
        body = reply.read()
    with wave.open(io.BytesIO(body)) as audio:
        return audio.getnframes() / audio.getframerate()


def concurrently(url: str, texts: list[str]) -> float:
    seconds = [0.0] * len(texts)

    def one(i: int) -> None:
        seconds[i] = post(url, texts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(seconds):
        raise RuntimeError("a request failed; see the server log")
    return sum(seconds)


def archive(root: Path, tacotron2_file: Path, waveglow_file: Path, threads: int) -> Path:
    store = root / "store"
    store.mkdir()
    config = yaml.safe_load((EXAMPLE / "model-config.yaml").read_text())
    config["handler"]["threads"] = threads
    config_file = root / "model-config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    extra = [EXAMPLE / f for f in ("tacotron2_model.py", "text_frontend.py",
                                   "nvidia_checkpoints.py")] + [tacotron2_file]  # fmt: skip
    harness.archive(
        store, "tts", "--version", "1.0", "--serialized-file", waveglow_file,
        "--model-file", EXAMPLE / "waveglow_model.py",
        "--handler", str(EXAMPLE / "waveglow_handler.py") + ":TextToSpeech",
        "--extra-files", ",".join(str(p) for p in extra),
        "--requirements-file", EXAMPLE / "requirements.txt", "-c", config_file, "-f",
    )  # fmt: skip
    return store


def through_mserve(root: Path, store: Path, rounds: int) -> dict[int, tuple[float, float]]:
    server = harness.Server(root, {
        "access_log": False, "grpc": False,
        # loopback only; it registers models and measures the model, not keys
        "disable_token_authorization": True, "enable_model_api": True,
    })  # fmt: skip
    try:
        status = server.status
        results = {}
        for batch in (1, 4):
            name = f"tts_b{batch}"
            register = (
                f"http://{status['management']}/models?url=tts.mar&model_name={name}"
                f"&batch_size={batch}&max_batch_delay=50&initial_workers=1&synchronous=true"
            )
            urllib.request.urlopen(urllib.request.Request(register, method="POST"), timeout=300)
            url = f"http://{status['inference']}/predictions/{name}"
            BATCH_SIZES.clear()
            if batch == 1:
                results[1] = median_rtf(rounds, lambda url=url: post(url, SENTENCES[0]))
            else:
                results[4] = median_rtf(rounds, lambda url=url: concurrently(url, SENTENCES))
            print(f"mserve batch {batch}: the handler saw batches of {sorted(set(BATCH_SIZES))}")
            delete = f"http://{status['management']}/models/{name}"
            urllib.request.urlopen(urllib.request.Request(delete, method="DELETE"), timeout=60)
        return results
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args()
    rounds = options.rounds
    torch.set_num_threads(options.threads)
    sys.path.insert(0, str(EXAMPLE))
    from make_checkpoints import write

    with tempfile.TemporaryDirectory(prefix="bench-waveglow-") as tmp:
        root = Path(tmp)
        tacotron2_file, waveglow_file = write(root / "checkpoints")
        rows = []
        for batch in (1, 4):
            rtf, seconds = bare(tacotron2_file, waveglow_file, batch, rounds)
            rows.append(("bare", batch, rtf, seconds))
        store = archive(root, tacotron2_file, waveglow_file, options.threads)
        for batch, (rtf, seconds) in through_mserve(root, store, rounds).items():
            rows.append(("mserve", batch, rtf, seconds))
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, median of {rounds}")
    print(f"{'path':<8} {'batch':>5} {'RTF (audio s / compute s)':>27} {'s per round':>12}")
    for path, batch, rtf, seconds in rows:
        print(f"{path:<8} {batch:>5} {rtf:>27.2f} {seconds:>12.3f}")


if __name__ == "__main__":
    main()

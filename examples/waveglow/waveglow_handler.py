"""Text-to-speech handler: text in, a 16-bit mono WAV at 22,050 Hz out (Tacotron2 + WaveGlow).

A handler class in TorchServe's style (``initialize(context)`` once, ``handle(data, context)``
per batch). The archive's serialized file is the WaveGlow checkpoint; the Tacotron2 checkpoint
travels as an extra file. Settings come from the ``handler:`` section of the model config (see
``model-config.yaml``).

A batch of texts is synthesised together: symbol ids are padded, each text keeps its own length
and step bound, and each caller gets only its own audio. A text that is empty, too long, or has
nothing speakable gets a 400 with a message for that caller only; the rest of the batch is served.
"""

from __future__ import annotations

import array
import glob
import io
import os
import sys
import time
import wave
from dataclasses import dataclass
from typing import Any

import torch
from nvidia_checkpoints import load_tacotron2, load_waveglow
from tacotron2_model import Tacotron2
from text_frontend import TextFrontend
from waveglow_model import Denoiser, WaveGlow

SAMPLE_RATE = 22050


@dataclass(frozen=True)
class Settings:
    """The handler's settings, from the ``handler:`` section of the model config."""

    tacotron2_checkpoint: str = ""  # file in the model folder; default: the one *tacotron2*.pt*
    max_text_chars: int = 1000
    max_decoder_steps: int = 1000  # the hard bound on mel frames for any text
    max_frames_per_symbol: int = 12  # per-text bound (speech runs at about 6 frames a character)
    gate_threshold: float = 0.5
    sigma: float = 0.666
    denoise_strength: float = 0.01  # 0 turns the denoiser off
    seed: int = 1234
    threads: int = 0  # torch threads on CPU; 0 leaves torch's default

    @classmethod
    def from_model_config(cls, config: dict[str, Any] | None) -> Settings:
        section = dict((config or {}).get("handler") or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"unknown handler settings {unknown}; known: {sorted(known)}")
        return cls(**section)


class BadText(ValueError):
    """A request whose text cannot be synthesised; its message goes back to that caller."""


@dataclass
class Parsed:
    ids: list[int] | None = None
    error: str = ""


class TextToSpeech:
    """Loads both models once per worker and serves batches of texts."""

    def __init__(self) -> None:
        self.settings = Settings()
        self.device = torch.device("cpu")
        self.tacotron2: Tacotron2 | None = None
        self.waveglow: WaveGlow | None = None
        self.denoiser: Denoiser | None = None
        self.frontend: TextFrontend | None = None

    def initialize(self, context: Any) -> None:
        properties = context.system_properties
        model_dir = properties.get("model_dir") or "."
        self.settings = settings = Settings.from_model_config(context.model_yaml_config)
        gpu = properties.get("gpu_id")
        if gpu is not None and torch.cuda.is_available():
            self.device = torch.device(f"cuda:{gpu}")
        elif settings.threads > 0:
            torch.set_num_threads(settings.threads)
        waveglow_file = os.path.join(model_dir, context.manifest["model"]["serializedFile"])
        self.waveglow = load_waveglow(waveglow_file, self.device).to(self.device)
        self.waveglow.prepare_for_inference()  # after the move: the folded weights stay put
        self.tacotron2 = load_tacotron2(self._tacotron2_file(model_dir), self.device)
        self.tacotron2.to(self.device)
        if settings.denoise_strength > 0:
            self.denoiser = Denoiser(self.waveglow, hop_length=self.waveglow.cfg.hop_length)
        self.frontend = TextFrontend()

    def _tacotron2_file(self, model_dir: str) -> str:
        name = self.settings.tacotron2_checkpoint
        if name:
            return os.path.join(model_dir, name)
        found = sorted(glob.glob(os.path.join(model_dir, "*tacotron2*.pt*")))
        if len(found) != 1:
            raise FileNotFoundError(
                f"expected one Tacotron2 checkpoint (*tacotron2*.pt*) in {model_dir}, found "
                f"{[os.path.basename(f) for f in found]}; set handler.tacotron2_checkpoint"
            )
        return found[0]

    def handle(self, data: list[Any], context: Any) -> list[Any]:
        parsed = [self._parse(item) for item in data]
        good = [i for i, p in enumerate(parsed) if p.ids is not None]
        results: list[Any] = [None] * len(data)
        for i, p in enumerate(parsed):
            if p.ids is None:
                context.set_response_status(400, "Bad Request", i)
                results[i] = {"code": 400, "type": "BadRequestException", "message": p.error}
        if good:
            wavs, frames = self._synthesize([parsed[i].ids or [] for i in good], context)
            for i, wav, n in zip(good, wavs, frames, strict=True):
                context.set_response_content_type(i, "audio/wav")
                context.set_response_header(i, "X-Mel-Frames", str(n))
                context.set_response_header(i, "X-Batch-Size", str(len(good)))
                results[i] = wav
        return results

    def _parse(self, item: Any) -> Parsed:
        try:
            return Parsed(ids=self._ids(_text_of(item)))
        except BadText as exc:
            return Parsed(error=str(exc))

    def _ids(self, text: str) -> list[int]:
        limit = self.settings.max_text_chars
        if not text.strip():
            raise BadText("text is empty: send the sentence to speak as the request body")
        if len(text) > limit:
            raise BadText(f"text is {len(text)} characters long; the limit is {limit}")
        assert self.frontend is not None
        ids = self.frontend.to_ids(text)
        if not self.frontend.speakable(ids):
            raise BadText(f"text {text[:80]!r} has no speakable characters")
        return ids

    def _synthesize(self, texts: list[list[int]], context: Any) -> tuple[list[bytes], list[int]]:
        assert self.tacotron2 is not None and self.waveglow is not None
        s, device = self.settings, self.device
        lengths = torch.tensor([len(t) for t in texts], device=device)
        symbols = torch.zeros(len(texts), int(lengths.max()), dtype=torch.long, device=device)
        for row, ids in enumerate(texts):
            symbols[row, : len(ids)] = torch.tensor(ids, device=device)
        if s.max_frames_per_symbol > 0:
            max_steps = (lengths * s.max_frames_per_symbol).clamp(max=s.max_decoder_steps)
        else:
            max_steps = torch.full_like(lengths, s.max_decoder_steps)
        # One seeded generator per batch: the same text gives the same mel, batched or not.
        generator = torch.Generator(device=device).manual_seed(s.seed)
        with torch.inference_mode():
            start = time.perf_counter()
            mel, mel_lengths = self.tacotron2.infer(
                symbols, lengths, max_steps, s.gate_threshold, generator
            )
            middle = time.perf_counter()
            audio = self.waveglow.infer(mel, s.sigma, generator)
            if self.denoiser is not None:
                audio = self.denoiser(audio, s.denoise_strength)
            audio = audio.float().clamp(-1.0, 1.0).cpu()
            end = time.perf_counter()
        context.metrics.add_time("Tacotron2Latency", (middle - start) * 1000.0)
        context.metrics.add_time("WaveGlowLatency", (end - middle) * 1000.0)
        hop = self.waveglow.cfg.hop_length
        frames = [int(n) for n in mel_lengths.cpu()]
        return [wav_bytes(audio[row, : n * hop]) for row, n in enumerate(frames)], frames


def _text_of(item: Any) -> str:
    """The text of one request: a text body, a JSON ``{"text": ...}``, or UTF-8 bytes.

    TorchServe clients put the payload under ``data`` or ``body``; both are read.
    """
    body = item.get("data", item.get("body")) if isinstance(item, dict) else item
    if isinstance(body, dict):
        body = body.get("text", body.get("data"))
    if isinstance(body, (bytes, bytearray)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadText(f"text is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    if body is None:
        raise BadText('text is empty: send plain text, or JSON {"text": "..."}')
    if not isinstance(body, str):
        raise BadText(f'expected text or JSON {{"text": "..."}}, found {type(body).__name__}')
    return body


def wav_bytes(audio: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A mono 16-bit PCM WAV file of ``audio`` (floats in [-1, 1])."""
    pcm = array.array("h", (audio * 32767.0).round().to(torch.int16).tolist())
    if sys.byteorder == "big":
        pcm.byteswap()  # WAV samples are little-endian
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()

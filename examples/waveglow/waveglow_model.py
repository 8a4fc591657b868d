"""WaveGlow (Prenger et al., 2019): a flow that turns Gaussian noise into a waveform, given a mel.

Written for this example from the published architecture: the mel spectrogram is upsampled to the
audio rate by a transposed convolution; audio is folded into groups of ``n_group`` samples; each of
``n_flows`` steps is an invertible 1x1 convolution followed by an affine coupling layer whose scale
and shift come from a WaveNet-like block (``WN``) conditioned on the mel; every ``n_early_every``
flows, ``n_early_size`` channels leave early. Inference runs the flows backwards from noise scaled
by ``sigma``.

Parameter names follow NVIDIA's DeepLearningExamples implementation, weight-norm halves
(``weight_g``, ``weight_v``) included, so that the published ``nvidia_waveglowpyt_fp32_*.pth``
checkpoints load with a strict ``load_state_dict``. :meth:`WaveGlow.prepare_for_inference` folds
the weight norm and inverts the 1x1 convolutions once, after loading and moving to the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class WaveGlowConfig:
    """Sizes of the network. The defaults are the published model's."""

    n_mel_channels: int = 80
    n_flows: int = 12
    n_group: int = 8
    n_early_every: int = 4
    n_early_size: int = 2
    n_layers: int = 8
    n_channels: int = 512
    kernel_size: int = 3
    upsample_kernel: int = 1024
    hop_length: int = 256

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, torch.Tensor], hop_length: int = 256
    ) -> WaveGlowConfig:
        """Read every size from tensor shapes; ``hop_length`` (the upsampling stride) is the one
        fact a shape cannot tell, and every published checkpoint uses 256."""
        upsample = state["upsample.weight"]
        n_flows = 0
        while f"convinv.{n_flows}.conv.weight" in state:
            n_flows += 1
        widths = [int(state[f"convinv.{k}.conv.weight"].shape[0]) for k in range(n_flows)]
        drops = [k for k in range(1, n_flows) if widths[k] < widths[k - 1]]
        n_layers = 0
        while f"WN.0.in_layers.{n_layers}.weight_v" in state:
            n_layers += 1
        in_layer = state["WN.0.in_layers.0.weight_v"]
        return cls(
            n_mel_channels=int(upsample.shape[0]),
            n_flows=n_flows,
            n_group=widths[0],
            n_early_every=drops[0] if drops else max(n_flows, 1),
            n_early_size=widths[0] - widths[drops[0]] if drops else 2,
            n_layers=n_layers,
            n_channels=int(in_layer.shape[1]),
            kernel_size=int(in_layer.shape[2]),
            upsample_kernel=int(upsample.shape[2]),
            hop_length=hop_length,
        )


class WeightNormConv1d(nn.Module):
    """A 1-d convolution stored as ``weight_g * weight_v / ||weight_v||`` (as trained).

    Keeping the two halves as parameters keeps checkpoint keys identical to the published ones;
    :meth:`fold` computes the plain weight once so inference pays nothing for the split.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int = 1, dilation: int = 1) -> None:
        super().__init__()
        conv = nn.Conv1d(in_ch, out_ch, kernel_size)
        self.weight_v = nn.Parameter(conv.weight.detach().clone())
        self.weight_g = nn.Parameter(self._norm(self.weight_v.detach()))
        self.bias = nn.Parameter(conv.bias.detach().clone())
        self.dilation = dilation
        self.padding = dilation * (kernel_size - 1) // 2
        self._folded: torch.Tensor | None = None

    @staticmethod
    def _norm(v: torch.Tensor) -> torch.Tensor:
        return v.norm(dim=(1, 2), keepdim=True)

    def weight(self) -> torch.Tensor:
        return self.weight_g * self.weight_v / self._norm(self.weight_v)

    def fold(self) -> None:
        self._folded = self.weight().detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._folded if self._folded is not None else self.weight()
        return F.conv1d(x, w, self.bias, padding=self.padding, dilation=self.dilation)


class Invertible1x1Conv(nn.Module):
    """Mixes the channels of a group with an orthogonal-initialised matrix, run inverted here."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 1, bias=False)
        self._inverse: torch.Tensor | None = None
        if not self.conv.weight.is_meta:
            q, _ = torch.linalg.qr(torch.randn(channels, channels))
            if torch.det(q) < 0:  # a rotation, not a reflection: log-determinant 0
                q[:, 0] = -q[:, 0]
            with torch.no_grad():
                self.conv.weight.copy_(q.unsqueeze(-1))

    def prepare(self) -> None:
        w = self.conv.weight.detach().squeeze(-1)
        self._inverse = torch.linalg.inv(w.double()).to(w.dtype).unsqueeze(-1)

    def reverse(self, z: torch.Tensor) -> torch.Tensor:
        inverse = self._inverse
        if inverse is None:
            w = self.conv.weight.squeeze(-1)
            inverse = torch.linalg.inv(w.double()).to(w.dtype).unsqueeze(-1)
        return F.conv1d(z, inverse)


class WN(nn.Module):
    """WaveNet-like block: dilated gated convolutions conditioned on the mel, summed skips.

    Its output is the log-scale and shift of the affine coupling layer.
    """

    def __init__(self, n_in: int, n_cond: int, cfg: WaveGlowConfig) -> None:
        super().__init__()
        c = cfg.n_channels
        self.n_channels = c
        self.start = WeightNormConv1d(n_in, c)
        self.end = nn.Conv1d(c, 2 * n_in, 1)
        self.in_layers = nn.ModuleList(
            WeightNormConv1d(c, 2 * c, cfg.kernel_size, dilation=2**i) for i in range(cfg.n_layers)
        )
        self.cond_layers = nn.ModuleList(
            WeightNormConv1d(n_cond, 2 * c) for _ in range(cfg.n_layers)
        )
        self.res_skip_layers = nn.ModuleList(
            WeightNormConv1d(c, 2 * c if i < cfg.n_layers - 1 else c) for i in range(cfg.n_layers)
        )

    def forward(self, audio: torch.Tensor, spect: torch.Tensor) -> torch.Tensor:
        c = self.n_channels
        x = self.start(audio)
        output = torch.zeros_like(x)
        last = len(self.in_layers) - 1
        for i, (inner, cond, res_skip) in enumerate(
            zip(self.in_layers, self.cond_layers, self.res_skip_layers, strict=True)
        ):
            z = inner(x) + cond(spect)
            acts = res_skip(torch.tanh(z[:, :c]) * torch.sigmoid(z[:, c:]))
            if i < last:
                x = x + acts[:, :c]
                output = output + acts[:, c:]
            else:
                output = output + acts
        return self.end(output)


class WaveGlow(nn.Module):
    """Mel spectrogram in, waveform out; see :meth:`infer`."""

    def __init__(self, cfg: WaveGlowConfig) -> None:
        super().__init__()
        if cfg.n_group % 2 or cfg.n_early_size % 2:
            raise ValueError(f"n_group and n_early_size must be even, got {cfg}")
        self.cfg = cfg
        self.upsample = nn.ConvTranspose1d(
            cfg.n_mel_channels, cfg.n_mel_channels, cfg.upsample_kernel, stride=cfg.hop_length
        )
        self.WN = nn.ModuleList()
        self.convinv = nn.ModuleList()
        remaining = cfg.n_group
        for k in range(cfg.n_flows):
            if k > 0 and k % cfg.n_early_every == 0:
                remaining -= cfg.n_early_size
            self.convinv.append(Invertible1x1Conv(remaining))
            self.WN.append(WN(remaining // 2, cfg.n_mel_channels * cfg.n_group, cfg))
        self.n_remaining_channels = remaining

    def prepare_for_inference(self) -> WaveGlow:
        """Fold weight norm and invert the 1x1 convolutions; call after ``.to(device)``."""
        for module in self.modules():
            if isinstance(module, WeightNormConv1d):
                module.fold()
            elif isinstance(module, Invertible1x1Conv):
                module.prepare()
        return self.eval()

    def _upsample(self, mel: torch.Tensor) -> torch.Tensor:
        """``self.upsample(mel)`` cut to ``hop_length`` samples per frame, as one matmul.

        Same numbers as the transposed convolution; on CPU, oneDNN builds a new kernel for every
        input length of that layer (over a second each, measured), which a server that sees a
        new length on almost every request cannot afford. The overhang of (kernel - stride)
        samples is dropped, as the recipe does.
        """
        batch, _, frames = mel.shape
        weight, hop = self.upsample.weight, self.cfg.hop_length
        kernel = weight.size(2)
        columns = torch.einsum("bct,cok->bokt", mel, weight).reshape(batch, -1, frames)
        out = F.fold(
            columns, (1, (frames - 1) * hop + kernel), kernel_size=(1, kernel), stride=(1, hop)
        )
        out = out.view(batch, weight.size(1), -1)[:, :, : frames * hop]
        return out + self.upsample.bias[:, None]

    def infer(
        self, mel: torch.Tensor, sigma: float = 0.666, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Audio (B, frames * hop_length) in [-1, 1]-ish floats for ``mel`` (B, n_mel, frames)."""
        cfg = self.cfg
        spect = self._upsample(mel)
        batch, groups = spect.size(0), spect.size(2) // cfg.n_group
        spect = spect.unfold(2, cfg.n_group, cfg.n_group).permute(0, 2, 1, 3)
        spect = spect.reshape(batch, groups, -1).transpose(1, 2)

        def noise(channels: int) -> torch.Tensor:
            shape = (batch, channels, groups)
            z = torch.randn(shape, generator=generator, device=mel.device, dtype=mel.dtype)
            return sigma * z

        audio = noise(self.n_remaining_channels)
        for k in reversed(range(cfg.n_flows)):
            half = audio.size(1) // 2
            a0, a1 = audio[:, :half], audio[:, half:]
            out = self.WN[k](a0, spect)
            log_s, shift = out[:, half:], out[:, :half]
            audio = torch.cat((a0, (a1 - shift) * torch.exp(-log_s)), dim=1)
            audio = self.convinv[k].reverse(audio)
            if k > 0 and k % cfg.n_early_every == 0:
                audio = torch.cat((noise(cfg.n_early_size), audio), dim=1)
        return audio.permute(0, 2, 1).reshape(batch, -1)


class Denoiser:
    """Removes the vocoder's own hiss: subtracts the spectrum WaveGlow makes for a flat mel.

    The bias spectrum is computed once (zero mel, ``sigma`` 0, so it is deterministic);
    ``strength`` scales how much of it is taken off every frame's magnitude.
    """

    def __init__(self, waveglow: WaveGlow, n_fft: int = 1024, hop_length: int = 256) -> None:
        self.n_fft, self.hop_length = n_fft, hop_length
        device = waveglow.upsample.weight.device
        self.window = torch.hann_window(n_fft, device=device)
        with torch.inference_mode():
            mel = torch.zeros(1, waveglow.cfg.n_mel_channels, 88, device=device)
            bias_audio = waveglow.infer(mel, sigma=0.0)
            self.bias = self._stft(bias_audio).abs()[:, :, :1]

    def _stft(self, audio: torch.Tensor) -> torch.Tensor:
        return torch.stft(
            audio, self.n_fft, self.hop_length, window=self.window, return_complex=True
        )

    def __call__(self, audio: torch.Tensor, strength: float) -> torch.Tensor:
        length = audio.size(-1)
        if length <= self.n_fft // 2:  # too short for the STFT's reflect padding: pad with zeros
            audio = F.pad(audio, (0, self.n_fft - length))
        spec = self._stft(audio)
        magnitude = (spec.abs() - self.bias * strength).clamp(min=0.0)
        cleaned = torch.polar(magnitude, spec.angle())
        cleaned_audio = torch.istft(
            cleaned, self.n_fft, self.hop_length, window=self.window, length=audio.size(-1)
        )
        return cleaned_audio[..., :length]

"""Tacotron 2 (Shen et al., 2018): a sequence of text symbols in, an 80-band mel spectrogram out.

Written for this example from the published architecture: a convolutional + bidirectional LSTM
encoder, location-sensitive attention, an autoregressive LSTM decoder fed through a prenet, a stop
gate, and a convolutional postnet. Module and parameter names follow NVIDIA's DeepLearningExamples
implementation, so that the checkpoints NVIDIA publishes (``nvidia_tacotron2pyt_fp32_*.pth``)
load into it with a strict ``load_state_dict``; :meth:`Tacotron2Config.from_state_dict` reads the
sizes back from a checkpoint's tensor shapes, so any width loads without a separate config.

Inference is batched: texts of different lengths are padded, padding never leaks into another
item's result (masked convolutions, packed LSTM, masked attention, a prenet dropout mask shared by
the batch), and every item stops on its own gate or its own step bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# log(1e-5): the mel value of silence in the recipe's log-mel scale, used for padded frames.
SILENCE = -11.5129


@dataclass(frozen=True)
class Tacotron2Config:
    """Sizes of the network. The defaults are the published model's."""

    n_symbols: int = 148
    symbols_embedding_dim: int = 512
    encoder_n_convolutions: int = 3
    encoder_kernel_size: int = 5
    encoder_embedding_dim: int = 512
    n_mel_channels: int = 80
    n_frames_per_step: int = 1
    prenet_dim: int = 256
    attention_rnn_dim: int = 1024
    decoder_rnn_dim: int = 1024
    attention_dim: int = 128
    attention_location_n_filters: int = 32
    attention_location_kernel_size: int = 31
    postnet_embedding_dim: int = 512
    postnet_kernel_size: int = 5
    postnet_n_convolutions: int = 5

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> Tacotron2Config:
        """Read every size from tensor shapes (keys without a ``module.`` prefix).

        Checkpoints then describe themselves: the handler needs no per-checkpoint config, and a
        mismatch shows up as a strict-load error naming the tensor instead of garbage audio.
        """
        embedding = state["embedding.weight"]
        first_conv = state["encoder.convolutions.0.0.conv.weight"]
        location = state["decoder.attention_layer.location_layer.location_conv.conv.weight"]
        postnet_first = state["postnet.convolutions.0.0.conv.weight"]
        n_mel = int(postnet_first.shape[1])
        return cls(
            n_symbols=int(embedding.shape[0]),
            symbols_embedding_dim=int(embedding.shape[1]),
            encoder_n_convolutions=_count(state, "encoder.convolutions.{}.0.conv.weight"),
            encoder_kernel_size=int(first_conv.shape[2]),
            encoder_embedding_dim=int(first_conv.shape[0]),
            n_mel_channels=n_mel,
            n_frames_per_step=int(state["decoder.linear_projection.linear_layer.weight"].shape[0])
            // n_mel,
            prenet_dim=int(state["decoder.prenet.layers.0.linear_layer.weight"].shape[0]),
            attention_rnn_dim=int(state["decoder.attention_rnn.weight_hh"].shape[1]),
            decoder_rnn_dim=int(state["decoder.decoder_rnn.weight_hh"].shape[1]),
            attention_dim=int(
                state["decoder.attention_layer.query_layer.linear_layer.weight"].shape[0]
            ),
            attention_location_n_filters=int(location.shape[0]),
            attention_location_kernel_size=int(location.shape[2]),
            postnet_embedding_dim=int(postnet_first.shape[0]),
            postnet_kernel_size=int(postnet_first.shape[2]),
            postnet_n_convolutions=_count(state, "postnet.convolutions.{}.0.conv.weight"),
        )


def _count(state: Mapping[str, torch.Tensor], pattern: str) -> int:
    n = 0
    while pattern.format(n) in state:
        n += 1
    return n


class LinearNorm(nn.Module):
    """A linear layer under the attribute name (``linear_layer``) the checkpoints use."""

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.linear_layer = nn.Linear(in_dim, out_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_layer(x)


class ConvNorm(nn.Module):
    """A same-length 1-d convolution under the attribute name (``conv``) the checkpoints use."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, bias: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel_size, padding=(kernel_size - 1) // 2, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _conv_bn(in_ch: int, out_ch: int, kernel_size: int) -> nn.Sequential:
    return nn.Sequential(ConvNorm(in_ch, out_ch, kernel_size), nn.BatchNorm1d(out_ch))


def padding_mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """``(B, size)`` boolean, True on positions past each item's length."""
    positions = torch.arange(size, device=lengths.device)
    return positions[None, :] >= lengths[:, None]


class Encoder(nn.Module):
    """Three convolutions then a bidirectional LSTM over the symbol embeddings."""

    def __init__(self, cfg: Tacotron2Config) -> None:
        super().__init__()
        dim = cfg.encoder_embedding_dim
        self.convolutions = nn.ModuleList(
            _conv_bn(cfg.symbols_embedding_dim if i == 0 else dim, dim, cfg.encoder_kernel_size)
            for i in range(cfg.encoder_n_convolutions)
        )
        self.lstm = nn.LSTM(dim, dim // 2, 1, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``x``: (B, dim, T) embeddings; returns (B, T, dim), zero past each length.

        Padded positions are zeroed before every convolution so an item sees exactly the zero
        padding it would see alone, whatever its neighbours in the batch are.
        """
        keep = (~padding_mask(lengths, x.size(2))).unsqueeze(1).to(x.dtype)
        for conv in self.convolutions:
            x = F.relu(conv(x * keep))
        packed = nn.utils.rnn.pack_padded_sequence(
            (x * keep).transpose(1, 2), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        outputs, _ = self.lstm(packed)
        outputs, _ = nn.utils.rnn.pad_packed_sequence(
            outputs, batch_first=True, total_length=x.size(2)
        )
        return outputs


class LocationLayer(nn.Module):
    """Features of where attention was (previous and cumulative weights), for the next step."""

    def __init__(self, n_filters: int, kernel_size: int, attention_dim: int) -> None:
        super().__init__()
        self.location_conv = ConvNorm(2, n_filters, kernel_size, bias=False)
        self.location_dense = LinearNorm(n_filters, attention_dim, bias=False)

    def forward(self, weights_cat: torch.Tensor) -> torch.Tensor:
        return self.location_dense(self.location_conv(weights_cat).transpose(1, 2))


class Attention(nn.Module):
    """Location-sensitive additive attention over the encoder outputs."""

    def __init__(self, cfg: Tacotron2Config) -> None:
        super().__init__()
        dim = cfg.attention_dim
        self.query_layer = LinearNorm(cfg.attention_rnn_dim, dim, bias=False)
        self.memory_layer = LinearNorm(cfg.encoder_embedding_dim, dim, bias=False)
        self.v = LinearNorm(dim, 1, bias=False)
        self.location_layer = LocationLayer(
            cfg.attention_location_n_filters, cfg.attention_location_kernel_size, dim
        )

    def forward(
        self,
        query: torch.Tensor,
        memory: torch.Tensor,
        processed_memory: torch.Tensor,
        weights_cat: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        energies = self.v(
            torch.tanh(
                self.query_layer(query.unsqueeze(1))
                + self.location_layer(weights_cat)
                + processed_memory
            )
        ).squeeze(-1)
        weights = F.softmax(energies.masked_fill(mask, float("-inf")), dim=1)
        context = torch.bmm(weights.unsqueeze(1), memory).squeeze(1)
        return context, weights


class Prenet(nn.Module):
    """Two ReLU layers with dropout that stays on at inference, as the model was trained.

    The recipe's decoder depends on that noise; one mask per step is shared by the whole batch
    and drawn from the caller's generator, so results are reproducible and batch-independent.
    """

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [LinearNorm(in_dim, dim, bias=False), LinearNorm(dim, dim, bias=False)]
        )

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        for linear in self.layers:
            x = F.relu(linear(x))
            keep = torch.rand((1, x.size(1)), generator=generator, device=x.device) < 0.5
            x = x * keep.to(x.dtype) * 2.0
        return x


class Decoder(nn.Module):
    """Autoregressive decoder: prenet, attention LSTM, attention, decoder LSTM, frame + gate."""

    def __init__(self, cfg: Tacotron2Config) -> None:
        super().__init__()
        self.cfg = cfg
        frame = cfg.n_mel_channels * cfg.n_frames_per_step
        enc = cfg.encoder_embedding_dim
        self.prenet = Prenet(frame, cfg.prenet_dim)
        self.attention_rnn = nn.LSTMCell(cfg.prenet_dim + enc, cfg.attention_rnn_dim)
        self.attention_layer = Attention(cfg)
        self.decoder_rnn = nn.LSTMCell(cfg.attention_rnn_dim + enc, cfg.decoder_rnn_dim)
        self.linear_projection = LinearNorm(cfg.decoder_rnn_dim + enc, frame)
        self.gate_layer = LinearNorm(cfg.decoder_rnn_dim + enc, 1)

    def infer(
        self,
        memory: torch.Tensor,
        lengths: torch.Tensor,
        max_steps: torch.Tensor,
        gate_threshold: float,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode until every item's gate fires or it reaches its own ``max_steps``.

        Returns frames (B, steps, n_mel * n_frames_per_step) and each item's step count. As in the
        recipe, the step on which the gate fires is not counted.
        """
        cfg, batch = self.cfg, memory.size(0)
        zeros = memory.new_zeros
        frame = zeros(batch, cfg.n_mel_channels * cfg.n_frames_per_step)
        att_h, att_c = zeros(batch, cfg.attention_rnn_dim), zeros(batch, cfg.attention_rnn_dim)
        dec_h, dec_c = zeros(batch, cfg.decoder_rnn_dim), zeros(batch, cfg.decoder_rnn_dim)
        weights, weights_cum = zeros(batch, memory.size(1)), zeros(batch, memory.size(1))
        context = zeros(batch, cfg.encoder_embedding_dim)
        processed = self.attention_layer.memory_layer(memory)
        mask = padding_mask(lengths, memory.size(1))
        steps = torch.zeros(batch, dtype=torch.long, device=memory.device)
        running = torch.ones(batch, dtype=torch.bool, device=memory.device)
        frames = []
        for step in range(int(max_steps.max())):
            x = self.prenet(frame, generator)
            att_h, att_c = self.attention_rnn(torch.cat((x, context), -1), (att_h, att_c))
            weights_cat = torch.stack((weights, weights_cum), dim=1)
            context, weights = self.attention_layer(att_h, memory, processed, weights_cat, mask)
            weights_cum = weights_cum + weights
            dec_h, dec_c = self.decoder_rnn(torch.cat((att_h, context), -1), (dec_h, dec_c))
            out = torch.cat((dec_h, context), dim=1)
            frame = self.linear_projection(out)
            frames.append(frame)
            gate = torch.sigmoid(self.gate_layer(out)).squeeze(1)
            running = running & (gate <= gate_threshold)
            steps += running.long()
            running = running & (step + 1 < max_steps)
            if not bool(running.any()):
                break
        return torch.stack(frames, dim=1), steps


class Postnet(nn.Module):
    """Five convolutions that predict a residual correction of the decoder's mel frames."""

    def __init__(self, cfg: Tacotron2Config) -> None:
        super().__init__()
        n, dim, mel = cfg.postnet_n_convolutions, cfg.postnet_embedding_dim, cfg.n_mel_channels
        k = cfg.postnet_kernel_size
        self.convolutions = nn.ModuleList(
            _conv_bn(mel if i == 0 else dim, mel if i == n - 1 else dim, k) for i in range(n)
        )

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` (B, 1, frames) is 1 on real frames: zeroing the rest before each layer gives
        every item the zero padding it would get alone."""
        for conv in self.convolutions[:-1]:
            x = torch.tanh(conv(x * keep))
        return self.convolutions[-1](x * keep)


class Tacotron2(nn.Module):
    """Symbols in, mel spectrogram out; see :meth:`infer`."""

    def __init__(self, cfg: Tacotron2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.n_symbols, cfg.symbols_embedding_dim)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.postnet = Postnet(cfg)

    def infer(
        self,
        symbols: torch.Tensor,
        lengths: torch.Tensor,
        max_steps: torch.Tensor,
        gate_threshold: float = 0.5,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel spectrograms for a padded batch of symbol ids.

        ``symbols``: (B, T) ids, ``lengths``: (B,) real lengths, ``max_steps``: (B,) decoder step
        bound per item (a model that never fires its gate still ends). Returns ``mel`` (B, n_mel,
        frames), padded past each item's length with :data:`SILENCE`, and ``mel_lengths`` (B,).
        """
        embedded = self.embedding(symbols).transpose(1, 2)
        memory = self.encoder(embedded, lengths)
        frames, steps = self.decoder.infer(memory, lengths, max_steps, gate_threshold, generator)
        batch, n_mel = frames.size(0), self.cfg.n_mel_channels
        mel = frames.reshape(batch, -1, n_mel).transpose(1, 2)
        # A gate that fires on the very first step would leave nothing to vocode: keep one frame.
        mel_lengths = steps.clamp(min=1) * self.cfg.n_frames_per_step
        pad = padding_mask(mel_lengths, mel.size(2)).unsqueeze(1)
        mel = mel + self.postnet(mel, (~pad).to(mel.dtype))
        return mel.masked_fill(pad, SILENCE), mel_lengths

"""A tiny decoder-only transformer over bytes, with a KV cache: small enough to load and
generate fast on a CPU, shaped like the real thing (token and position embeddings, pre-norm
blocks of causal self-attention and an MLP, a language-model head).

The tokenizer is byte-level: token ``b`` is byte ``b`` of the UTF-8 text, plus ``BOS`` and
``EOS``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BOS, EOS = 256, 257
VOCAB = 258
CONTEXT = 256  # positions: prompt and answer together
DIM, LAYERS, HEADS = 64, 2, 4

# One request's cache: per layer, (keys, values), each [1, HEADS, length, DIM // HEADS].
Cache = list[tuple[torch.Tensor, torch.Tensor]]


def encode(text: str) -> list[int]:
    return [BOS, *text.encode("utf-8")]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(DIM, dim=2)
        q, k, v = (z.view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
        if past is not None:
            k = torch.cat((past[0], k), dim=2)
            v = torch.cat((past[1], v), dim=2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + self.out(att.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.norm2(x)), (k, v)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(CONTEXT, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, past: Cache | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, Cache]:  # fmt: skip
        """Logits [B, T, VOCAB] of ``tokens`` [B, T] at ``positions`` [B, T], attending where
        ``mask`` [B, T, past + T] is True; the cache grown by the T new positions."""
        x = self.embed(tokens) + self.pos(positions)
        cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past is None else past[i], mask)
            cache.append(kv)
        return self.head(self.norm(x)), cache

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, Cache]:
        """One request's prompt: the logits of its next token [VOCAB], and its cache."""
        t = len(ids)
        tokens = torch.tensor([ids])
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
        logits, cache = self(tokens, torch.arange(t)[None], None, mask)
        return logits[0, -1], cache

    @torch.no_grad()
    def decode(self, tokens: list[int], caches: list[Cache]) -> tuple[torch.Tensor, list[Cache]]:
        """One step for a batch of requests at different lengths: each one's next token in,
        the logits [B, VOCAB] of the one after and each cache one longer. The caches are
        left-padded to the longest and the padding masked out."""
        lengths = [c[0][0].shape[2] for c in caches]
        longest = max(lengths)
        past = []
        for layer in range(LAYERS):
            ks, vs = [], []
            for cache, n in zip(caches, lengths, strict=True):
                k, v = cache[layer]
                pad = (0, 0, longest - n, 0)
                ks.append(F.pad(k, pad))
                vs.append(F.pad(v, pad))
            past.append((torch.cat(ks), torch.cat(vs)))
        mask = torch.ones(len(caches), 1, longest + 1, dtype=torch.bool)
        for i, n in enumerate(lengths):
            mask[i, 0, : longest - n] = False
        logits, grown = self(
            torch.tensor(tokens)[:, None], torch.tensor(lengths)[:, None], past, mask
        )
        out = [
            [(k[i : i + 1, :, longest - n :], v[i : i + 1, :, longest - n :]) for k, v in grown]
            for i, n in enumerate(lengths)
        ]
        return logits[:, -1], out


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> int:
    """The next token: greedy at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))

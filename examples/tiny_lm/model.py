"""A tiny decoder-only transformer over bytes: small enough to load and generate fast on a CPU,
shaped like the real thing (token and position embeddings, pre-norm blocks of causal
self-attention and an MLP, a language-model head) and served like one: a batched KV cache of
slots, one slot per request, allocated once; a batched prefill of several prompts in one
forward; a decode step for any set of slots in one forward whose number of kernels does not
depend on how many requests it holds (as vLLM's, HF's static cache and TensorRT-LLM's do: why
batching more requests per step pays off); batched sampling.

The tokenizer is byte-level: token ``b`` is byte ``b`` of the UTF-8 text, plus ``BOS`` and
``EOS``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

BOS, EOS = 256, 257
VOCAB = 258
CONTEXT = 256  # positions: prompt and answer together
DIM, LAYERS = 64, 2  # the example's size (make_weights.py can make a bigger one)
HEAD_DIM = 16  # heads = dim // HEAD_DIM: 4 at the example's size


def encode(text: str) -> list[int]:
    return [BOS, *text.encode("utf-8")]


class KVCache:
    """Keys and values of up to ``slots`` requests, per layer ``[slots, heads, CONTEXT,
    head_dim]``: allocated once, so that a step writes into it and reads from it in place
    instead of growing a tensor per request. Zeroed: positions past a request's length are
    masked out, and a masked zero adds nothing (a masked NaN would)."""

    def __init__(
        self, layers: int, heads: int, head_dim: int, slots: int, device: torch.device
    ) -> None:
        shape = (slots, heads, CONTEXT, head_dim)
        self.keys = [torch.zeros(shape, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, device=device) for _ in range(layers)]

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    def grow(self, slots: int) -> None:
        """Room for ``slots`` requests, the ones held kept (only when more are asked for)."""
        if slots <= self.slots:
            return
        for kind in (self.keys, self.values):
            for i, old in enumerate(kind):
                kind[i] = torch.cat((old, old.new_zeros((slots - old.shape[0], *old.shape[1:]))))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
        slots: torch.Tensor, positions: torch.Tensor | None, span: int,
        rows: torch.Tensor | slice,
    ) -> torch.Tensor:  # fmt: skip
        """``x`` [B, T, dim] of the requests in ``slots``: a prefill of positions ``0..T-1``
        (``positions`` None), or one decode position each (``positions`` [B]); attends over
        the first ``span`` positions of the slots (read as ``rows``: a slice where the slots
        are contiguous, a view, else the slots gathered) where ``mask`` allows."""
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(self.dim, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        if positions is None:  # prefill: attend over the prompts' own keys, keep them
            keys[slots, :, :t] = k
            values[slots, :, :t] = v
        else:  # decode: the new position written in place, the slots' first span read back
            keys[slots, :, positions] = k[:, :, 0]
            values[slots, :, positions] = v[:, :, 0]
            k, v = keys[rows, :, :span], values[rows, :, :span]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, self.dim))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, dim: int = DIM, layers: int = LAYERS) -> None:
        super().__init__()
        if dim % HEAD_DIM:
            raise ValueError(f"the model's width must be a multiple of {HEAD_DIM}, not {dim}")
        self.heads = dim // HEAD_DIM
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(CONTEXT, dim)
        self.blocks = nn.ModuleList(Block(dim, self.heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    @property
    def device(self) -> torch.device:
        """Where the weights are: the cache and every step's inputs are made there."""
        return self.head.weight.device

    def new_cache(self, slots: int) -> KVCache:
        return KVCache(len(self.blocks), self.heads, HEAD_DIM, slots, self.device)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], slots: list[int], cache: KVCache) -> torch.Tensor:
        """Several new requests in one forward: each prompt's keys and values written into its
        slot, the logits of each one's next token out [B, VOCAB]. The prompts are right-padded
        to the longest; the mask is causal and hides the padding."""
        device = self.device
        sizes = [len(p) for p in prompts]
        t = max(sizes)
        lengths = torch.tensor(sizes, device=device)
        tokens = torch.tensor([p + [EOS] * (t - len(p)) for p in prompts], device=device)
        steps = torch.arange(t, device=device)
        mask = (steps[None, :, None] >= steps[None, None, :]) & (
            steps[None, None, :] < lengths[:, None, None]
        )  # [B, query, key]: causal, and no key past the prompt's end
        x = self.embed(tokens) + self.pos(steps)[None]
        where = torch.tensor(slots, device=device)
        for i, block in enumerate(self.blocks):
            x = block(x, mask[:, None], cache.keys[i], cache.values[i], where, None, t, where)
        last = x[torch.arange(len(prompts), device=device), lengths - 1]
        return self.head(self.norm(last))

    @torch.no_grad()
    def decode(
        self, tokens: list[int], slots: list[int], positions: list[int], cache: KVCache
    ) -> torch.Tensor:
        """One step for the requests in ``slots``: each one's next token in at its position
        (its length so far), its keys and values written into its slot, the logits of the
        token after out [B, VOCAB]. The same kernels whatever the batch holds: each layer
        attends over the first ``max(positions) + 1`` positions of the slots, a mask built
        from the positions hiding what lies past each one's length. Slots in ascending
        contiguous order are read in place (at 32 requests a step costs ~half what gathering
        them does); any others are gathered."""
        device = self.device
        where = torch.tensor(slots, device=device)
        at = torch.tensor(positions, device=device)
        first = slots[0]
        contiguous = slots == list(range(first, first + len(slots)))
        rows: torch.Tensor | slice = slice(first, first + len(slots)) if contiguous else where
        span = max(positions) + 1
        mask = (torch.arange(span, device=device)[None] <= at[:, None])[:, None, None]
        x = (self.embed(torch.tensor(tokens, device=device)) + self.pos(at))[:, None]
        for i, block in enumerate(self.blocks):
            x = block(x, mask, cache.keys[i], cache.values[i], where, at, span, rows)
        return self.head(self.norm(x[:, 0]))


def load(path: str | Path, device: str | torch.device = "cpu") -> TinyLM:
    """The model in the weights at ``path`` on ``device``, its width and depth read from them."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    dim = state["embed.weight"].shape[1]
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    model = TinyLM(dim, layers)
    model.load_state_dict(state)
    return model.to(device).eval()


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """Each row's next token [B] from ``logits`` [B, VOCAB], in the same few kernels whatever
    the batch holds: greedy where ``temperature`` is 0, else nucleus sampling at the row's
    ``temperature`` and ``top_p``, picked by inverse CDF at the row's ``uniform`` draw in
    [0, 1) (drawn from each request's own generator, so that a seeded request gets the same
    tokens whoever shares its steps)."""
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / scale[:, None], dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    cdf = ranked.cumsum(dim=-1)
    limit = torch.where(top_p < 1, top_p, torch.full_like(top_p, float("inf")))  # 1: all
    kept = torch.where(cdf - ranked < limit[:, None], ranked, torch.zeros_like(ranked))
    cdf = kept.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).clamp_(max=VOCAB - 1)
    return torch.where(greedy, logits.argmax(dim=-1), order.gather(1, pick)[:, 0])

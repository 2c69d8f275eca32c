"""A GPT-style causal language model (after nanoGPT) whose attention goes through orchard.

The model itself calls torch.nn.functional.scaled_dot_product_attention, so it is a plain
PyTorch model; orchard.torch.patch_model (which the trainer always applies) routes those calls
to orchard's kernels. Keeping the call standard is what lets the tests compare the patched
model with the unpatched one.

Generation keeps a KVCache: the prompt is prefilled once, then every step feeds one token,
whose attention reads the cached keys and values of all the tokens before it.
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 256
    context: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False

    @classmethod
    def from_dict(cls, model_cfg):
        return cls(**{f.name: model_cfg[f.name] for f in fields(cls)})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # Fewer key/value heads than query heads is grouped-query attention (orchard does GQA).
        self.kv_proj = nn.Linear(cfg.n_embd, 2 * cfg.n_kv_head * self.head_dim, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cache=None):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(B, T, 2, self.n_kv_head, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        causal = True
        if cache is not None:
            # This layer's buffers (B, n_kv_head, size, head_dim): the new keys and values go
            # in place after the cached ones, and attention reads views of all of them.
            k_buf, v_buf, start = cache
            k_buf[:, :, start:start + T] = k
            v_buf[:, :, start:start + T] = v
            k, v = k_buf[:, :, :start + T], v_buf[:, :, :start + T]
            # GPT.forward allows a prefill of an empty cache (Nq == Nk: causal) or one new
            # token, the last position, which sees every key: no mask, so torch's top-left and
            # orchard's bottom-right alignments agree and the call routes to orchard.
            causal = T > 1
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=causal,
            enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """The keys and values of every layer for one generation, preallocated to `size`
    positions (at most the model's context): (n_layer, batch, n_kv_head, size, head_dim)
    each. `length` positions are filled; GPT.forward(idx, cache=...) writes its tokens
    after them."""

    def __init__(self, cfg, batch, size, dtype=torch.float32, device=None):
        if not 1 <= size <= cfg.context:
            raise ValueError("KVCache: 'size' must be in [1, %d] (the model's context), got %d"
                             % (cfg.context, size))
        shape = (cfg.n_layer, batch, cfg.n_kv_head, size, cfg.n_embd // cfg.n_head)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.size = size
        self.length = 0

    def layer(self, i):
        return self.k[i], self.v[i], self.length


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.grad_checkpointing = False
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.context, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream keeps its variance
        # independent of depth.
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, cache=None):
        """(logits, loss or None). With a KVCache, idx continues the cached tokens: a prompt
        into an empty cache, or one token at a time after it."""
        T = idx.shape[1]
        start = 0 if cache is None else cache.length
        if cache is not None and start and T != 1:
            raise ValueError("a cache holding %d tokens takes one new token per forward, got %d"
                             % (start, T))
        limit = self.cfg.context if cache is None else cache.size
        if start + T > limit:
            raise ValueError("sequence of length %d is longer than the %s %d" % (
                start + T, "model's context" if cache is None else "cache's size", limit))
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for i, block in enumerate(self.blocks):
            if cache is not None:
                x = block(x, cache.layer(i))
            elif self.grad_checkpointing and self.training:
                # Keep only each block's input; recompute the block in backward.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if cache is not None:
            cache.length += T
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @property
    def context(self):
        return self.cfg.context

    def new_cache(self, batch, size):
        return KVCache(self.cfg, batch, size, dtype=self.wte.weight.dtype,
                       device=self.wte.weight.device)

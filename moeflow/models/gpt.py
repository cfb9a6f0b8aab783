"""A decoder-only MoE language model you can read on one screen (legend below).

Llama/Mixtral-style blocks (``moeflow.models.blocks``): RMSNorm, rotary position embeddings,
grouped-query or multi-head latent attention (DeepSeek's: ``moeflow.models.mla``), gated FFNs.
Every ``moe_every``-th block (fairseq's ``moe_freq``: block ``i`` is MoE when ``(i + 1) %
moe_every == 0``) replaces its FFN with a ``moeflow.MoE`` layer; ``moe_every=1`` makes every
block MoE (Mixtral), 0 makes a dense model. Its shape is a
``GPTConfig`` (``moeflow.models.gpt_config``, with the presets). Parameter names follow Hugging
Face's Llama/Mixtral naming where there is one (``q_proj``, ``o_proj``), which keeps
``moeflow.convert.mixtral`` (Mixtral import/export) a table of renames.

Legend: ``B`` batch, ``S`` sequence length, ``D`` model dim, ``V`` vocabulary, ``N`` heads,
``G`` key/value heads, ``Hd`` head dim, ``T = B*S`` tokens seen by the MoE layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.config import _int
from moeflow.models.blocks import Block, RMSNorm
from moeflow.models.generation import generate_tensor
from moeflow.models.gpt_config import GPT_PRESETS, GPTConfig, gpt_config
from moeflow.models.kv_cache import KVCache, static_step, step_inputs
from moeflow.models.rope import rope_cos_sin

# (GPTConfig, the presets and RMSNorm are re-exported: importers use this module)
__all__ = ["GPTConfig", "MoEGPT", "RMSNorm", "GPT_PRESETS", "gpt_config"]


def _refuse_unbuilt(config: GPTConfig) -> None:
    """``ValueError`` naming a configured attention option this decoder does not build (never
    silently ignored): latent attention with ``n_kv_heads`` other than ``n_heads`` (its keys and
    values have one head per query head, expanded from the shared latent)."""
    c = config
    if c.attention.kind == "mla" and c.n_kv_heads not in (None, c.n_heads):
        raise ValueError(f"attention.kind='mla' has a key/value head per query head: n_kv_heads={c.n_kv_heads} "
                         f"must be None or n_heads={c.n_heads}")


class MoEGPT(nn.Module):
    """Decoder-only MoE language model: ``logits [B, S, V] = model(idx [B, S])``.

    ``model.loss(idx, targets)`` is the mean next-token cross-entropy (fp32); add
    ``moeflow.aux_loss(model)`` for the balance losses of the same call.
    """

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        _refuse_unbuilt(config)
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.embed = nn.Embedding(config.vocab_size, config.dim, **kw)
        self.layers = nn.ModuleList(Block(config, config.is_moe_layer(i), layer=i, **kw) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, **kw)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False, **kw)
        self.drop = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()  # no op per call
        self._init_dense(config.init_std)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_dense(self, std: float) -> None:
        # GPT-2's scheme: N(0, std) everywhere, output projections scaled by 1/sqrt(2 * layers)
        # so the residual stream's variance does not grow with depth. Experts init themselves.
        # Every projection of the attention (grouped-query or latent) is drawn in the order its
        # module defines them. Attention biases start at zero, norms at one (their modules' own
        # start) and sinks N(0, std), as transformers starts gpt-oss's.
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=std)
            nn.init.normal_(self.lm_head.weight, std=std)
            for block in self.layers:
                attn = block.attn
                for name, lin in attn.named_children():
                    if isinstance(lin, nn.Linear):
                        out = name == "o_proj"
                        nn.init.normal_(lin.weight, std=std / math.sqrt(2 * self.config.n_layers) if out else std)
                if getattr(attn, "sinks", None) is not None:
                    nn.init.normal_(attn.sinks, std=std)

    def forward(self, idx_BS: torch.Tensor) -> torch.Tensor:
        self._check_idx(idx_BS)
        return self.lm_head(self.hidden_states(idx_BS))

    def _check_idx(self, idx_BS: torch.Tensor) -> None:
        if not isinstance(idx_BS, torch.Tensor) or idx_BS.dtype not in (torch.int64, torch.int32) or idx_BS.dim() != 2:
            raise TypeError(f"idx must be an int64/int32 tensor [batch, seq], got {getattr(idx_BS, 'dtype', type(idx_BS))} "
                            f"{tuple(getattr(idx_BS, 'shape', ()))}")
        if idx_BS.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {idx_BS.shape[1]} exceeds max_seq_len={self.config.max_seq_len}")

    def hidden_states(self, idx_BS: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states ``[B, S, D]`` (what the output projection reads)."""
        x_BSD = self.drop(self.embed(idx_BS))
        for block in self.layers:
            x_BSD = block(x_BSD)
        return self.norm(x_BSD)

    def loss(self, idx_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``targets`` given ``idx`` (computed in at least fp32).

        An output projection with a ``cross_entropy(h_TD, targets_T)`` method (the
        vocabulary-parallel head of ``moeflow.models.vocab_parallel``) computes the per-token
        losses itself, without full logits."""
        head_loss = getattr(self.lm_head, "cross_entropy", None)
        if head_loss is not None:
            self._check_idx(idx_BS)
            return head_loss(self.hidden_states(idx_BS).flatten(0, 1), targets_BS.flatten()).mean()
        logits_BSV = self(idx_BS)
        logits_BSV = logits_BSV.to(torch.promote_types(logits_BSV.dtype, torch.float32))
        return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())

    def new_cache(self, pad_B: torch.Tensor, capacity: int, *, zeroed: bool = False) -> KVCache:
        """An empty ``KVCache`` for ``len(pad_B)`` rows (``pad_B[b]`` left-pad columns in row
        ``b``) and ``capacity <= max_seq_len`` columns, on the model's device and dtype
        (``zeroed``: filled with zeros, as ``decode_step`` needs). Grouped-query attention
        caches keys and values ``[B, G, L, Hd]``; latent attention its latent ``[B, 1, L,
        kv_lora_rank]`` as the "keys" and its rotated key part ``[B, 1, L, qk_rope_head_dim]``
        as the "values" (``moeflow.models.mla``)."""
        _int("capacity", capacity, minimum=1)
        if capacity > self.config.max_seq_len:
            raise ValueError(f"capacity={capacity} exceeds max_seq_len={self.config.max_seq_len}")
        ref, c = self.embed.weight, self.config
        cos, sin = rope_cos_sin(capacity, c.rotary_dim, c.rope_theta, ref.device, ref.dtype, scaling=c.rope_scaling)
        a = c.attention
        slides = any(a.slides(i) for i in range(c.n_layers))
        heads, k_dim, v_dim = (1, a.kv_lora_rank, a.qk_rope_head_dim) if a.kind == "mla" else (
            c.kv_heads, c.head_dim, c.head_dim)
        return KVCache(n_layers=c.n_layers, batch=pad_B.shape[0], kv_heads=heads, k_dim=k_dim,
                       v_dim=v_dim, capacity=capacity, pad_B=pad_B, cos_LR=cos, sin_LR=sin,
                       window=c.attention.sliding_window if slides else None, device=ref.device, dtype=ref.dtype,
                       zeroed=zeroed)

    def forward_cached(self, idx_BS: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[B, V]`` of the last column after appending ``idx [B, S]`` to ``cache``: the
        prompt into an empty cache (prefill; left-pad columns as ``cache.pad_B`` says), a chunk
        of it behind the ``cache.length`` columns filled before (a prompt prefilled in pieces),
        or one token per row (decode). Equal to ``self(whole sequence)[:, -1]`` up to rounding.
        Each block runs its usual layers (the MoE's dispatcher and experts included), on the new
        columns only."""
        self._check_idx(idx_BS)
        if idx_BS.shape[0] != cache.batch:
            raise ValueError(f"idx has {idx_BS.shape[0]} rows but the cache holds {cache.batch}")
        step = step_inputs(cache, idx_BS.shape[1])
        x_BSD = self.drop(self.embed(idx_BS))
        for i, block in enumerate(self.layers):
            x_BSD = block(x_BSD, step, i)
        cache.length += idx_BS.shape[1]
        return self.lm_head(self.norm(x_BSD[:, -1]))

    def decode_step(self, next_B: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[B, V]`` after appending token ``next_B[b]`` to row ``b`` at column ``pos``
        (an int64 device tensor below ``cache.capacity``, the columns before it filled by a
        prefill and earlier steps: 0-dim, the same column in every row, or ``[B]``, row ``b`` at
        column ``pos[b]``, as the decode slots of ``moeflow serve`` hold requests of different
        lengths) of a zeroed cache (``new_cache(..., zeroed=True)``).

        The *static* decode step: its shapes depend on the cache (and the rank of ``pos``) alone
        and nothing in it reads a tensor on the host, so ``torch.compile(fullgraph=True)``
        compiles it once per batch size, cache capacity and rank of ``pos``, and CUDA graphs
        replay it (``generate(..., compile=True)``).
        It attends over all ``L`` columns (the unwritten ones masked): more attention work than
        ``forward_cached`` on a short cache, the price of one shape for every step. Equal to
        ``forward_cached`` up to rounding. The caller advances ``pos``; ``cache.length`` is not
        touched."""
        return self.lm_head(self.decode_hidden(next_B, pos, cache))

    def decode_hidden(self, next_B: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``decode_step`` without the head: the normed last hidden state ``[B, D]`` whose
        ``lm_head`` is the step's logits (the CPU's compiled decoder multiplies the head itself,
        in a layout of its own: ``moeflow.models.packed_dense.HeadProduct``)."""
        step = static_step(cache, pos)
        x_BSD = self.embed(next_B.unsqueeze(1))
        for i, block in enumerate(self.layers):
            x_BSD = block(x_BSD, step, i)
        return self.norm(x_BSD[:, -1])

    def generate(self, idx_BS: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float = 1.0, eos: int | Sequence[int] | None = None,
                 generator: torch.Generator | None = None, use_cache: bool = True, compile: bool = False
                 ) -> torch.Tensor:
        """Append up to ``max_new_tokens`` tokens to each row of ``idx [B, S]``; ``temperature=0``
        is greedy, else sampling from the softmax at ``temperature``, cut to the ``top_k`` most
        likely tokens (None or 0: all) and to the smallest set of mass ``>= top_p``.

        The context of each new token is the last ``max_seq_len`` tokens (longer rows are
        cropped, as a model trained at that length sees them). A row stops after producing a
        token of ``eos``; the result is ``[B, S + n]`` with ``n`` the steps taken, a stopped
        row repeating its stop token to the end. ``use_cache=False`` re-runs the whole
        context per token (the reference of the cached path; same tokens). ``compile=True``
        decodes with the compiled static step (``moeflow.models.compiled_decode``; the same
        tokens up to rounding; not with ``use_cache=False``). One implementation with
        ``moeflow.models.generation.generate``, which also takes ragged prompts and reports
        timings."""
        with torch.no_grad():
            return generate_tensor(self, idx_BS, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                   eos=eos, generator=generator, use_cache=use_cache, compile=compile)

    def num_parameters(self) -> tuple[int, int]:
        """``(total, active per token)``: active counts k of the E experts of each MoE block."""
        total = sum(p.numel() for p in self.parameters())
        expert = sum(p.numel() for p in self.parameters() if getattr(p, "moeflow_expert", False))
        c = self.config
        active = total - expert + (expert * c.top_k // c.num_experts if c.moe_every else 0)
        return total, active

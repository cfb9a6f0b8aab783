"""The decoder blocks of ``MoEGPT`` (legend: ``moeflow.models.gpt``): the pre-norm block around
the attention (``AttentionConfig.kind``: grouped-query, ``moeflow.models.attention``, or
multi-head latent, ``moeflow.models.mla``; whole sequence, cached or static step) and the FFN, a
``moeflow.MoE`` on MoE blocks and a ``DenseFFN`` otherwise. Parameter names follow Hugging
Face's Llama/Mixtral naming (``q_proj``, ``o_proj``) and, for latent attention, issue 47's
design (``q_a_proj``, ``kv_a_proj``, ``kv_b_proj``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from moeflow.experts import DenseFFN
from moeflow.layer import MoE
from moeflow.models.attention import Attention, RMSNorm
from moeflow.models.gpt_config import GPTConfig
from moeflow.models.kv_cache import StaticStep, StepInputs
from moeflow.models.mla import LatentAttention

# (RMSNorm is re-exported: the model's modules import it from here)
__all__ = ["RMSNorm", "Attention", "Block"]


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``; the FFN
    is a ``moeflow.MoE`` on MoE blocks and a ``DenseFFN`` otherwise; the attention an
    ``Attention`` (``kind="gqa"``) or a ``LatentAttention`` (``kind="mla"``). ``layer``: the
    block's index (whether its attention slides)."""

    def __init__(self, config: GPTConfig, moe: bool, *, layer: int, **kw: object) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, **kw)
        self.attn: Attention | LatentAttention
        if config.attention.kind == "mla":
            self.attn = LatentAttention(config, **kw)  # type: ignore[arg-type]
        else:
            self.attn = Attention(config, layer, **kw)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, **kw)
        self.ffn: nn.Module
        if moe:
            self.ffn = MoE(config=config.moe_config(), **kw)  # type: ignore[arg-type]
        else:
            self.ffn = DenseFFN(dim=config.dim, hidden=config.dense_hidden or config.expert_hidden,
                                activation=config.experts.activation, bias=config.experts.bias,
                                init_std=config.init_std, **kw)  # type: ignore[arg-type]
        self.drop = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()  # no op per call

    def forward(self, x_BSD: torch.Tensor, step: StepInputs | StaticStep | None = None, layer: int = 0
                ) -> torch.Tensor:
        """``step`` given: a cached call (generation, ``MoEGPT.forward_cached`` and
        ``decode_step``), whose MoE balance losses nobody reads, so the MoE skips them
        (``MoE.forward(losses=False)``)."""
        x_BSD = x_BSD + self.drop(self.attn(self.attn_norm(x_BSD), step, layer))
        h_BSD = self.ffn_norm(x_BSD)
        if step is None:
            return x_BSD + self.drop(self.ffn(h_BSD))
        ffn = partial(self.ffn, losses=False) if isinstance(self.ffn, MoE) else self.ffn
        if isinstance(step, StaticStep) or step.real_T is None:  # (a decode column is real in every row)
            return x_BSD + self.drop(ffn(h_BSD))
        # left padding: the FFN (the MoE's routing and capacity) sees the real tokens only
        h_TD = h_BSD.reshape(-1, h_BSD.shape[-1])
        y_TD = torch.zeros_like(h_TD).index_copy_(0, step.real_T, ffn(h_TD.index_select(0, step.real_T)))
        return x_BSD + self.drop(y_TD.view_as(x_BSD))

"""A vision MoE (V-MoE / SwinV2-MoE style): a ViT whose MLP blocks are ``moeflow.MoE`` layers.

Images are cut into non-overlapping patches, embedded linearly, given a class token and a
learned position embedding, then run through pre-norm blocks; every ``moe_every``-th block's MLP
is an MoE (V-MoE puts one on every other block). ``router=RouterConfig(kind="cosine")`` gives
SwinV2-MoE's cosine router, and ``DispatchConfig(drop_policy="bpr")`` V-MoE's batch-prioritized
routing.

Legend: ``B`` batch, ``P`` patches (+1 class token), ``D`` model dim, ``Q`` classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.config import DispatchConfig, ExpertsConfig, MoEConfig, RouterConfig, _int
from moeflow.experts import DenseFFN
from moeflow.layer import MoE

__all__ = ["ViTMoEConfig", "VisionMoE"]


@dataclass(frozen=True, kw_only=True)
class ViTMoEConfig:
    """Shape of a ``VisionMoE``; ``image_size`` must be a multiple of ``patch_size``."""

    image_size: int
    patch_size: int
    in_channels: int = 3
    num_classes: int
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_hidden: int = 128
    moe_every: int = 2
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    router: RouterConfig = field(default_factory=RouterConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    activation: str = "gelu"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "in_channels", "num_classes", "dim", "depth", "heads", "mlp_hidden"):
            _int(name, getattr(self, name), minimum=1)
        _int("moe_every", self.moe_every, minimum=0)
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} must be a multiple of patch_size={self.patch_size}")
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} must be divisible by heads={self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.moe_every:
            self.moe_config()

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def moe_config(self) -> MoEConfig:
        return MoEConfig(dim=self.dim, hidden=self.mlp_hidden, num_experts=self.num_experts, top_k=self.top_k,
                         capacity_factor=self.capacity_factor, router=self.router, dispatch=self.dispatch,
                         experts=ExpertsConfig(activation=self.activation, bias=True))  # type: ignore[arg-type]


class _Block(nn.Module):
    def __init__(self, config: ViTMoEConfig, moe: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim)
        self.attn = nn.MultiheadAttention(config.dim, config.heads, dropout=config.dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(config.dim)
        self.mlp: nn.Module = (
            MoE(config=config.moe_config()) if moe
            else DenseFFN(dim=config.dim, hidden=config.mlp_hidden, activation=config.activation, bias=True)
        )

    def forward(self, x_BPD: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x_BPD)
        x_BPD = x_BPD + self.attn(h, h, h, need_weights=False)[0]
        return x_BPD + self.mlp(self.norm2(x_BPD))


class VisionMoE(nn.Module):
    """``logits [B, Q] = model(images [B, C, H, W])``; classification from the class token."""

    def __init__(self, config: ViTMoEConfig) -> None:
        super().__init__()
        if not isinstance(config, ViTMoEConfig):
            raise TypeError(f"config must be a ViTMoEConfig, got {type(config).__name__}")
        self.config = config
        c = config
        self.patch_embed = nn.Linear(c.in_channels * c.patch_size**2, c.dim)
        device = self.patch_embed.weight.device  # torch's default device, as for the layers
        self.cls_token = nn.Parameter(torch.randn(1, 1, c.dim, device=device) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, c.num_patches + 1, c.dim, device=device) * 0.02)
        self.blocks = nn.ModuleList(_Block(c, c.moe_every > 0 and (i + 1) % c.moe_every == 0) for i in range(c.depth))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.num_classes)

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        c = self.config
        if images_BCHW.dim() != 4 or images_BCHW.shape[1:] != (c.in_channels, c.image_size, c.image_size):
            raise ValueError(
                f"images must be [batch, {c.in_channels}, {c.image_size}, {c.image_size}], got {tuple(images_BCHW.shape)}"
            )
        patches = F.unfold(images_BCHW, kernel_size=c.patch_size, stride=c.patch_size).transpose(1, 2)
        x_BPD = self.patch_embed(patches)
        x_BPD = torch.cat([self.cls_token.expand(x_BPD.shape[0], -1, -1), x_BPD], dim=1) + self.pos_embed
        for block in self.blocks:
            x_BPD = block(x_BPD)
        return self.head(self.norm(x_BPD[:, 0]))

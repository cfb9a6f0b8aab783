"""Models built from moeflow layers: a decoder-only MoE GPT and a vision MoE (ViT with MoE MLPs)."""

from moeflow.models.gpt import GPT_PRESETS, GPTConfig, MoEGPT, gpt_config
from moeflow.models.vision import ViTMoEConfig, VisionMoE

__all__ = ["GPTConfig", "MoEGPT", "GPT_PRESETS", "gpt_config", "ViTMoEConfig", "VisionMoE"]

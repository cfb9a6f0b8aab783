"""Models built from moeflow layers: a decoder-only MoE GPT (with KV-cached, batched generation)
and a vision MoE (ViT with MoE MLPs)."""

from moeflow.models.generation import Generation, SamplingConfig, generate
from moeflow.models.gpt import GPT_PRESETS, GPTConfig, MoEGPT, gpt_config
from moeflow.models.kv_cache import KVCache
from moeflow.models.vision import VisionMoE, ViTMoEConfig
from moeflow.models.vocab import VocabParallelEmbedding, VocabParallelHead, vocab_parallel

__all__ = ["GPTConfig", "MoEGPT", "GPT_PRESETS", "gpt_config", "generate", "Generation", "SamplingConfig", "KVCache",
           "ViTMoEConfig", "VisionMoE", "vocab_parallel", "VocabParallelEmbedding", "VocabParallelHead"]

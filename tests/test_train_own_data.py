"""Training on one's own data (``moeflow.train.sources``, ``moeflow.train.prepare``, ``moeflow.train.tokens``,
``moeflow.train.lm_data``, ``moeflow prepare-data``, ``moeflow train --data``): every kind of
source reads as documents and trains; bad data is refused naming the file (and line);
prepared shards hold every document with its end-of-document token and are refused when
damaged or tokenized otherwise; batches depend on the step alone (any world size, prefetched
or not), so a run resumed on 2 gloo ranks, or on another world size, continues with the very
batches of an uninterrupted run; tokenizers of one's own (a ``tokenizer.json``) train, generate
and export."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moeflow.checkpoint import read_index
from moeflow.cli.main import main
from moeflow.train import LMTrainConfig, train_lm
from moeflow.train.data import ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_from_dict
from moeflow.train.sources import DataError, documents
from moeflow.train.prepare import prepare, split_of
from moeflow.train.tokens import Prefetcher, TokenDataset, TokenSampler, TokenStream

from helpers import run_until_checkpoint, spawn_ranks

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- corpora the tests make


def structured_docs(n: int, seed: int = 0) -> list[str]:
    """Documents with structure a small model learns fast (counting, repeated phrases), and
    a little non-ASCII text so UTF-8 matters: nothing like Shakespeare."""
    rng = np.random.default_rng(seed)
    names = ["ada", "bob", "cyd", "dee", "éva", "fen"]
    docs = []
    for i in range(n):
        a = int(rng.integers(0, 50))
        name = names[int(rng.integers(0, len(names)))]
        count = " ".join(str(a + j) for j in range(6))
        docs.append(f"{name} counts: {count}. {name} says done.\nitem {i}: {name} -> {a}\n")
    return docs


def write_source(kind: str, root: Path, docs: list[str]) -> Path:
    """``docs`` as a source of ``kind`` under ``root``; returns the source's path."""
    root.mkdir(parents=True, exist_ok=True)
    if kind == "txt":
        path = root / "book.txt"
        path.write_text(docs[0], encoding="utf-8")
    elif kind == "folder":
        path = root / "texts"
        (path / "nested").mkdir(parents=True)
        (path / ".hidden").mkdir()
        (path / ".hidden" / "skip.txt").write_text("never read", encoding="utf-8")
        (path / "notes.bin").write_bytes(b"\xff\xfe not a data file")
        for i, doc in enumerate(docs):
            (path / ("nested" if i % 2 else ".") / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    elif kind == "jsonl":
        path = root / "docs.jsonl"
        path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    elif kind == "json":
        path = root / "docs.json"
        path.write_text(json.dumps({"rows": [{"body": d} for d in docs]}), encoding="utf-8")
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = root / "docs.parquet"
        pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), path, row_group_size=7)
    elif kind == "datasets":
        import datasets

        path = root / "saved"
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs})}).save_to_disk(str(path))
    else:
        raise AssertionError(kind)
    return path


KINDS = ("txt", "folder", "jsonl", "json", "parquet", "datasets")


def _expected(kind: str, docs: list[str]) -> list[str]:
    if kind == "txt":
        return docs[:1]
    if kind == "folder":  # sorted by path: the top-level files, then nested/
        return [d for i, d in enumerate(docs) if i % 2 == 0] + [d for i, d in enumerate(docs) if i % 2]
    return docs


# --------------------------------------------------------------------------- sources (no model)


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_source_reads_its_documents_in_order(tmp_path, kind: str) -> None:
    docs = structured_docs(12)
    source = write_source(kind, tmp_path, docs)
    got = documents([source], text_field="body")
    assert [d.text for d in got] == _expected(kind, docs)
    assert got.skipped == 0 and got.files  # the files it read, for the log and the index


@pytest.mark.unit
def test_a_dataset_name_from_the_local_cache_reads_offline(tmp_path) -> None:
    """``hf:NAME`` resolves a dataset from the local ``datasets`` cache without the network. The
    cache is made here the way ``load_dataset`` leaves one (a prepared dataset under
    ``NAME___`` in ``HF_DATASETS_CACHE``), then read by a fresh process in offline mode."""
    docs = structured_docs(5)
    home = tmp_path / "hf"
    script = f"""
import json, os, pathlib, shutil, sys
os.environ["HF_HOME"] = {str(home)!r}
import datasets
rows = pathlib.Path({str(tmp_path)!r}) / "rows.jsonl"
rows.write_text("".join(json.dumps({{"text": d}}) + "\\n" for d in {docs!r}))
datasets.load_dataset("json", data_files={{"train": str(rows)}})
cache = pathlib.Path(datasets.config.HF_DATASETS_CACHE)
built = next((cache / "json").glob("default-*/0.0.0/*"))
named = cache / "someone___tiny" / "default" / "0.0.0" / built.name
shutil.copytree(built, named)
(named / "json-train.arrow").rename(named / "tiny-train.arrow")
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=120)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = tmp_path / "prep"
    proc = subprocess.run([sys.executable, "-m", "moeflow", "prepare-data", "hf:someone/tiny", "--out", str(out),
                           "--workers", "1", "--val-fraction", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ds = TokenDataset(out)
    assert ds.num_documents == 5 and ds.index["sources"] == ["hf:someone/tiny"]
    assert ByteTokenizer(encoding="utf-8").decode(ds.read(0, ds.num_tokens).tolist()) == "".join(docs)
    proc = subprocess.run([sys.executable, "-m", "moeflow", "prepare-data", "hf:someone/absent", "--out",
                           str(tmp_path / "none")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "hf:someone/absent: not in the local datasets cache" in proc.stderr, proc.stderr


def _bad(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("empty.txt", b"", r"empty\.txt: the file is empty"),
        ("empty.jsonl", b"", r"empty\.jsonl: the file is empty"),
        ("latin.txt", "caf\xe9 au lait".encode("latin-1"), r"latin\.txt: invalid UTF-8 at byte 3"),
        ("docs.jsonl", b'{"text": "a"}\n{"txt": "b"}\n', r"docs\.jsonl:2: no 'text' field \(fields: txt"),
        ("docs.jsonl", b'{"text": "a"}\n\n{"text": "b"\n', r"docs\.jsonl:3: not JSON"),
        ("docs.jsonl", b'{"text": "a"}\n{"text": 7}\n', r"docs\.jsonl:2: the 'text' field is int, not text"),
        ("docs.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n', r"docs\.jsonl:2: invalid UTF-8"),
        ("docs.jsonl", b'{"text": "a"}\n{"text": ""}\n', r"docs\.jsonl:2: an empty document \(ask to skip empty"),
        ("docs.json", b'{"a": 1, "b": 2}', r"docs\.json: expected a list of objects"),
        ("docs.json", b"[]", r"docs\.json: an empty list of documents"),
        ("broken.parquet", b"PAR1 not really", r"broken\.parquet: not a readable Parquet file"),
    ],
)
def test_bad_data_is_refused_naming_the_file_and_line(tmp_path, name: str, content: bytes, match: str) -> None:
    path = _bad(tmp_path, name, content)
    with pytest.raises(DataError, match=match):
        list(documents([path]))


@pytest.mark.unit
def test_bad_folders_columns_and_skipped_documents(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"1")
    with pytest.raises(DataError, match=r"empty: a folder without data files"):
        list(documents([tmp_path / "empty"]))
    with pytest.raises(DataError, match=r"absent: no such file or folder"):
        list(documents([tmp_path / "absent"]))
    pq_path = write_source("parquet", tmp_path / "pq", ["one", "two"])
    with pytest.raises(DataError, match=r"docs\.parquet: no 'text' column \(columns: id, body"):
        list(documents([pq_path]))
    # empty documents: refused, or skipped when asked and then counted
    jsonl = _bad(tmp_path, "gaps.jsonl", b'{"text": "a"}\n{"text": ""}\n{"text": "b"}\n{"text": ""}\n')
    docs = documents([jsonl], skip_empty=True)
    assert [d.text for d in docs] == ["a", "b"] and docs.skipped == 2
    with pytest.raises(ValueError, match="text_field must be a non-empty string"):
        documents([jsonl], text_field="")


# --------------------------------------------------------------------------- prepared shards


class _WideTokenizer(Tokenizer):
    """A vocabulary wider than uint16 (ids past 65535), to check the shard dtype."""

    vocab_size = 70_000
    eod = 69_999

    def encode(self, text: str) -> list[int]:
        return [60_000 + (b % 9000) for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        return {"kind": "wide-test"}


@pytest.mark.unit
def test_prepare_writes_every_document_with_its_end_token_the_same_on_any_number_of_workers(tmp_path) -> None:
    docs = structured_docs(300)
    src = write_source("jsonl", tmp_path / "src", docs)
    tok = ByteTokenizer(encoding="utf-8", eod=True)
    one = prepare(documents([src], text_field="body"), tok, tmp_path / "one", val_fraction=0.2, seed=3, workers=1,
                  shard_tokens=4000)
    two = prepare(documents([src], text_field="body"), tok, tmp_path / "two", val_fraction=0.2, seed=3, workers=2,
                  shard_tokens=4000)
    assert one["splits"] == two["splits"] and one["dtype"] == "uint16" and one["eod"] == 256
    for name in ("train", "val"):
        files = [s["file"] for s in one["splits"][name]["shards"]]
        assert [(tmp_path / "one" / f).read_bytes() for f in files] == [(tmp_path / "two" / f).read_bytes() for f in files]
    assert len(one["splits"]["train"]["shards"]) > 3  # several shards: reads cross their ends
    # the validation documents are the hashed choice, by document index, and all are there once
    want = {"train": [d for i, d in enumerate(docs) if split_of(i, 3, 0.2) == "train"],
            "val": [d for i, d in enumerate(docs) if split_of(i, 3, 0.2) == "val"]}
    assert 30 < len(want["val"]) < 90
    for name, texts in want.items():
        ds = TokenDataset(tmp_path / "one", name)
        ids = ds.read(0, ds.num_tokens)
        ends = np.load(tmp_path / "one" / one["splits"][name]["doc_ends"])
        assert ds.num_documents == len(texts) == len(ends) and ends[-1] == ds.num_tokens
        assert (ids[ends - 1] == 256).all() and (ids == 256).sum() == len(texts)  # one end token per document
        pieces = np.split(ids, ends[:-1])
        assert [tok.decode(p.tolist()) for p in pieces] == texts
    # a vocabulary past uint16 gets uint32 shards
    wide = prepare(documents([src], text_field="body"), _WideTokenizer(), tmp_path / "wide", workers=1)
    ds = TokenDataset(tmp_path / "wide")
    assert wide["dtype"] == "uint32" and ds.read(0, 3).tolist() == _WideTokenizer().encode(docs[0][:3])
    assert ds.read(len(docs[0].encode()), 1).tolist() == [69_999]
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        prepare(documents([src], text_field="body"), tok, tmp_path / "one")


@pytest.mark.unit
def test_reads_through_small_windows_equal_the_whole_corpus(tmp_path) -> None:
    """Random reads, across shard ends, through windows far smaller than the shards, are the
    corpus' tokens; each shard holds one window mapped at a time."""
    src = write_source("jsonl", tmp_path / "src", structured_docs(400, seed=1))
    prepare(documents([src], text_field="body"), ByteTokenizer(encoding="utf-8", eod=True), tmp_path / "p",
            workers=1, shard_tokens=9000)
    whole = TokenDataset(tmp_path / "p", window_bytes=1 << 30)
    ref = whole.read(0, whole.num_tokens)
    small = TokenDataset(tmp_path / "p", window_bytes=1)  # rounded up to the mmap granularity
    rng = np.random.default_rng(0)
    for _ in range(200):
        length = int(rng.integers(1, 300))
        start = int(rng.integers(0, whole.num_tokens - length))
        np.testing.assert_array_equal(small.read(start, length), ref[start : start + length])
    for w in small._windows:
        assert w._map is None or w._end - w._start <= max(w.window, 600)
    with pytest.raises(IndexError, match="outside"):
        small.read(whole.num_tokens - 2, 5)
    # nothing before the first token, no negative length; no tokens read is an empty int64 array
    memory = TokenDataset.in_memory(ref, {}, eod=None, name="memory")
    for ds in (small, memory):
        for start, length in ((-1, 3), (-int(rng.integers(2, 100)), 1), (5, -1)):
            with pytest.raises(IndexError, match=rf"tokens \[{start}, {start + length}\) outside"):
                ds.read(start, length)
        for start in (0, int(rng.integers(1, whole.num_tokens)), whole.num_tokens):
            empty = ds.read(start, 0)
            assert empty.dtype == np.int64 and empty.shape == (0,)


@pytest.mark.unit
def test_damaged_or_mismatched_shards_are_refused_by_file(tmp_path) -> None:
    src = write_source("jsonl", tmp_path / "src", structured_docs(50))
    prepare(documents([src], text_field="body"), ByteTokenizer(encoding="utf-8", eod=True), tmp_path / "p", workers=1,
            val_fraction=0.0)
    shard = tmp_path / "p" / "train-00000.bin"
    TokenDataset(tmp_path / "p")  # intact
    with pytest.raises(DataError, match="no 'val' split"):
        TokenDataset(tmp_path / "p", "val")
    # another tokenizer than the shards'
    with pytest.raises(DataError, match=r"p: the shards were tokenized with a byte tokenizer, not a bpe tokenizer"):
        TokenDataset(tmp_path / "p", tokenizer={"kind": "bpe", "json": "{}"})
    with pytest.raises(DataError, match="not a byte tokenizer|tokenized with"):
        TokenDataset(tmp_path / "p", tokenizer=ByteTokenizer().to_dict())
    # one changed byte: the checksum fails
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"train-00000\.bin: checksum mismatch"):
        TokenDataset(tmp_path / "p")
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=r"train-00000\.bin: \d+ bytes, the index says \d+ tokens"):
        TokenDataset(tmp_path / "p")
    shard.unlink()
    with pytest.raises(DataError, match=r"train-00000\.bin: missing"):
        TokenDataset(tmp_path / "p")
    (tmp_path / "p" / "index.json").write_text("{not json")
    with pytest.raises(DataError, match=r"index\.json: not JSON"):
        TokenDataset(tmp_path / "p")
    (tmp_path / "p" / "index.json").unlink()  # an unfinished preparation
    with pytest.raises(DataError, match="no index.json"):
        TokenDataset(tmp_path / "p")
    # a failed preparation leaves nothing behind (the next one starts clean)
    bad = _bad(tmp_path, "bad.jsonl", b'{"text": "a"}\n{"nope": 1}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        prepare(documents([bad]), ByteTokenizer(encoding="utf-8", eod=True), tmp_path / "q", workers=2)
    assert not (tmp_path / "q").exists()


# --------------------------------------------------------------------------- sampling by step


def _datasets(tmp_path: Path) -> list[TokenDataset]:
    out = []
    for i, n in enumerate((120, 40)):
        src = write_source("jsonl", tmp_path / f"src{i}", structured_docs(n, seed=i))
        prepare(documents([src], text_field="body"), ByteTokenizer(encoding="utf-8", eod=True), tmp_path / f"p{i}",
                workers=1, shard_tokens=2048)
        out.append(TokenDataset(tmp_path / f"p{i}", window_bytes=1))
    return out


@pytest.mark.unit
def test_batches_depend_on_the_step_alone_on_any_world_size_and_prefetched(tmp_path) -> None:
    sets = _datasets(tmp_path)
    sampler = TokenSampler(sets, [3.0, 1.0], seq_len=16, seed=5)
    for step in (0, 1, 7):
        x, y = sampler.batch(step, 8)
        assert x.shape == (8, 16) and x.dtype == torch.long and torch.equal(x[:, 1:], y[:, :-1])
        for world in (2, 4):  # each rank reads its own rows; together they are the global batch
            parts = [sampler.batch(step, 8, rank=r, world=world) for r in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    assert not torch.equal(sampler.batch(0, 8)[0], sampler.batch(1, 8)[0])
    # the mix follows the weights (3:1), over many steps
    picks = torch.cat([sampler.starts(s, 8)[0] for s in range(400)])
    assert 0.70 < (picks == 0).double().mean().item() < 0.80
    # every window is a stretch of its source's tokens
    source, start = sampler.starts(3, 8)
    x, _ = sampler.batch(3, 8)
    for row, (s, t) in enumerate(zip(source.tolist(), start.tolist())):
        assert x[row].tolist() == sets[s].read(t, 16).tolist()
    # prefetched: the same batches, in order or not
    pre = Prefetcher(TokenSampler(sets, [3.0, 1.0], seq_len=16, seed=5))
    for step in (0, 1, 2, 5, 6, 2):
        got, want = pre.batch(step, 8, rank=1, world=2), sampler.batch(step, 8, rank=1, world=2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    pre.close()
    with pytest.raises(ValueError, match="batch_size=6 must be divisible by the number of ranks 4"):
        sampler.batch(0, 6, world=4)
    with pytest.raises(DataError, match=r"p0 \(train\): \d+ tokens, fewer than one sequence of seq_len\+1 = 100001"):
        TokenSampler(sets, None, seq_len=100_000, seed=0)
    with pytest.raises(ValueError, match="weights must be one positive number per dataset"):
        TokenSampler(sets, [1.0, 0.0], seq_len=16, seed=0)


@pytest.mark.unit
def test_tokens_in_memory_are_a_dataset_like_a_prepared_one() -> None:
    """``TokenDataset.in_memory`` (a small corpus held by the process): int64 reads whatever
    the array's dtype, one document per end-of-document token (one without such a token), a
    fingerprint of the tokens themselves (one token changed is another corpus, and so another
    sampler), and the errors name it."""
    rng = np.random.default_rng(11)
    docs = int(rng.integers(2, 9))
    tokens = rng.integers(0, 256, size=200, dtype=np.uint16)
    tokens[np.sort(rng.choice(200, size=docs, replace=False))] = 256
    ds = TokenDataset.in_memory(tokens, {"kind": "byte"}, eod=256, name="small corpus")
    assert ds.num_tokens == 200 and ds.num_documents == docs and ds.eod == 256
    got = ds.read(3, 50)
    assert got.dtype == np.int64 and got.tolist() == tokens[3:53].tolist()
    assert TokenDataset.in_memory(tokens, {}, eod=None, name="x").num_documents == 1
    same = TokenDataset.in_memory(tokens.astype(np.int64), {}, eod=None, name="y")
    changed = tokens.copy()
    changed[int(rng.integers(200))] ^= 1
    other = TokenDataset.in_memory(changed, {}, eod=None, name="z")
    assert isinstance(ds.fingerprint, str) and same.fingerprint == ds.fingerprint != other.fingerprint
    assert TokenSampler([same], None, 8, 0).fingerprint != TokenSampler([other], None, 8, 0).fingerprint
    with pytest.raises(DataError, match=r"^small corpus \(memory\): 200 tokens, fewer than one sequence of "
                                        r"seq_len\+1 = 200$"):
        TokenSampler([ds], None, seq_len=199, seed=0)


@pytest.mark.unit
def test_a_token_stream_takes_one_sequence_with_room_for_a_window() -> None:
    """``TokenStream``: a 1-D sequence of at least ``seq_len + 2`` tokens (the fewest a sampler
    takes: ``min_split_tokens``), refused by name otherwise; ``from_text`` samples the
    tokenizer's ids of the text exactly as a stream over those ids does (int64, on the CPU)."""
    from moeflow.train.data import ByteTokenizer

    for seq_len in (1, 7):
        stream = TokenStream(torch.arange(seq_len + 2) * 3, seq_len=seq_len, seed=0)
        x, y = stream.batch(0, 16)
        windows = {s: list(range(3 * s, 3 * (s + seq_len), 3)) for s in (0, 1)}  # the two starts
        assert all(row in windows.values() for row in x.tolist()) and torch.equal(y, x + 3)
        assert {row[0] for row in x.tolist()} == {0, 3}  # both drawn (16 rows: all one start at 2 ** -15)
        with pytest.raises(ValueError, match=rf"need more than seq_len\+1={seq_len + 1} tokens, got {seq_len + 1}"):
            TokenStream(torch.arange(seq_len + 1), seq_len=seq_len, seed=0)
    with pytest.raises(ValueError, match=r"need more than seq_len\+1=3 tokens, got 40"):
        TokenStream(torch.arange(40).reshape(4, 10), seq_len=2, seed=0)
    gen = torch.Generator().manual_seed(5)
    text = "".join(chr(c) for c in torch.randint(32, 127, (500,), generator=gen).tolist())
    tok = ByteTokenizer()
    stream = TokenStream.from_text(text, tok, seq_len=12, seed=3)
    ids = torch.tensor(tok.encode(text))
    assert stream.datasets[0].read(0, len(text)).tolist() == ids.tolist()
    for step in (0, 4):
        got, want = stream.batch(step, 6), TokenStream(ids, seq_len=12, seed=3).batch(step, 6)
        assert got[0].dtype == torch.int64 and got[0].device.type == "cpu"
        assert got[0].shape == (6, 12) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(stream.batch(0, 6)[0], TokenStream(ids, seq_len=12, seed=4).batch(0, 6)[0])
    with torch.device("meta"):  # another default device: the corpus and its batches stay in host memory
        held = TokenStream.from_text(text, tok, seq_len=12, seed=3)
        x, y = held.batch(4, 6)
    assert x.device.type == "cpu" and torch.equal(x, want[0]) and torch.equal(y, want[1])


@pytest.mark.unit
def test_the_batches_of_a_step_are_pinned() -> None:
    """Which windows a step draws is part of a run: a checkpoint resumed by a later moeflow must
    see the batches its run would have seen (its data fingerprint covers the tokens, not the
    drawing), so the draws of a few (seed, step) pairs are pinned here, for several sources and
    for one. A change of the seeding or of the draws fails this test: such a change must say
    that runs resumed across it see other batches."""
    sets = [TokenDataset.in_memory(np.arange(n) + 1000 * i, {}, eod=None, name=f"s{i}") for i, n in enumerate((50, 30))]
    sampler = TokenSampler(sets, [2.0, 1.0], seq_len=4, seed=7)
    # (re-pinned when the last window of each source became drawable: 2026-11-29)
    pinned = {0: ([0, 0, 1, 1, 0, 0], [23, 1, 14, 25, 31, 16]), 1: ([1, 1, 0, 0, 1, 0], [9, 20, 17, 18, 11, 39]),
              123456: ([0, 0, 1, 1, 1, 0], [8, 32, 20, 18, 8, 25])}
    for step, (source, start) in pinned.items():
        got = sampler.starts(step, 6)
        assert (got[0].tolist(), got[1].tolist()) == (source, start), step
        assert got[0].dtype == got[1].dtype == torch.int64
        with torch.device("meta"):  # another default device: drawn on the CPU all the same
            got = sampler.starts(step, 6)
        assert (got[0].tolist(), got[1].tolist()) == (source, start), step
    # any positive finite weights, past float32's range too (scaled by a power of two: the same draws);
    # a sampler made under another default device draws the same
    huge = TokenSampler(sets, [2.0**130, 2.0**131], seq_len=4, seed=7)
    with torch.device("meta"):
        made_on_meta = TokenSampler(sets, [2.0, 1.0], seq_len=4, seed=7)
    for step in (0, 1):
        assert torch.equal(huge.starts(step, 64)[0], TokenSampler(sets, [1.0, 2.0], seq_len=4, seed=7).starts(step, 64)[0])
        assert torch.equal(made_on_meta.starts(step, 6)[0], sampler.starts(step, 6)[0])
    # no weights: each source weighs 1, the same sampler (draws and fingerprint) as weights of 1
    even = TokenSampler(sets, None, seq_len=4, seed=7)
    ones = TokenSampler(sets, [1.0, 1.0], seq_len=4, seed=7)
    assert even.fingerprint == ones.fingerprint and torch.equal(even.starts(5, 64)[0], ones.starts(5, 64)[0])
    stream = TokenStream(torch.arange(40), seq_len=4, seed=3)
    # a batch of no rows (one source): inputs and targets of no rows, int64 on the CPU, under another
    # default device too
    with torch.device("meta"):
        x, y = stream.batch(3, 0)
    assert x.shape == y.shape == (0, 4) and x.dtype == y.dtype == torch.int64 and x.device.type == y.device.type == "cpu"
    for step, start in {0: [8, 13, 6, 16, 24], 99: [32, 32, 3, 25, 19]}.items():
        source, got = stream.starts(step, 5)
        assert got.tolist() == start and source.tolist() == [0] * 5 and source.dtype == got.dtype == torch.int64


@pytest.mark.unit
def test_a_tokenizer_mismatch_names_both_tokenizers(tmp_path) -> None:
    """Shards tokenized otherwise are refused naming both tokenizers: by kind, and for a
    tokenizer with a vocabulary file by a short hash of its description, so that two BPE
    tokenizers read apart; the hash is of the description's content (the order of its keys
    does not change it), and an index whose tokenizer is no description at all is named as
    of an unknown kind."""
    import re

    src = write_source("jsonl", tmp_path / "src", structured_docs(30))
    prepare(documents([src], text_field="body"), ByteTokenizer(encoding="utf-8", eod=True), tmp_path / "p", workers=1,
            val_fraction=0.0)
    index_file = tmp_path / "p" / "index.json"
    index = json.loads(index_file.read_text())
    gen = torch.Generator().manual_seed(2)
    merges = ["".join(chr(c) for c in torch.randint(97, 123, (12,), generator=gen).tolist()) for _ in range(2)]
    index["tokenizer"] = {"json": merges[0], "kind": "bpe"}  # keys in another order than to_dict's
    index_file.write_text(json.dumps(index))
    given = {"kind": "bpe", "json": merges[1], "eod": 0}
    pattern = r": the shards were tokenized with a bpe tokenizer \(([0-9a-f]{8})\), not a bpe tokenizer \(([0-9a-f]{8})\):"
    with pytest.raises(DataError) as first:
        TokenDataset(tmp_path / "p", tokenizer=given)
    found = re.search(pattern, str(first.value))
    assert found is not None and found[1] != found[2], str(first.value)
    with pytest.raises(DataError) as again:  # the same tokenizer, its description's keys in another order
        TokenDataset(tmp_path / "p", tokenizer={"eod": 0, "json": merges[1], "kind": "bpe"})
    assert str(again.value) == str(first.value)
    index["tokenizer"] = {"kind": "bpe", "json": merges[0]}
    index_file.write_text(json.dumps(index))
    with pytest.raises(DataError) as reordered:
        TokenDataset(tmp_path / "p", tokenizer=given)
    assert str(reordered.value) == str(first.value)
    for desc in ("bpe", {"json": merges[0]}):  # no description, and one without a kind
        index["tokenizer"] = desc
        index_file.write_text(json.dumps(index))
        with pytest.raises(DataError, match=r": the shards were tokenized with a \? tokenizer(?: \([0-9a-f]{8}\))?, "
                                            r"not a byte tokenizer: prepare"):
            TokenDataset(tmp_path / "p", tokenizer=ByteTokenizer().to_dict())


@pytest.mark.unit
def test_the_prefetcher_reads_ahead_on_one_thread(tmp_path) -> None:
    """A caller that skips around (each call reads its batch at once and starts reading the
    next one's) never has more than one background read: one thread, one batch ahead."""
    import threading

    release = threading.Event()

    class Held:
        """The stream's batches; a background read waits until released."""

        def __init__(self) -> None:
            self.stream, self.ahead = TokenStream(torch.arange(500), seq_len=8, seed=1), []

        def batch(self, *args, **kw):  # type: ignore[no-untyped-def]
            if threading.current_thread().name.startswith("moeflow-data"):
                self.ahead.append(args[0])
                release.wait(30)
            return self.stream.batch(*args, **kw)

    pre = Prefetcher(Held())  # type: ignore[arg-type]
    try:
        for step in (0, 5, 9, 2):
            got, want = pre.batch(step, 4), TokenStream(torch.arange(500), seq_len=8, seed=1).batch(step, 4)
            assert torch.equal(got[0], want[0])
        readers = [t for t in threading.enumerate() if t.name.startswith("moeflow-data")]
        assert len(readers) == 1, readers
    finally:
        release.set()
        pre.close()

    class Spy:
        """The stream's batches, recording which thread asked for which."""

        def __init__(self) -> None:
            self.stream, self.calls = TokenStream(torch.arange(500), seq_len=8, seed=1), []

        def batch(self, step, batch_size, *, rank, world):  # type: ignore[no-untyped-def]
            self.calls.append((threading.current_thread().name.startswith("moeflow-data"), step, rank, world))
            return self.stream.batch(step, batch_size, rank=rank, world=world)

    # close waits for a read under way, drops the reads queued behind it, and the reader is gone after it
    release.clear()
    held = Held()
    pre = Prefetcher(held)  # type: ignore[arg-type]
    pre.batch(0, 4)  # step 1 is being read ahead, held
    pre.batch(5, 4)  # read at once; step 6 queued behind step 1
    threading.Timer(0.2, release.set).start()
    pre.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("moeflow-data") and t.is_alive()]
    assert held.ahead == [1]

    class Slow:
        """The stream's batches, each read taking 20 ms."""

        def __init__(self) -> None:
            self.stream = TokenStream(torch.arange(500), seq_len=8, seed=1)

        def batch(self, *args, **kw):  # type: ignore[no-untyped-def]
            import time

            time.sleep(0.02)
            return self.stream.batch(*args, **kw)

    pre = Prefetcher(Slow())  # type: ignore[arg-type]
    for step in (0, 10, 20, 30):  # none read ahead: the caller waits for each read, and the waits add up
        pre.batch(step, 4)
    pre.close()
    assert pre.waited_s >= 4 * 0.02

    spy = Spy()
    pre = Prefetcher(spy)  # type: ignore[arg-type]
    start = int(torch.randint(0, 100, ()))
    for step in range(start, start + 4):  # consecutive steps: each after the first was read ahead
        got, want = pre.batch(step, 4, rank=1, world=2), spy.stream.batch(step, 4, rank=1, world=2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    pre.close()
    assert [c for c in spy.calls if not c[0]] == [(False, start, 1, 2)]
    ahead = sorted(c for c in spy.calls if c[0])  # the read ahead of the last step may be cancelled by close
    assert ahead[:3] == [(True, s, 1, 2) for s in range(start + 1, start + 4)] and ahead[3:] in ([], [(True, start + 4, 1, 2)])


# --------------------------------------------------------------------------- tokenizers


def _hf_tokenizer_dir(tmp_path: Path, docs: list[str]) -> Path:
    """A model directory holding a word-piece-free BPE ``tokenizer.json`` trained here and a
    ``tokenizer_config.json`` naming its end-of-sequence token ``</s>``."""
    from tokenizers import Tokenizer as Raw, models, pre_tokenizers, trainers, decoders

    tok = Raw(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    out = tmp_path / "my-tokenizer"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return out


@pytest.mark.unit
def test_a_tokenizer_json_brings_its_end_of_sequence_token(tmp_path) -> None:
    model_dir = _hf_tokenizer_dir(tmp_path, structured_docs(50))
    tok = load_tokenizer(model_dir)
    assert tok.eod == tok._tok.token_to_id("</s>") == 2 and tok.vocab_size <= 400
    text = structured_docs(1, seed=9)[0]
    assert tok.decode(tok.encode(text)) == text
    again = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again.encode(text) == tok.encode(text) and again.eod == 2 and again.to_dict()["kind"] == "hf"
    # the file alone: the usual end-of-sequence names are looked for
    assert load_tokenizer(model_dir / "tokenizer.json").eod == 2
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=r"tokenizer\.json: no end-of-sequence token \('<\|im_end\|>'"):
        load_tokenizer(model_dir)
    with pytest.raises(ValueError, match=r"nothing\.json: no such tokenizer file"):
        load_tokenizer(tmp_path / "nothing.json")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match=r"junk\.json: not a tokenizers JSON"):
        load_tokenizer(tmp_path / "junk.json")


@pytest.mark.unit
def test_the_utf8_byte_tokenizer_exports_to_an_equal_hugging_face_tokenizer() -> None:
    """Every byte id maps to its own token and back; UTF-8 text of every lead and continuation
    byte encodes to the same ids in the exported ``tokenizer.json`` as in moeflow; the
    end-of-document token is its eos."""
    from tokenizers import Tokenizer as Raw

    from moeflow.convert.hf_tokenizer import tokenizer_files

    ours = ByteTokenizer(encoding="utf-8", eod=True)
    files = tokenizer_files(ours.to_dict(), 257, 128)
    hf = Raw.from_str(files["tokenizer.json"])
    assert hf.get_vocab_size() == 257 and json.loads(files["tokenizer_config.json"])["eos_token"] == "<|endoftext|>"
    assert hf.token_to_id("<|endoftext|>") == 256
    assert len({hf.id_to_token(i) for i in range(256)}) == 256
    # code points at a stride that reaches every lead and continuation byte of valid UTF-8
    text = "".join(chr(c) for c in [*range(1, 0x800), *range(0x800, 0x110000, 61)] if not 0xD800 <= c < 0xE000)
    assert set(text.encode("utf-8")) == set(range(1, 0xC0)) | set(range(0xC2, 0xF5))
    assert hf.encode(text).ids == ours.encode(text)
    assert hf.decode(ours.encode(text)) == text == ours.decode(ours.encode(text) + [256])


# --------------------------------------------------------------------------- the config


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (dict(data="corpus.txt"), TypeError, r"data must be a list of sources \(paths, hf:NAME\), got 'corpus.txt'"),
        (dict(val_data=("v.txt",)), ValueError, r"val_data=\['v.txt'\] goes with data"),
        (dict(data=("a.txt@x",)), ValueError, r"data source 'a.txt@x': the weight after '@' must be a number"),
        (dict(data=("a.txt@-1",)), ValueError, r"data source 'a.txt@-1': the weight must be a positive finite"),
        (dict(data=("a.txt",), val_fraction=1.0), ValueError, r"val_fraction must be in \[0, 1\), got 1.0"),
        (dict(data=("a.txt",), mmap_window=10), ValueError, "mmap_window"),
        (dict(data=("a.txt",), text_field=""), ValueError, "text_field must be a non-empty string"),
        (dict(tokenizer="tok.json"), ValueError, r"a tokenizer\.json goes with data\), got 'tok.json'"),
    ],
)
def test_data_settings_are_validated(tmp_path, fields: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        LMTrainConfig(out_dir=tmp_path, **fields)


# --------------------------------------------------------------------------- training on it


def _run_cfg(out: Path, **kw) -> LMTrainConfig:
    base = dict(out_dir=out, steps=2, batch_size=4, seq_len=32, warmup_steps=1, eval_every=0, eval_batches=1,
                progress=False, plot=False, n_layers=1, dim=32, n_heads=2, expert_hidden=32,
                text_field="body", val_fraction=0.25)
    return LMTrainConfig(**{**base, **kw})


@pytest.mark.e2e
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "txt"] + ["prepared", "mixed"])
def test_each_kind_of_source_trains(tmp_path, kind: str) -> None:
    docs = structured_docs(40)
    if kind == "prepared":
        src = write_source("jsonl", tmp_path / "src", docs)
        assert main(["prepare-data", str(src), "--text-field", "body", "--out", str(tmp_path / "prep"),
                     "--val-fraction", "0.25", "--workers", "2", "--no-progress"]) == 0
        data = (str(tmp_path / "prep"),)
    elif kind == "mixed":  # two sources, one three times as likely, and held-out files of a third
        data = (f"{write_source('jsonl', tmp_path / 'a', docs)}@3", str(write_source("parquet", tmp_path / "b", docs)))
    else:
        data = (str(write_source(kind, tmp_path / "src", docs)),)
    val = (str(write_source("json", tmp_path / "val", structured_docs(8, seed=7))),) if kind == "mixed" else ()
    hist = train_lm(_run_cfg(tmp_path / "run", data=data, val_data=val))
    assert len(hist["train_loss"]) == 2 and all(np.isfinite(hist["train_loss"])) and np.isfinite(hist["val"][0][1])
    extra = read_index(hist["checkpoint"])["extra"]
    assert extra["tokenizer"] == {"kind": "byte", "encoding": "utf-8", "eod": 256}
    assert extra["model"]["vocab_size"] == 257 and set(extra["data"]) == {"train", "val"}
    assert 0 <= hist["data_share"] < 1 and hist["data_wait_s"] >= 0
    if kind not in ("prepared",):  # raw sources were prepared once, into the run directory
        assert len(list((tmp_path / "run" / "data").glob("*/index.json"))) == len(data) + len(val)


@pytest.mark.e2e
def test_loss_falls_on_a_corpus_that_is_not_shakespeare_and_the_model_generates_it(tmp_path, capsys) -> None:
    src = write_source("folder", tmp_path / "src", structured_docs(400))
    out = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--data", str(src), "--out", str(out), "--steps", "60",
                 "--batch-size", "16", "--seq-len", "64", "--warmup", "5", "--eval-every", "30", "--eval-batches", "4",
                 "--no-progress", "--no-plot", "--sample-tokens", "0", "--dim", "64", "--layers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "-> " in printed and "train 3" in printed  # the preparation's note: documents and tokens per split
    hist = json.loads((out / "history.json").read_text())
    before, after = hist["val"][0][1], hist["val"][-1][1]
    assert before > 5.0 and after < 2.5, hist["val"]  # uniform over 257 tokens is 5.55; this text is learnable
    # generate reads the run's tokenizer (UTF-8 bytes) and continues the corpus' pattern
    assert main(["generate", str(out), "--max-new-tokens", "12", "--prompt", "éva counts:", "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("éva counts:") and len(text) > len("éva counts:")


@pytest.mark.e2e
def test_a_tokenizer_json_trains_generates_and_exports(tmp_path, capsys) -> None:
    docs = structured_docs(60)
    model_dir = _hf_tokenizer_dir(tmp_path, docs)
    src = write_source("jsonl", tmp_path / "src", docs)
    out = tmp_path / "run"
    hist = train_lm(_run_cfg(out, data=(str(src),), tokenizer=str(model_dir)))
    saved = read_index(hist["checkpoint"])["extra"]["tokenizer"]
    assert saved["kind"] == "hf" and saved["eod"] == 2
    capsys.readouterr()
    assert main(["generate", str(out), "--max-new-tokens", "4", "--prompt", "ada counts"]) == 0
    assert capsys.readouterr().out.startswith("ada counts")
    assert main(["convert", str(out), "--to-hf", str(tmp_path / "hf")]) == 0
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf.eos_token == "</s>" and hf.encode(docs[3]) == load_tokenizer(model_dir).encode(docs[3])
    # shards of another tokenizer are refused by the run, naming them
    assert main(["prepare-data", str(src), "--text-field", "body", "--out", str(tmp_path / "bytes"),
                 "--val-fraction", "0.3", "--no-progress"]) == 0
    with pytest.raises(DataError, match="bring their own tokenizer"):
        train_lm(_run_cfg(tmp_path / "other", data=(str(tmp_path / "bytes"),), tokenizer=str(model_dir)))


@pytest.mark.e2e
def test_bad_data_stops_the_run_before_training_naming_the_file(tmp_path, capsys) -> None:
    short = _bad(tmp_path, "short.jsonl", b'{"body": "tiny"}\n{"body": "also tiny"}\n')
    with pytest.raises(DataError, match=r"fewer than one sequence of seq_len\+1 = 33"):
        train_lm(_run_cfg(tmp_path / "a", data=(str(short),), val_fraction=0.0, val_data=(str(short),)))
    missing = _bad(tmp_path, "gap.jsonl", b'{"body": "a"}\n{"text": "b"}\n')
    assert main(["train", "--device", "cpu", "--data", str(missing), "--text-field", "body", "--out",
                 str(tmp_path / "b"), "--steps", "1", "--no-progress", "--no-plot"]) == 2
    assert "gap.jsonl:2: no 'body' field" in capsys.readouterr().err
    assert main(["train", "--device", "cpu", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c"),
                 "--steps", "1"]) == 2
    assert "--data " + str(tmp_path / "nowhere") + ": no such file or folder" in capsys.readouterr().err
    # one document of 65 tokens: a token hold-out of one window of seq_len 32 (34 tokens) leaves too few to train on
    one = write_source("txt", tmp_path / "one", structured_docs(1) * 30)
    with pytest.raises(DataError, match=r"book\.txt: 65 tokens in 1 document\(s\) are too few for a validation split: "
                       r"holding out 34 .* leaves 31 for training, fewer than one window"):
        train_lm(_run_cfg(tmp_path / "d", data=(str(one),)))


@pytest.mark.e2e
def test_resume_refuses_data_that_changed(tmp_path) -> None:
    src = write_source("jsonl", tmp_path / "src", structured_docs(40))
    cfg = _run_cfg(tmp_path / "run", data=(str(src),), steps=3, checkpoint_every=1)
    train_lm(cfg)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-00000003")
    write_source("jsonl", tmp_path / "src2", structured_docs(41))
    shutil.copy(tmp_path / "src2" / "docs.jsonl", src)  # the same path, other documents
    with pytest.raises(ValueError, match="data: the training or validation data differs from the data the checkpoint"):
        train_lm(dataclasses.replace(cfg, resume=True))
    with pytest.raises(ValueError, match="text_field"):
        train_lm(dataclasses.replace(cfg, resume=True, text_field="text"))


# --------------------------------------------------------------------------- ranks and resumption


def _prepared_corpus(root: Path) -> Path:
    out = root / "prep"
    if not (out / "index.json").is_file():
        src = write_source("jsonl", root / "src", structured_docs(200))
        prepare(documents([src], text_field="body"), ByteTokenizer(encoding="utf-8", eod=True), out,
                val_fraction=0.1, workers=1, shard_tokens=3000)
    return out


_RESUME = dict(steps=6, batch_size=8, seq_len=32, checkpoint_every=3, dtype="float64", load_balance_coef=0.0)


def _case_own_data(rank: int, world: int, out: str, data: str, stop: str) -> None:
    """6 steps on a prepared corpus in one go (``stop`` 0), or stopped right after the
    checkpoint of step ``stop`` and resumed."""
    cfg = _run_cfg(Path(out), data=(data,), mmap_window=1 << 16, **_RESUME)
    if int(stop):
        run_until_checkpoint(int(stop), lambda: train_lm(cfg))
    train_lm(dataclasses.replace(cfg, resume=bool(int(stop))))


CASES = {"own_data": _case_own_data}


@pytest.mark.distributed
def test_a_resumed_run_on_two_ranks_sees_the_batches_of_an_uninterrupted_one(tmp_path) -> None:
    """On 2 gloo ranks in fp64: a run stopped after step 3 and resumed equals the uninterrupted
    run bit for bit (losses and parameters); resumed on 1 process from the 2-rank checkpoint it
    continues with the same batches (equal up to the summation order of another world size)."""
    data = str(_prepared_corpus(tmp_path))
    spawn_ranks(2, __name__, "own_data", str(tmp_path / "whole"), data, "0")
    spawn_ranks(2, __name__, "own_data", str(tmp_path / "resumed"), data, "3")
    whole, resumed = (json.loads((tmp_path / n / "history.json").read_text()) for n in ("whole", "resumed"))
    assert whole["world_size"] == 2 and resumed["step"] == list(range(1, 7))
    assert resumed["train_loss"] == whole["train_loss"] and resumed["val"] == whole["val"]
    from moeflow.train import build_from_checkpoint

    ma, _, _ = build_from_checkpoint(tmp_path / "whole")
    mb, _, _ = build_from_checkpoint(tmp_path / "resumed")
    for (n, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    # the 2-rank run's step-3 checkpoint, resumed by one process
    shutil.copytree(tmp_path / "resumed", tmp_path / "elastic")
    for step in (4, 5, 6):
        shutil.rmtree(tmp_path / "elastic" / "checkpoints" / f"step-{step:08d}", ignore_errors=True)
    one = train_lm(dataclasses.replace(_run_cfg(tmp_path / "elastic", data=(data,), mmap_window=1 << 16, **_RESUME),
                                       resume=True))
    assert one["world_size"] == 1
    torch.testing.assert_close(torch.tensor(one["train_loss"]), torch.tensor(whole["train_loss"]), rtol=1e-10, atol=0)

"""The validation split of a prepared corpus (``moeflow.train.prepare``) and how ``moeflow
prepare-data`` and ``moeflow train --data`` compose with their defaults: many documents hold
out whole ones (by a hash of their index); too few hold out the last tokens of the corpus, at
least one training window, disjoint from the training tokens, the same on any number of workers
and shard sizes; too few tokens for that are refused naming the sizes; ``val_fraction`` 0 means
no split, which ``moeflow train`` refuses before it claims ``--out``; older indexes (without
``val_split``) still read as split by documents."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moeflow.cli.main import build_parser, main
from moeflow.train import LMTrainConfig
from moeflow.train.data import ByteTokenizer
from moeflow.train.lm_data import open_run_data, validation_problem
from moeflow.train.prepare import (
    DEFAULT_MIN_VAL_TOKENS,
    DEFAULT_VAL_FRACTION,
    min_split_tokens,
    prepare,
    split_note,
    split_of,
)
from moeflow.train.sources import DataError, documents
from moeflow.train.tokens import TokenDataset

BYTES = ByteTokenizer(encoding="utf-8", eod=True)
EOD = 256


def text_of(n_bytes: int, seed: int) -> str:
    """``n_bytes`` of ASCII words drawn from ``seed`` (no two documents alike)."""
    rng = np.random.default_rng(seed)
    words = ["moe", "expert", "router", "token", "layer", "gate", "shard", "window", "split", "\n"]
    out = ""
    while len(out) < n_bytes:
        out += words[int(rng.integers(0, len(words)))] + " "
    return out[:n_bytes]


def write_folder(root: Path, sizes: list[int], seed: int = 0) -> tuple[Path, list[str]]:
    """A folder of text files of ``sizes`` bytes (read in sorted path order); their texts."""
    root.mkdir(parents=True)
    texts = [text_of(n, seed * 1000 + i) for i, n in enumerate(sizes)]
    for i, text in enumerate(texts):
        (root / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    return root, texts


def corpus(texts: list[str]) -> np.ndarray:
    """The byte tokens of ``texts`` in order, each followed by the end-of-document token."""
    return np.concatenate([np.append(np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64), EOD) for t in texts])


def tokens_of(path: Path, split: str) -> np.ndarray:
    ds = TokenDataset(path, split)  # checksums verified
    return ds.read(0, ds.num_tokens)


def files_of(index: dict) -> set[str]:
    """The files an index lists (and itself): nothing else may be left in the folder."""
    names = {"index.json"}
    for split in index["splits"].values():
        names |= {s["file"] for s in split["shards"]} | {split["doc_ends"]}
    return names


# --------------------------------------------------------------------------- prepare (no model)


@pytest.mark.unit
def test_too_few_documents_hold_out_the_last_tokens_the_same_on_any_workers_and_shards(tmp_path) -> None:
    folder, texts = write_folder(tmp_path / "three", [2000, 3000, 3100])
    whole = corpus(texts)
    assert whole.size == 8103 and [split_of(i, 0, DEFAULT_VAL_FRACTION) for i in range(3)] == ["train"] * 3
    index = prepare(documents([folder]), BYTES, tmp_path / "a", workers=1)
    # round(0.05 * 8103) = 405 tokens (more than one window of 130): the corpus' last 405
    assert (index["val_split"], index["documents"], index["min_val_tokens"]) == ("tokens", 3, 130)
    assert index["splits"]["train"]["tokens"] == 7698 and index["splits"]["val"]["tokens"] == 405
    train, val = tokens_of(tmp_path / "a", "train"), tokens_of(tmp_path / "a", "val")
    np.testing.assert_array_equal(np.concatenate([train, val]), whole)  # disjoint, nothing lost, in order
    np.testing.assert_array_equal(val, whole[-405:])
    # the third document is cut: its head ends the training split, its tail is the validation split
    assert np.load(tmp_path / "a" / "train.docs.npy").tolist() == [2001, 5002, 7698]
    assert np.load(tmp_path / "a" / "val.docs.npy").tolist() == [405]
    assert set(os.listdir(tmp_path / "a")) == files_of(index)
    # deterministic: two workers write the same bytes; shards of 1000 tokens hold the same tokens
    again = prepare(documents([folder]), BYTES, tmp_path / "b", workers=2)
    assert again["splits"] == index["splits"]
    for name in files_of(index) - {"index.json"}:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    small = prepare(documents([folder]), BYTES, tmp_path / "c", workers=1, shard_tokens=1000)
    assert len(small["splits"]["train"]["shards"]) == 8 and set(os.listdir(tmp_path / "c")) == files_of(small)
    np.testing.assert_array_equal(tokens_of(tmp_path / "c", "train"), train)
    np.testing.assert_array_equal(tokens_of(tmp_path / "c", "val"), val)


@pytest.mark.unit
def test_a_hash_that_holds_out_too_little_is_undone_in_document_order(tmp_path) -> None:
    """40 documents: the hash holds out only document 28 (fewer tokens than a window), so the
    tokens are put back in document order and the last ones held out; across shard ends."""
    sizes = [60 + (7 * i) % 23 for i in range(40)]
    folder, texts = write_folder(tmp_path / "forty", sizes, seed=1)
    assert [i for i in range(40) if split_of(i, 0, 0.05) == "val"] == [28] and sizes[28] + 1 < 130
    whole = corpus(texts)
    index = prepare(documents([folder]), BYTES, tmp_path / "p", workers=1, shard_tokens=700)
    held = max(round(0.05 * whole.size), 130)
    assert index["val_split"] == "tokens" and index["splits"]["val"]["tokens"] == held == 144
    assert len(index["splits"]["train"]["shards"]) > 2
    np.testing.assert_array_equal(tokens_of(tmp_path / "p", "train"), whole[:-held])
    np.testing.assert_array_equal(tokens_of(tmp_path / "p", "val"), whole[-held:])
    ends = np.cumsum([n + 1 for n in sizes])
    assert np.load(tmp_path / "p" / "train.docs.npy").tolist() == [*ends[ends < whole.size - held], whole.size - held]
    assert np.load(tmp_path / "p" / "val.docs.npy").tolist() == (ends[ends > whole.size - held] - (whole.size - held)).tolist()
    assert set(os.listdir(tmp_path / "p")) == files_of(index)


@pytest.mark.unit
def test_too_few_tokens_for_a_window_in_each_split_are_refused_naming_the_sizes(tmp_path) -> None:
    folder, _ = write_folder(tmp_path / "one", [200])
    with pytest.raises(DataError, match=r"one: 201 tokens in 1 document\(s\) are too few for a validation split: "
                       r"holding out 130 \(val_fraction=0.05 of them, at least min_val_tokens=130, one window of "
                       r"seq_len \+ 2 tokens\) leaves 71 for training, fewer than one window"):
        prepare(documents([folder]), BYTES, tmp_path / "p", workers=1)
    assert not (tmp_path / "p").exists()  # nothing half-written is left
    # a shorter window fits: 50 tokens held out (round(0.05 * 201) = 10 is fewer than a window)
    index = prepare(documents([folder]), BYTES, tmp_path / "q", workers=1, min_val_tokens=50)
    assert (index["splits"]["train"]["tokens"], index["splits"]["val"]["tokens"]) == (151, 50)
    with pytest.raises(ValueError, match="min_val_tokens must be a positive int, got 0"):
        prepare(documents([folder]), BYTES, tmp_path / "r", min_val_tokens=0)


@pytest.mark.unit
def test_many_documents_hold_out_whole_ones_and_each_split_says_how(tmp_path) -> None:
    sizes = [60 + (5 * i) % 17 for i in range(120)]
    folder, texts = write_folder(tmp_path / "many", sizes, seed=2)
    index = prepare(documents([folder]), BYTES, tmp_path / "p", workers=1)
    chosen = [i for i in range(120) if split_of(i, 0, 0.05) == "val"]
    assert index["val_split"] == "documents" and index["splits"]["val"]["documents"] == len(chosen) == 7
    np.testing.assert_array_equal(tokens_of(tmp_path / "p", "val"), corpus([texts[i] for i in chosen]))
    val, total = index["splits"]["val"]["tokens"], corpus(texts).size
    assert split_note(index) == (f"validation: held out 7 of 120 documents ({val:,} of {total:,} tokens, "
                                 f"{val / total:.1%}), chosen by a hash of their index (val_fraction 0.05)")
    none = prepare(documents([folder]), BYTES, tmp_path / "none", workers=1, val_fraction=0.0)
    assert none["val_split"] == "none" and set(none["splits"]) == {"train"}
    assert split_note(none) == ("validation: none (val_fraction 0.0); moeflow train --data on it needs validation "
                                "data of its own (--val-data)")
    few, _ = write_folder(tmp_path / "three", [2000, 3000, 3100])
    assert split_note(prepare(documents([few]), BYTES, tmp_path / "t", workers=1)) == (
        "validation: held out the last 405 tokens of 8,103 (5.0%), not whole documents: 3 document(s) are too few "
        "for val_fraction 0.05 of them to give each split one window (130 tokens)")


@pytest.mark.unit
def test_the_two_commands_share_their_defaults() -> None:
    """prepare-data's --val-fraction is train's (and LMTrainConfig's); its --min-val-tokens is
    one window of train's default --seq-len."""
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    prep, train = commands["prepare-data"].parse_args(["x", "--out", "y"]), commands["train"].parse_args([])
    fields = LMTrainConfig.__dataclass_fields__
    assert prep.val_fraction == train.val_fraction == fields["val_fraction"].default == DEFAULT_VAL_FRACTION > 0
    assert prep.min_val_tokens == DEFAULT_MIN_VAL_TOKENS == min_split_tokens(train.seq_len)
    assert train.seq_len == fields["seq_len"].default


@pytest.mark.unit
def test_an_older_index_reads_as_split_by_documents(tmp_path) -> None:
    """A preparation from before ``val_split`` (no such field) opens as it did, with the same
    fingerprints; one whose hold-out of whole documents chose none is named for what it is."""
    folder, _ = write_folder(tmp_path / "many", [60 + i % 9 for i in range(120)], seed=3)
    prepare(documents([folder]), BYTES, tmp_path / "p", workers=1)
    before = [TokenDataset(tmp_path / "p", s).fingerprint for s in ("train", "val")]
    index = json.loads((tmp_path / "p" / "index.json").read_text())
    old = {k: v for k, v in index.items() if k not in ("val_split", "min_val_tokens", "documents")}
    (tmp_path / "p" / "index.json").write_text(json.dumps(old))
    assert [TokenDataset(tmp_path / "p", s).fingerprint for s in ("train", "val")] == before
    assert split_note(old).startswith(f"validation: held out {index['splits']['val']['documents']} of 120 documents")
    cfg = LMTrainConfig(out_dir=tmp_path / "run", data=(str(tmp_path / "p"),), seq_len=32)
    opened = open_run_data(cfg, None)  # the run's validation is the prepared split, as before
    assert opened.val.datasets[0].fingerprint == before[1] and opened.train.datasets[0].fingerprint == before[0]
    # an older preparation whose --val-fraction chose no document
    prepare(documents([folder]), BYTES, tmp_path / "q", workers=1, val_fraction=0.0)
    index = json.loads((tmp_path / "q" / "index.json").read_text())
    old = {k: v for k, v in index.items() if k != "val_split"}
    (tmp_path / "q" / "index.json").write_text(json.dumps({**old, "val_fraction": 0.01}))
    cfg = LMTrainConfig(out_dir=tmp_path / "run", data=(str(tmp_path / "q"),), seq_len=32)
    assert "prepared by an older moeflow, whose --val-fraction 0.01 held out whole documents only" in validation_problem(cfg)


@pytest.mark.unit
def test_no_validation_data_is_named_before_any_work(tmp_path) -> None:
    folder, _ = write_folder(tmp_path / "raw", [300, 300])
    prepare(documents([folder]), BYTES, tmp_path / "p", workers=1, val_fraction=0.0)
    cases = {
        (str(folder),): "val_fraction=0 holds out no validation data from",
        (str(tmp_path / "p"),): "prepared with --val-fraction 0, without a validation split: give --val-data",
    }
    for data, message in cases.items():
        cfg = LMTrainConfig(out_dir=tmp_path / "run", data=data, val_fraction=0.0)
        assert message in validation_problem(cfg)
        with pytest.raises(DataError, match=message):
            open_run_data(cfg, None)
        assert validation_problem(LMTrainConfig(out_dir=tmp_path / "run", data=data, val_fraction=0.0,
                                                val_data=(str(folder),))) is None
    assert validation_problem(LMTrainConfig(out_dir=tmp_path / "run", data=(str(folder),))) is None
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- the two commands


SMALL = ["--device", "cpu", "--steps", "2", "--batch-size", "2", "--eval-batches", "1", "--layers", "1", "--dim", "32",
         "--heads", "2", "--experts-hidden", "32", "--no-progress", "--no-plot", "--sample-tokens", "0"]


@pytest.mark.e2e
@pytest.mark.parametrize("corpus_kind", ["three files", "many files", "three files, raw"])
def test_prepare_data_then_train_compose_with_their_defaults(tmp_path, capsys, corpus_kind: str) -> None:
    """``moeflow prepare-data DIR --out S`` then ``moeflow train --data S`` (the data flags and
    --seq-len at their defaults) trains and validates; on raw files train holds out alike."""
    sizes = [2000, 3000, 3100] if corpus_kind.startswith("three") else [60 + i % 13 for i in range(80)]
    folder, texts = write_folder(tmp_path / "corpus", sizes)
    data = folder
    if not corpus_kind.endswith("raw"):
        assert main(["prepare-data", str(folder), "--out", str(tmp_path / "S"), "--no-progress"]) == 0
        printed = capsys.readouterr().out.splitlines()
        index = json.loads((tmp_path / "S" / "index.json").read_text())
        assert split_note(index) in printed
        if corpus_kind == "three files":
            assert "validation: held out the last 405 tokens of 8,103 (5.0%), not whole documents" in printed[2]
        else:
            assert printed[2].startswith("validation: held out 4 of 80 documents")  # the hash: 28, 47, 50, 73
        data = tmp_path / "S"
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), *SMALL]) == 0
    printed = capsys.readouterr().out
    if corpus_kind.endswith("raw"):  # raw sources are prepared into the run, saying how validation was held out
        assert f"data: {folder}: validation: held out the last 405 tokens of 8,103 (5.0%)" in printed
    hist = json.loads((tmp_path / "run" / "history.json").read_text())
    assert len(hist["val"]) == 2 and all(np.isfinite(v) for _, v in hist["val"])


@pytest.mark.e2e
def test_no_validation_split_is_refused_before_train_claims_its_out(tmp_path, capsys) -> None:
    folder, _ = write_folder(tmp_path / "corpus", [2000, 3000])
    assert main(["prepare-data", str(folder), "--out", str(tmp_path / "S"), "--val-fraction", "0", "--no-progress"]) == 0
    assert "validation: none (val_fraction 0.0)" in capsys.readouterr().out
    assert main(["train", "--data", str(tmp_path / "S"), "--out", str(tmp_path / "run"), *SMALL]) == 2
    assert (f"moeflow train: error: {tmp_path / 'S'}: prepared with --val-fraction 0, without a validation split: "
            "give --val-data SOURCE") in capsys.readouterr().err
    assert main(["train", "--data", str(folder), "--val-fraction", "0", "--out", str(tmp_path / "run"), *SMALL]) == 2
    assert f"val_fraction=0 holds out no validation data from {folder}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the run claimed --out: the same command can be fixed


@pytest.mark.e2e
def test_repeatable_data_flags_travel_through_a_config_file(tmp_path, capsys) -> None:
    """``--data`` (repeatable) beside ``--config``, and in the TOML file a run writes: the run's
    config.toml holds the sources as an array, which ``--config`` reads back to the same run (this
    failed: the flag crashed beside --config, and the file held the list as one string)."""
    folder, _ = write_folder(tmp_path / "corpus", [2000, 3000, 3100])
    config = tmp_path / "run.toml"
    config.write_text('steps = 2\nbatch_size = 2\neval_batches = 1\nplot = false\nsample_tokens = 0\n')
    small = ["--device", "cpu", "--layers", "1", "--dim", "32", "--heads", "2", "--experts-hidden", "32", "--no-progress"]
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--data", str(folder), "--out", str(out), *small]) == 0
    capsys.readouterr()
    written = (out / "config.toml").read_text()
    assert f"data = [{json.dumps(str(folder))}]\n" in written
    again = tmp_path / "again"
    assert main(["train", "--config", str(out / "config.toml"), "--out", str(again), "--no-progress"]) == 0
    capsys.readouterr()
    first, second = (json.loads((d / "history.json").read_text()) for d in (out, again))
    assert second["train_loss"] == first["train_loss"] and second["val"] == first["val"]
    # several sources as an array, each checked as its flag would be
    config.write_text(f'data = [{json.dumps(str(folder))}, "{tmp_path / "missing"}"]\n')
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "bad"), *SMALL]) == 2
    assert "missing" in capsys.readouterr().err

"""A training run's own data (``LMTrainConfig.data``): its tokenizer, token datasets and
samplers, on every rank alike.

- A source that is a prepared corpus (``moeflow prepare-data``: a folder with ``index.json``) is
  opened as it is and brings its tokenizer.
- Raw sources (files, folders, ``hf:NAME``) are tokenized once, each into
  ``out_dir/data/<key>`` (``moeflow.train.prepare.prepare``, by rank 0, in worker processes;
  the other ranks wait and then open it), where ``key`` hashes the source's files (paths, sizes,
  modification times), the text field, the tokenizer and the validation fraction: a restarted or
  resumed run finds its data prepared, and changed files get a new preparation (which the
  checkpoint's data fingerprint then refuses to resume on).
- The tokenizer: a prepared source's (every prepared source must agree); else ``byte`` (UTF-8
  bytes and an end-of-document token), ``bpe`` (trained on the training documents by rank 0),
  or a ``tokenizer.json`` / model directory (``load_tokenizer``); with ``init_from``, the
  checkpoint's.
- Validation: ``val_data`` (prepared or raw sources, all their documents), else every source's
  validation split (raw sources: ``val_fraction`` of them, by document or, with too few
  documents, the last tokens, at least one window of ``seq_len``: ``moeflow.train.prepare``).
  ``val_fraction`` 0, or a prepared source without a validation split, has none:
  ``validation_problem`` says so before any work (``moeflow train`` refuses it before claiming
  ``out_dir``), as a run always reports a validation loss.

Every rank memory-maps the same prepared files and reads only its own rows of each batch
(``TokenSampler``), ``mmap_window`` bytes of a shard at a time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from moeflow.parallel.comm import ProcessGroup, gather_objects, process_position, sync
from moeflow.train.data import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_from_dict
from moeflow.train.lm_checkpoint import on_rank0
from moeflow.train.lm_config import LMTrainConfig, source_weight
from moeflow.train.sources import DataError, documents, source_files
from moeflow.train.prepare import DEFAULT_VAL_FRACTION, INDEX, min_split_tokens, prepare, split_note
from moeflow.train.tokens import TokenDataset, TokenSampler

__all__ = ["RunData", "open_run_data", "is_prepared", "validation_problem"]


@dataclass
class RunData:
    tokenizer: Tokenizer
    train: TokenSampler
    val: TokenSampler
    fingerprint: dict
    notes: list[str] = field(default_factory=list)  # what rank 0 reports (preparations, skipped documents)


def is_prepared(source: str) -> bool:
    """A folder ``moeflow prepare-data`` wrote (it holds ``index.json``)."""
    return not source.startswith("hf:") and (Path(source) / INDEX).is_file()


def _files_key(source: str) -> list:
    if source.startswith("hf:"):
        return [source]
    out = []
    for f in source_files(source):
        st = f.stat() if f.is_file() else None
        out.append([str(f.resolve()), st.st_size if st else None, st.st_mtime_ns if st else None])
    return out


def _tokenizer(cfg: LMTrainConfig, prepared: list[str], raw: list[str], group: ProcessGroup | None) -> Tokenizer:
    if cfg.init_from is not None:
        saved = cfg.init_extra().get("tokenizer")  # type: ignore[union-attr]
        return ByteTokenizer() if saved is None else tokenizer_from_dict(saved)
    if prepared:
        descs = {json.dumps(TokenDataset(p, _first_split(p), verify=False).tokenizer, sort_keys=True): p
                 for p in prepared}
        if len(descs) > 1:
            raise DataError(f"the prepared sources {sorted(descs.values())} were tokenized with different tokenizers")
        if cfg.tokenizer != "byte":
            raise DataError(f"tokenizer={cfg.tokenizer!r}: the prepared sources bring their own tokenizer (the one "
                            f"they were tokenized with); prepare them with {cfg.tokenizer!r} instead")
        return tokenizer_from_dict(json.loads(next(iter(descs))))
    if cfg.tokenizer == "byte":
        return ByteTokenizer(encoding="utf-8", eod=True)
    if cfg.tokenizer == "bpe":
        rank, _ = process_position(group)
        # trained once, on rank 0, and shared, so every rank encodes with the very same merges
        desc = None
        if rank == 0:
            texts = (d.text for d in documents(raw, text_field=cfg.text_field, skip_empty=cfg.skip_empty))
            desc = BPETokenizer.train(texts, cfg.bpe_vocab, eod=True).to_dict()  # streamed
        return tokenizer_from_dict(gather_objects(desc, group)[0])  # type: ignore[arg-type]
    return load_tokenizer(cfg.tokenizer)


def _first_split(path: str) -> str:
    index = json.loads((Path(path) / INDEX).read_text())
    return "train" if "train" in index.get("splits", {}) else next(iter(index.get("splits", {"train": 0})))


def _prepared_dir(cfg: LMTrainConfig, source: str, tok: Tokenizer, val_fraction: float,
                  group: ProcessGroup | None, notes: list[str]) -> str:
    """``source`` itself when prepared, else its preparation under ``out_dir/data`` (made by
    rank 0 when missing)."""
    if is_prepared(source):
        return source
    # a hold-out keeps at least one window of seq_len in each split (the minimum decides a token
    # hold-out's size, so it is part of the key; without a hold-out it changes nothing)
    min_val = {"min_val_tokens": min_split_tokens(cfg.seq_len)} if val_fraction else {}
    key = hashlib.sha256(json.dumps({"files": _files_key(source), "text_field": cfg.text_field,
                                     "skip_empty": cfg.skip_empty, "tokenizer": tok.to_dict(),
                                     "val_fraction": val_fraction, "seed": cfg.seed, **min_val}, sort_keys=True).encode()
                         ).hexdigest()[:16]
    target = cfg.out_dir / "data" / key

    def make() -> list[str]:
        if (target / INDEX).is_file():
            return []
        if target.exists():  # an unfinished preparation (killed): start it again
            import shutil

            shutil.rmtree(target)
        docs = documents([source], text_field=cfg.text_field, skip_empty=cfg.skip_empty)
        index = prepare(docs, tok, target, val_fraction=val_fraction, min_val_tokens=min_split_tokens(cfg.seq_len),
                        seed=cfg.seed)
        counts = {k: (v["documents"], v["tokens"]) for k, v in index["splits"].items()}
        skipped = f", {index['skipped_empty']} empty documents skipped" if index["skipped_empty"] else ""
        made = (f"data: {source} -> {target}: " + ", ".join(f"{k} {d} documents / {t} tokens"
                                                            for k, (d, t) in counts.items()) + skipped)
        return [made] if not val_fraction else [made, f"data: {source}: {split_note(index)}"]

    notes.extend(on_rank0(make, group))
    sync(group)
    return str(target)


def validation_problem(cfg: LMTrainConfig) -> str | None:
    """Why a run on one's own data would have no validation data (None: it has some), read
    before any work: ``val_data`` always gives some; without it, ``val_fraction`` 0 on a raw
    source, or a prepared source without a validation split (prepared with ``val_fraction`` 0,
    or by an older moeflow whose hold-out of whole documents chose none), gives none."""
    if not cfg.data or cfg.val_data:
        return None
    for source in cfg.data:
        s, _ = source_weight(source)
        if not is_prepared(s):
            if cfg.val_fraction == 0:
                return (f"val_fraction=0 holds out no validation data from {s}: give --val-data SOURCE, or a "
                        f"--val-fraction above 0 (default {DEFAULT_VAL_FRACTION})")
            continue
        try:
            index = json.loads((Path(s) / INDEX).read_text())
        except (OSError, ValueError):
            continue  # TokenDataset names what is wrong with it
        splits = index.get("splits") if isinstance(index, dict) else None
        if not isinstance(splits, dict) or "val" in splits:
            continue
        if not index.get("val_fraction"):
            return (f"{s}: prepared with --val-fraction 0, without a validation split: give --val-data SOURCE, or "
                    f"prepare it again with a --val-fraction above 0 (prepare-data's default {DEFAULT_VAL_FRACTION})")
        return (f"{s}: prepared by an older moeflow, whose --val-fraction {index['val_fraction']} held out whole "
                "documents only and chose none: prepare it again (too few documents then hold out the last tokens), "
                "or give --val-data SOURCE")
    return None


def open_run_data(cfg: LMTrainConfig, group: ProcessGroup | None) -> RunData:
    """The run's tokenizer, train and validation samplers (module docstring). Every rank of
    ``group`` calls it. Bad data raises ``DataError`` (a ``ValueError``) naming the file."""
    train_sources = [source_weight(s) for s in cfg.data]
    val_sources = [source_weight(s) for s in cfg.val_data]
    every = [s for s, _ in train_sources + val_sources]
    prepared = [s for s in every if is_prepared(s)]
    raw = [s for s, _ in train_sources if not is_prepared(s)]
    for s in every:
        if not s.startswith("hf:") and not Path(s).exists():
            raise DataError(f"{s}: no such file or folder")
    problem = validation_problem(cfg)
    if problem is not None:
        raise DataError(problem)
    tok = _tokenizer(cfg, prepared, raw, group)
    notes: list[str] = []
    split_val = 0.0 if cfg.val_data else cfg.val_fraction
    desc = tok.to_dict()

    def opened(source: str, split: str, val_fraction: float) -> TokenDataset:
        path = _prepared_dir(cfg, source, tok, val_fraction, group, notes)
        return TokenDataset(path, split, window_bytes=cfg.mmap_window, tokenizer=desc)

    train_ds = [opened(s, "train", split_val) for s, _ in train_sources]
    if cfg.val_data:
        val_ds = [opened(s, "train", 0.0) for s, _ in val_sources]
        val_w = [w for _, w in val_sources]
    else:  # every source's own validation split (validation_problem: they have one)
        val_ds = [TokenDataset(ds.path, "val", window_bytes=cfg.mmap_window, tokenizer=desc) for ds in train_ds]
        val_w = [w for _, w in train_sources]
    train = TokenSampler(train_ds, [w for _, w in train_sources], cfg.seq_len, cfg.seed)
    val = TokenSampler(val_ds, val_w, cfg.seq_len, cfg.seed + 1)
    return RunData(tok, train, val, {"train": train.fingerprint, "val": val.fingerprint}, notes)

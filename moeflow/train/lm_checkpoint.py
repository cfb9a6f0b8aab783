"""A ``moeflow train`` run directory: what it and its checkpoints hold, and reading them back.

One run per directory (``out_dir``)::

    run.json               the run's identity: {"format": "moeflow-run/1", "run_id", "created"}, and
                           under torchrun the job that claimed it last: "rdzv_id" (torchrun's
                           ``--rdzv-id``, ``TORCHELASTIC_RUN_ID``), so that the job's restarts and
                           nodes that join it later know the run is theirs (``claimed_by``)
    history.json           losses, validation, expert load, lr, ... (``train_lm``'s history):
                           rewritten by rank 0 before every checkpoint and at the end;
                           "world_sizes": [[step, ranks], ...], where each start or restart
                           began and on how many ranks (an elastic job changes it)
    checkpoints/step-*     the checkpoints (``moeflow.checkpoint``); their ``extra`` is
                           ``checkpoint_extra``: model family and config, dtype, tokenizer, the
                           training config and the run id (small: no history, flat in steps);
                           with ``init_from``, that model's special tokens and Hugging Face files
    training.png, tuned.json
                           the plot, the tuner's choices (``train_config.json``, which older
                           ``--nproc`` runs wrote, is removed by ``overwrite`` too)

Rules, checked by ``inspect_run`` before any training work (read-only), on rank 0 of a job
(``open_run`` shares the verdict, so a refusal raises on every rank):

- A directory *holds a run* when it has ``run.json``, ``history.json`` or any checkpoint
  directory (complete or partial). A new run (``resume=False``) into such a directory is refused
  unless ``overwrite=True``, which deletes exactly the files listed above (never other files;
  never the file ``tuned`` names, this run's input) and starts a new run id.
- ``resume=True`` continues from the latest complete checkpoint: ``run.json``, that checkpoint
  and ``history.json`` must name the same run (else the directory mixes runs: refused); the
  checkpoint must be ``moeflow train``'s with the same model and data settings; ``steps`` below
  its step is refused, equal to it means finished (nothing is touched, the saved history is
  returned). Without a checkpoint it starts from step 0 under the directory's run id.
- What resuming restores: weights, optimizer and router state, and each rank's RNG from the
  checkpoint; the data position is the step (batches are drawn by step number); the history
  (the loss curve for the plot) is ``history.json`` cut at the checkpoint's step. It is written
  before each save, so it is never behind a complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from moeflow.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    partial_checkpoints,
    read_index,
)
from moeflow.checkpoint.format import checkpoint_dir
from moeflow.models import GPTConfig, MoEGPT
from moeflow.parallel.comm import ProcessGroup, gather_objects, process_position
from moeflow.train.data import Tokenizer, tokenizer_from_dict
from moeflow.train.init_from import MODEL_OVERRIDES, carried_extra
from moeflow.train.lm_config import LMTrainConfig

__all__ = ["MODEL_FAMILY", "RunState", "build_from_checkpoint", "checkpoint_extra", "claim_run", "claimed_by",
           "inspect_run", "new_history", "on_rank0", "open_run", "write_history"]

MODEL_FAMILY = "moeflow.MoEGPT"
RUN_FORMAT = "moeflow-run/1"
RUN_FILE, HISTORY_FILE = "run.json", "history.json"
# outputs a run writes that alone do not show a run lives there; ``overwrite`` deletes them too
_OUTPUTS = ("training.png", "tuned.json", "train_config.json", "metrics.jsonl", "config.toml", "tensorboard",
            f".{RUN_FILE}.tmp", f".{HISTORY_FILE}.tmp")

# these decide which data each step sees: a resumed run must keep them
_DATA_SETTINGS = ("batch_size", "grad_accum", "seq_len", "seed", "tokenizer", "bpe_vocab", "val_works", "data", "val_data",
                  "val_fraction", "text_field", "skip_empty")

T = TypeVar("T")


def checkpoint_extra(cfg: LMTrainConfig, model_cfg: GPTConfig, tok: Tokenizer, run_id: str,
                     data: dict | None = None) -> dict:
    """The ``extra`` every checkpoint of this run stores: what rebuilding and resuming need
    (``data``: the fingerprints of one's own training and validation data), and with
    ``init_from`` what generating and exporting need of that model (``carried_extra``)."""
    extra = {"family": MODEL_FAMILY, "model": model_cfg.to_dict(), "dtype": cfg.dtype, "tokenizer": tok.to_dict(),
             "train": cfg.to_dict(), "run_id": run_id, **carried_extra(cfg.init_extra())}
    return extra if data is None else {**extra, "data": data}


def new_history(run_id: str) -> dict:
    """The history of a run before its first step (``train_lm`` appends to every list)."""
    return {"run_id": run_id, "step": [], "train_loss": [], "lr": [], "val": [], "load": [], "rebalance": [],
            "world_sizes": []}


def _history_until(history: dict, step: int) -> dict:
    """``history`` as it stood after ``step``; the totals of a finished run (throughput, world
    size, tuned settings, final checkpoint) are left out: the continued run computes them."""
    keep = [i for i, s in enumerate(history["step"]) if s <= step]
    out = {"run_id": history.get("run_id")}
    for key in ("step", "train_loss", "lr"):
        out[key] = [history[key][i] for i in keep]
    for key in ("val", "load", "rebalance", "world_sizes", "skipped"):
        out[key] = [entry for entry in history.get(key, []) if entry[0] <= step]
    return out


def _without_recompute(model: dict) -> dict:
    """A model config dict without ``experts.recompute`` (and ``recompute_chunks``): recomputing
    the expert activations changes memory and time, not the model (a run may resume with it
    turned on or off, and checkpoints from before the option existed do not record it)."""
    experts = model.get("experts")
    if not isinstance(experts, dict):
        return model
    return {**model, "experts": {k: v for k, v in experts.items() if k not in ("recompute", "recompute_chunks")}}


def _write_json(path: Path, obj: object) -> None:
    """Replace ``path`` atomically (a reader or a crash sees the old file or the new one)."""
    part = path.with_name(f".{path.name}.tmp")
    with open(part, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); move it away, or start over with overwrite=True "
                         "(--overwrite)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def write_history(out_dir: Path, history: dict) -> None:
    """Rank 0 writes ``history`` to ``out_dir/history.json`` (atomically)."""
    _write_json(out_dir / HISTORY_FILE, history)


# ----------------------------------------------------------------------------- the run directory


@dataclass(frozen=True)
class RunState:
    """What ``out_dir`` holds for this run, decided before any training work."""

    run_id: str
    start: int  # the step training continues from (0: from the beginning)
    checkpoint: Path | None  # the checkpoint it continues from
    history: dict  # the history up to ``start`` (the whole saved one when finished)
    finished: bool  # resume=True on a run already at ``steps``: nothing to do
    remove: tuple[Path, ...] = ()  # what overwrite=True deletes, run.json last


def _run_markers(out: Path) -> list[Path]:
    """The files and directories under ``out`` that show a run lives there."""
    ckpts = out / "checkpoints"
    return ([out / name for name in (RUN_FILE, HISTORY_FILE) if (out / name).exists()]
            + complete_checkpoints(ckpts) + partial_checkpoints(ckpts))


def _removable(cfg: LMTrainConfig, markers: list[Path]) -> tuple[Path, ...]:
    """The run files ``overwrite`` deletes: checkpoints first, ``run.json`` last (an interrupted
    delete still reads as a run), never the file ``tuned`` names."""
    out = cfg.out_dir
    files = [p for p in markers if p.parent != out] + [out / n for n in (*_OUTPUTS, HISTORY_FILE, RUN_FILE)]
    keep = cfg.tuned.resolve() if cfg.tuned is not None else None
    return tuple(p for p in files if p.exists() and p.resolve() != keep)


def _describe(out: Path, markers: list[Path]) -> str:
    names = [str(p.relative_to(out)) for p in markers]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    run = _read_json(out / RUN_FILE) if (out / RUN_FILE).exists() else None
    latest = latest_checkpoint(out / "checkpoints")
    return (f"run {run.get('run_id')!r}: " if run else "") + shown + (
        f"; latest complete checkpoint: step {read_index(latest)['step']}" if latest else "; no complete checkpoint")


def _check_resumable(cfg: LMTrainConfig, path: Path, index: dict) -> None:
    """Refuse to continue the checkpoint ``path`` under settings that would not continue it."""
    extra, step = index["extra"], index["step"]
    if extra.get("family") != MODEL_FAMILY:
        raise ValueError(f"{path}: not a `moeflow train` checkpoint (family {extra.get('family')!r}); "
                         "resume=True continues a run of train_lm")
    # every message names the setting at fault first (the command line names its flag from it)
    saved, now_train = extra.get("train", {}), cfg.to_dict()
    # a checkpoint from before a setting existed had its default
    defaults = {f.name: LMTrainConfig(out_dir=cfg.out_dir).to_dict()[f.name] for f in dataclasses.fields(LMTrainConfig)}
    changed = {k: (saved.get(k, defaults[k]), v) for k, v in now_train.items()
               if k in _DATA_SETTINGS and saved.get(k, defaults[k]) != v}
    if changed:
        raise ValueError(f"{_settings(changed)}: resume=True continues the checkpoint {path} on the data it was "
                         f"trained with ({', '.join(_DATA_SETTINGS)} as saved); give the saved values, or start a new "
                         "run (another out_dir, or overwrite=True)")
    saved_model = extra.get("model")
    if not isinstance(saved_model, dict) or "vocab_size" not in saved_model:
        raise ValueError(f"{path}/index.json: no model config; it cannot be resumed")
    now = _without_recompute(cfg.model_config(vocab_size=saved_model["vocab_size"]).to_dict())
    saved_model = _without_recompute(saved_model)
    changed = _model_changes(saved_model, now)
    if changed:
        given = [f"{k}={now_train[k]!r}" for k in ("preset", *MODEL_OVERRIDES, "init_from")
                 if k in saved and saved[k] != now_train[k]]
        diff = "; ".join(f"{k}: {was!r} -> {now!r}" for k, (was, now) in changed.items())
        raise ValueError(f"{', '.join(given) or 'this run'} would change the model of the checkpoint {path} ({diff}), "
                         "which resume=True continues; resume with the run's own model settings, or start a new run "
                         "(another out_dir, or overwrite=True)")
    if cfg.steps < step:
        raise ValueError(f"steps={cfg.steps} is below step {step} of the checkpoint {path} that resume=True "
                         f"continues; a run is not shortened: pass steps={step} (finished, nothing to do) or more")


def _settings(changed: dict[str, tuple[object, object]]) -> str:
    """``num_experts=4 (the checkpoint's run: 8), ...`` from ``{name: (saved, now)}``."""
    return ", ".join(f"{k}={now!r} (the checkpoint's run: {was!r})" for k, (was, now) in changed.items())


def _model_changes(saved: dict, now: dict) -> dict[str, tuple[object, object]]:
    """``{key: (saved, now)}`` of the keys of ``now`` whose value differs in ``saved``, a nested
    config by its own keys (``router.load_balance_coef``): empty exactly when each is equal."""
    out: dict[str, tuple[object, object]] = {}
    for k, v in now.items():
        was = saved.get(k)
        if isinstance(v, dict) and isinstance(was, dict):
            out.update({f"{k}.{n}": (was.get(n), v.get(n)) for n in {**was, **v} if was.get(n) != v.get(n)})
        elif was != v:
            out[k] = (was, v)
    return out


def _restored_history(out: Path, path: Path, step: int, saved: dict | None, legacy: dict | None) -> dict:
    """The history up to ``step`` from ``history.json`` (or, for checkpoints written before the
    history left the index, from the index), checked to hold every step up to it."""
    for source in (saved, legacy):
        if source is None:
            continue
        try:
            kept = _history_until(source, step)
        except (KeyError, IndexError, TypeError) as err:
            raise ValueError(f"resume=True reads {out / HISTORY_FILE}: malformed history ({err!r})") from None
        if kept["step"] == list(range(1, step + 1)):
            return kept
    found = "is missing" if saved is None else f"covers steps {saved.get('step', [])[:1]}..{saved.get('step', [])[-1:]}"
    raise ValueError(f"resume=True needs {out / HISTORY_FILE} up to step {step}, the step of the checkpoint {path}, "
                     f"but the file {found}: restore it, or start over with overwrite=True")


def inspect_run(cfg: LMTrainConfig) -> RunState:
    """What ``cfg.out_dir`` holds and what this run does there (read-only; the rules are in the
    module docstring). Raises ``ValueError`` naming the argument and value it refuses."""
    out = cfg.out_dir
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir={str(out)!r} exists and is not a directory")
    markers = _run_markers(out)
    if not cfg.resume:
        if markers and not cfg.overwrite:
            raise ValueError(f"out_dir={str(out)!r} already holds a run ({_describe(out, markers)}); pass resume=True "
                             "(--resume) to continue it, or overwrite=True (--overwrite) to delete its files and start "
                             "a new run there")
        run_id = uuid.uuid4().hex
        remove = _removable(cfg, markers) if cfg.overwrite else ()
        return RunState(run_id=run_id, start=0, checkpoint=None, history=new_history(run_id), finished=False,
                        remove=remove)
    run, saved = _read_json(out / RUN_FILE), _read_json(out / HISTORY_FILE)
    latest = latest_checkpoint(out / "checkpoints")
    index = read_index(latest) if latest is not None else None
    sources = {RUN_FILE: run, HISTORY_FILE: saved}
    if latest is not None and index is not None:
        sources[f"checkpoints/{latest.name}"] = index["extra"]
    ids = {name: doc["run_id"] for name, doc in sources.items() if doc is not None and doc.get("run_id")}
    if len(set(ids.values())) > 1:
        raise ValueError(f"out_dir={str(out)!r} mixes runs ({', '.join(f'{k}: {v}' for k, v in ids.items())}); "
                         "resume=True cannot tell which to continue: move one run's files elsewhere")
    run_id = next(iter(ids.values()), None) or uuid.uuid4().hex
    if latest is None or index is None:
        return RunState(run_id=run_id, start=0, checkpoint=None, history=new_history(run_id), finished=False)
    _check_resumable(cfg, latest, index)
    step = index["step"]
    history = _restored_history(out, latest, step, saved, index["extra"].get("history"))
    finished = step == cfg.steps
    if finished and saved is not None and saved.get("step") == history["step"]:
        history = saved  # the finished run's own record, totals included
    return RunState(run_id=run_id, start=step, checkpoint=latest, history={**history, "run_id": run_id},
                    finished=finished)


def claim_run(cfg: LMTrainConfig, state: RunState, *, rdzv_id: str | None = None) -> None:
    """Make ``cfg.out_dir`` this run's (after ``inspect_run``, before any training; rank 0):
    delete what ``overwrite`` replaces and write ``run.json`` if it is missing. ``rdzv_id``: the
    torchrun job claiming it (``claimed_by`` reads it back), recorded in ``run.json``."""
    for path in state.remove:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    ckpts = cfg.out_dir / "checkpoints"
    if state.remove and ckpts.is_dir() and not any(ckpts.iterdir()):
        ckpts.rmdir()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    run = _read_json(cfg.out_dir / RUN_FILE) or {
        "format": RUN_FORMAT, "run_id": state.run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if not (cfg.out_dir / RUN_FILE).exists() or (rdzv_id is not None and run.get("rdzv_id") != rdzv_id):
        _write_json(cfg.out_dir / RUN_FILE, run if rdzv_id is None else {**run, "rdzv_id": rdzv_id})


def claimed_by(out_dir: Path, rdzv_id: str) -> str | None:
    """The id of the run in ``out_dir`` when the torchrun job ``rdzv_id`` claimed it (its
    ``run.json`` records that job), else None. A restart of the job, or a node that joins it,
    continues that run: the record lives with the run, so it holds whatever store torchrun gives
    the workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt a new one)."""
    run = _read_json(Path(out_dir) / RUN_FILE)
    if run is None or run.get("rdzv_id") != rdzv_id or not isinstance(run.get("run_id"), str):
        return None
    return run["run_id"]


def on_rank0(fn: Callable[[], T], group: ProcessGroup | None) -> T:
    """``fn()`` run on rank 0 only, its result shared with every rank of ``group``; when it
    raises, every rank raises (rank 0 its own error, the others a ``ValueError`` with its
    message) instead of the others waiting in their next collective."""
    rank, _ = process_position(group)
    outcome: tuple = ("ok", None)
    error: Exception | None = None
    if rank == 0:
        try:
            outcome = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - re-raised below, after every rank has heard of it
            outcome, error = ("error", f"{type(err).__name__}: {err}"), err
    shared = gather_objects(outcome, group)[0]
    if error is not None:
        raise error
    if shared[0] == "error":
        raise ValueError(f"rank 0: {shared[1]}")
    return shared[1]


def open_run(cfg: LMTrainConfig, group: ProcessGroup | None) -> RunState:
    """``inspect_run`` and, unless the run is finished, ``claim_run``, on rank 0; every rank of
    ``group`` calls it and gets the same ``RunState``, whose history records in ``"world_sizes"``
    the step this start begins at and the number of ranks of ``group``."""

    _, world = process_position(group)

    def inspect_and_claim() -> RunState:
        state = inspect_run(cfg)
        if state.finished:
            return state
        claim_run(cfg, state)
        sizes = [*state.history.get("world_sizes", []), [state.start, world]]
        return dataclasses.replace(state, history={**state.history, "world_sizes": sizes})

    return on_rank0(inspect_and_claim, group)


def build_from_checkpoint(path: str | Path, *, device: str = "cpu") -> tuple[MoEGPT, Tokenizer | None, dict]:
    """Rebuild the model and tokenizer a ``moeflow train`` (or ``moeflow convert --from-hf``)
    checkpoint was written with and load its weights (one process, whatever world size wrote
    it). Returns ``(model, tokenizer, info)``; the tokenizer is ``None`` only for a model converted
    from a Hugging Face directory without ``tokenizer.json``."""
    path = Path(path)
    if not (path / "index.json").exists() and latest_checkpoint(path) is None:
        if latest_checkpoint(path / "checkpoints") is None:
            raise CheckpointError(f"{path}: no complete checkpoint here (nor under {path / 'checkpoints'})")
        path = path / "checkpoints"  # a run directory
    path = checkpoint_dir(path)  # a step directory without index.json is refused, never replaced
    extra = read_index(path)["extra"]
    if extra.get("family") != MODEL_FAMILY:
        raise CheckpointError(
            f"{path}: not a {MODEL_FAMILY} checkpoint (family {extra.get('family')!r}); "
            "it was not written by `moeflow train`"
        )
    try:
        model_cfg = GPTConfig.from_dict(extra["model"])
        tok = tokenizer_from_dict(extra["tokenizer"]) if extra.get("tokenizer") is not None else None
        dtype = getattr(torch, extra.get("dtype", "float32"))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {extra.get('dtype')!r} is not a torch dtype")
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}/index.json: corrupt model or tokenizer description: {err}") from err
    model = MoEGPT(model_cfg, device=device, dtype=dtype)
    info = load_checkpoint(path, model, restore_rng=False)
    model.eval()
    return model, tok, info

"""The language-model training loop (``moeflow.train.lm``, ``moeflow train``): its config validates
(no compute), a short run on real text lowers the loss and resumes exactly, its ``out_dir`` holds
one run (``moeflow.train.lm_checkpoint``), a non-finite step stops the run (or is skipped) and
never becomes a checkpoint, and on 2 and 4 gloo ranks (expert parallel) it trains like one
process on the same global batches, keeps the same run-directory rules and stops together."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import moeflow.train.lm as lm
from moeflow.checkpoint import read_index
from moeflow.train import LMTrainConfig, build_from_checkpoint, train_lm
from moeflow.train.nonfinite import NonFiniteLossError, check_parameters_finite

from helpers import file_states, run_until_checkpoint, spawn_ranks


# ----------------------------------------------------------------------------- config


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(tokenizer="words"), "tokenizer"),
        (dict(batch_size=10, grad_accum=4), "grad_accum"),
        (dict(lr=-1.0), "lr"),
        (dict(min_lr=1.0), "min_lr"),
        (dict(amp="fp8"), "amp"),
        (dict(preset="nope"), "preset"),
        (dict(top_k=20), "top_k"),
        (dict(steps=0), "steps"),
        (dict(resume=True, overwrite=True), "resume=True and overwrite=True contradict"),
        (dict(stall_timeout_s=0), "stall_timeout_s must be > 0 seconds, got 0"),
        (dict(collective_timeout_s=float("inf")), "collective_timeout_s must be finite"),
        (dict(exchange="ring"), "exchange must be 'auto', 'flat' or 'two-level', got 'ring'"),
        # non-finite numbers pass no comparison (nan > 0 is False): each is refused by name
        (dict(lr=float("inf")), "lr must be finite, got inf"),
        (dict(lr=float("nan")), "lr must be finite, got nan"),
        (dict(min_lr=float("nan")), "min_lr must be finite"),
        (dict(grad_clip=float("nan")), "grad_clip must be finite"),
        (dict(weight_decay=float("nan")), "weight_decay must be finite"),
        (dict(capacity_factor=float("inf")), "capacity_factor must be finite"),
        (dict(load_balance_coef=float("nan")), "load_balance_coef must be finite"),
        (dict(device="nonsense"), "device must name a torch device"),
        (dict(skip_nonfinite=-1), "skip_nonfinite must be >= 0"),
        (dict(tokenizer="bpe", bpe_vocab=100), "bpe_vocab must be >= 257"),
    ],
)
def test_train_config_rejects_bad_values(tmp_path, fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LMTrainConfig(out_dir=tmp_path, **fields)


@pytest.mark.unit
def test_train_config_round_trips_through_json_dict(tmp_path) -> None:
    cfg = LMTrainConfig(out_dir=tmp_path, steps=7, val_works=("hamlet",), load_balance_coef=0.0)
    assert LMTrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.model_config(vocab_size=256).router.load_balance_coef == 0.0


# ----------------------------------------------------------------------------- one process, real text


@pytest.mark.e2e
def test_loss_falls_on_real_text_and_checkpoint_samples(tmp_path) -> None:
    cfg = LMTrainConfig(out_dir=tmp_path, steps=40, batch_size=16, seq_len=64, warmup_steps=5, eval_every=20,
                        eval_batches=4, progress=False)
    hist = train_lm(cfg)
    before, after = hist["val"][0][1], hist["val"][-1][1]
    assert before > 5.0 and after < before - 2.0, hist["val"]
    assert (tmp_path / "training.png").stat().st_size > 10_000
    assert len(hist["load"][-1][1]) == 4 and abs(sum(hist["load"][-1][1][0]) - 1) < 1e-6
    model, tok, info = build_from_checkpoint(tmp_path)
    assert info["step"] == 40
    out = model.generate(torch.tensor([tok.encode("KING.\n")]), 20, temperature=0)
    assert out.shape == (1, 26)


@pytest.mark.e2e
def test_expert_recompute_trains_the_same_run(tmp_path) -> None:
    """``expert_recompute`` changes memory and time, not the run: the same losses bit for bit
    (fp64), recorded in the saved model config, and a run resumes with it turned off."""
    import shutil

    kw = dict(steps=4, batch_size=4, seq_len=32, warmup_steps=1, eval_every=0, eval_batches=1, progress=False,
              plot=False, dtype="float64")
    plain = train_lm(LMTrainConfig(out_dir=tmp_path / "plain", **kw))
    again = train_lm(LMTrainConfig(out_dir=tmp_path / "re", expert_recompute=True, checkpoint_every=2, **kw))
    assert again["train_loss"] == plain["train_loss"]
    index = json.loads((tmp_path / "re" / "checkpoints" / "step-00000004" / "index.json").read_text())
    assert index["extra"]["model"]["experts"]["recompute"] is True
    shutil.rmtree(tmp_path / "re" / "checkpoints" / "step-00000004")
    resumed = train_lm(LMTrainConfig(out_dir=tmp_path / "re", resume=True, **kw))  # recompute off now
    assert resumed["train_loss"] == plain["train_loss"]


@pytest.mark.e2e
def test_resume_continues_the_same_run(tmp_path) -> None:
    kw = dict(steps=6, batch_size=4, seq_len=32, warmup_steps=1, eval_every=0, eval_batches=1, progress=False,
              plot=False, dtype="float64")
    full = train_lm(LMTrainConfig(out_dir=tmp_path / "full", **kw))
    train_lm(LMTrainConfig(out_dir=tmp_path / "part", checkpoint_every=3, **kw))
    # a run that stopped at step 3 and resumed gives the same losses
    import shutil

    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-00000006")
    resumed = train_lm(LMTrainConfig(out_dir=tmp_path / "part", resume=True, **kw))
    torch.testing.assert_close(torch.tensor(resumed["train_loss"]), torch.tensor(full["train_loss"]), rtol=1e-10, atol=0)
    # other data settings would silently train on other batches: refused
    with pytest.raises(ValueError, match="grad_accum"):
        train_lm(LMTrainConfig(out_dir=tmp_path / "part", resume=True, **{**kw, "steps": 8, "grad_accum": 2}))


def _no_training_work(*args, **kwargs):
    raise AssertionError("training work started (the tokenizer was built)")


def _same_parameters(a: Path, b: Path) -> None:
    (ma, _, _), (mb, _, _) = build_from_checkpoint(a), build_from_checkpoint(b)
    for (n, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.e2e
def test_out_dir_holds_one_run(tmp_path, monkeypatch) -> None:
    """A new run into another run's directory, and steps below its checkpoint, are refused before
    any work; resuming a finished run touches nothing; raising steps continues it exactly as an
    uninterrupted run (fp64, bit for bit), past a leftover temporary and a half-written step
    directory; the index stays small; overwrite replaces only the run's own files."""
    # lr == min_lr: a flat schedule, so a 3-step run is the start of a 6-step one
    kw = dict(steps=3, batch_size=4, seq_len=32, warmup_steps=1, eval_every=0, eval_batches=1, progress=False,
              plot=False, dtype="float64", lr=1e-3, min_lr=1e-3)
    run = tmp_path / "run"
    first = train_lm(LMTrainConfig(out_dir=run, **kw))
    (run / "notes.txt").write_text("not moeflow's")
    before = file_states(run)
    with monkeypatch.context() as m:
        m.setattr(lm, "corpus_tokenizer", _no_training_work)
        with pytest.raises(ValueError, match=r"out_dir=.*already holds a run .*step 3.*resume=True.*overwrite=True"):
            train_lm(LMTrainConfig(out_dir=run, **kw))
        with pytest.raises(ValueError, match="steps=2 is below step 3 of the checkpoint"):
            train_lm(LMTrainConfig(out_dir=run, resume=True, **{**kw, "steps": 2}))
        assert train_lm(LMTrainConfig(out_dir=run, resume=True, **kw)) == first  # finished: the saved history
    assert file_states(run) == before

    ckpts = run / "checkpoints"
    (ckpts / ".tmp-step-00000004").mkdir()  # remains of a killed save
    (ckpts / "step-00000006").mkdir()  # killed between the rename and the index, or half copied
    (ckpts / "step-00000006" / "rank00000-of-00001.safetensors").write_bytes(b"half")
    resumed = train_lm(LMTrainConfig(out_dir=run, resume=True, **{**kw, "steps": 6}))
    full = train_lm(LMTrainConfig(out_dir=tmp_path / "full", **{**kw, "steps": 6}))
    assert resumed["train_loss"] == full["train_loss"] and resumed["step"] == list(range(1, 7))
    assert resumed["run_id"] == first["run_id"] != full["run_id"]
    assert json.loads((run / "history.json").read_text()) == resumed
    _same_parameters(run, tmp_path / "full")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000003", "step-00000006"]

    # the index holds what resuming needs (no history): the same size after 3 and after 6 steps
    sizes = [(p / "index.json").stat().st_size for p in sorted(ckpts.iterdir())]
    assert max(sizes) - min(sizes) < 8, sizes
    assert "history" not in read_index(ckpts / "step-00000006")["extra"]

    # files of two runs in one directory: resume cannot tell which to continue
    (tmp_path / "full" / "run.json").write_text(json.dumps({"run_id": "another"}))
    with pytest.raises(ValueError, match=r"mixes runs \(run.json: another, history.json: "):
        train_lm(LMTrainConfig(out_dir=tmp_path / "full", resume=True, **{**kw, "steps": 6}))

    new = train_lm(LMTrainConfig(out_dir=run, overwrite=True, **{**kw, "steps": 1}))
    assert new["run_id"] != first["run_id"] and new["train_loss"] == first["train_loss"][:1]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000001"]
    assert (run / "notes.txt").read_text() == "not moeflow's"
    assert json.loads((run / "run.json").read_text())["run_id"] == new["run_id"]


def _saved_run(out: Path, step: int, history_steps: int, seed: int, **kw) -> tuple[LMTrainConfig, dict]:
    """A run directory as ``train_lm`` leaves it, made without training: ``run.json``, a
    checkpoint of a tiny model at ``step`` with ``checkpoint_extra``, and ``history.json`` up to
    ``history_steps`` (random entries, one of each kind every few steps). Returns the run's
    config (``resume=True``) and the history written."""
    from moeflow.checkpoint import save_checkpoint
    from moeflow.models import MoEGPT
    from moeflow.train.data import ByteTokenizer
    from moeflow.train.lm_checkpoint import checkpoint_extra, new_history, write_history

    cfg = LMTrainConfig(out_dir=out, steps=step + 4, n_layers=1, dim=16, n_heads=2, expert_hidden=16, seq_len=16,
                        progress=False, plot=False, resume=True, **kw)
    model_cfg = cfg.model_config(vocab_size=256)
    extra = checkpoint_extra(cfg, model_cfg, ByteTokenizer(), "run-a", data={"train": "t-print", "val": "v-print"})
    assert extra == {"family": "moeflow.MoEGPT", "model": model_cfg.to_dict(), "dtype": "float32",
                     "tokenizer": {"kind": "byte"}, "train": cfg.to_dict(), "run_id": "run-a",
                     "data": {"train": "t-print", "val": "v-print"}}
    assert "data" not in checkpoint_extra(cfg, model_cfg, ByteTokenizer(), "run-a")
    save_checkpoint(out / "checkpoints", step, MoEGPT(model_cfg), extra=extra)
    (out / "run.json").write_text(json.dumps({"format": "moeflow-run/1", "run_id": "run-a", "created": "now"}))
    gen = torch.Generator().manual_seed(seed)
    history = new_history("run-a")
    for s in range(1, history_steps + 1):
        history["step"].append(s)
        history["train_loss"].append(float(torch.rand((), generator=gen)))
        history["lr"].append(float(torch.rand((), generator=gen)))
        for key in ("val", "load", "rebalance", "world_sizes", "skipped"):
            if s % int(torch.randint(1, 4, (), generator=gen)) == 0:
                history.setdefault(key, []).append([s, float(torch.rand((), generator=gen))])
    history["tokens_per_s"] = 123.0  # a total of the run as it last stopped
    write_history(out, history)
    return cfg, history


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_resume_continues_from_what_the_run_directory_holds(tmp_path, seed: int) -> None:
    """``inspect_run`` with ``resume=True`` on a run directory made by hand (no training): the
    run continues from the checkpoint's step under its run id, with the history cut back to that
    step, entry by entry of every kind (history.json runs ahead of the checkpoint when a run
    stopped between a history write and its save) and without the totals of the run that
    stopped; a run already at ``steps`` is finished, with the saved history whole; a history
    that does not reach the checkpoint, or files of another run, are refused."""
    from moeflow.train.lm_checkpoint import inspect_run

    gen = torch.Generator().manual_seed(seed)
    step = int(torch.randint(3, 7, (), generator=gen))
    cfg, history = _saved_run(tmp_path / "run", step, step + int(torch.randint(1, 3, (), generator=gen)), seed)
    state = inspect_run(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / f"step-{step:08d}"
    assert (state.run_id, state.start, state.checkpoint, state.finished) == ("run-a", step, ckpt, False)
    keep = [i for i, s in enumerate(history["step"]) if s <= step]
    want = {"run_id": "run-a", **{k: [history[k][i] for i in keep] for k in ("step", "train_loss", "lr")},
            **{k: [e for e in history.get(k, []) if e[0] <= step] for k in ("val", "load", "rebalance", "world_sizes",
                                                                          "skipped")}}
    assert state.history == want and state.history["step"] == list(range(1, step + 1))
    # a new run there is refused naming what is there; overwrite lists the run's files, checkpoints
    # first and run.json last, never another file
    run = tmp_path / "run"
    (run / "notes.txt").write_text("not moeflow's")
    (run / "training.png").write_bytes(b"plot")
    with pytest.raises(ValueError, match=re.escape(f"out_dir={str(run)!r} already holds a run (run 'run-a': run.json, "
                                                   f"history.json, checkpoints/step-{step:08d}; latest complete "
                                                   f"checkpoint: step {step}); pass resume=True")):
        inspect_run(dataclasses.replace(cfg, resume=False))
    over = inspect_run(dataclasses.replace(cfg, resume=False, overwrite=True))
    assert over.run_id != "run-a" and (over.start, over.checkpoint, over.finished) == (0, None, False)
    assert over.remove == (ckpt, run / "training.png", run / "history.json", run / "run.json")
    again = inspect_run(dataclasses.replace(cfg, resume=False, overwrite=True)).run_id
    assert isinstance(over.run_id, str) and len(over.run_id) == 32 and again != over.run_id  # a new id each time
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "training.png").write_bytes(b"plot")  # no run there: a new run deletes nothing
    assert inspect_run(dataclasses.replace(cfg, out_dir=tmp_path / "plots", resume=False)).remove == ()
    (tmp_path / "bare").mkdir()  # a run that stopped before its first checkpoint: from step 0, under its id
    (tmp_path / "bare" / "run.json").write_text(json.dumps({"run_id": "run-z"}))
    bare = inspect_run(dataclasses.replace(cfg, out_dir=tmp_path / "bare"))
    assert (bare.run_id, bare.start, bare.checkpoint, bare.finished) == ("run-z", 0, None, False)
    assert bare.history["run_id"] == "run-z" and bare.history["step"] == []
    empty = inspect_run(dataclasses.replace(cfg, out_dir=tmp_path / "empty"))  # nothing there yet: a new id
    assert empty.start == 0 and isinstance(empty.run_id, str) and len(empty.run_id) == 32

    finished = inspect_run(dataclasses.replace(cfg, steps=step))
    assert finished.finished and finished.start == step and finished.history == want  # history.json ran ahead
    history = {**history, **{k: history[k][:step] for k in ("step", "train_loss", "lr")}}
    (tmp_path / "run" / "history.json").write_text(json.dumps(history))
    assert inspect_run(dataclasses.replace(cfg, steps=step)).history == history  # its own record, totals too
    assert "tokens_per_s" not in inspect_run(cfg).history  # a continued run computes its own
    # a run that never skipped a step has no "skipped" (new_history), and an older one no "world_sizes"
    (tmp_path / "run" / "history.json").write_text(json.dumps({k: v for k, v in history.items()
                                                               if k not in ("skipped", "world_sizes")}))
    assert inspect_run(cfg).history == {**want, "skipped": [], "world_sizes": []}

    # a checkpoint from before the history left the index: read from there when history.json is gone
    index_file = ckpt / "index.json"
    index = json.loads(index_file.read_text())
    index_file.write_text(json.dumps({**index, "extra": {**index["extra"], "history": history}}))
    (tmp_path / "run" / "history.json").unlink()
    assert inspect_run(cfg).history == want
    index_file.write_text(json.dumps(index))
    (tmp_path / "run" / "history.json").write_text(json.dumps({**history, "step": history["step"][:-1]}))
    with pytest.raises(ValueError, match=rf"resume=True needs .*history\.json up to step {step}, the step of the "
                                         rf"checkpoint .*step-{step:08d}, but the file covers steps \[1\]\.\.\[{step - 1}\]"):
        inspect_run(cfg)
    (tmp_path / "run" / "history.json").unlink()
    with pytest.raises(ValueError, match=rf"history\.json up to step {step}, .* but the file is missing"):
        inspect_run(cfg)
    (tmp_path / "run" / "run.json").write_text(json.dumps({"run_id": "run-b"}))
    with pytest.raises(ValueError, match=rf"mixes runs \(run\.json: run-b, checkpoints/step-{step:08d}: run-a\)"):
        inspect_run(cfg)


@pytest.mark.unit
def test_resume_refuses_settings_that_would_not_continue_the_checkpoint(tmp_path) -> None:
    """Each setting that decides which batches a step sees, changed, is refused by name with the
    saved value (a setting the checkpoint predates counts as its default), as is any change of
    the model (named down to a nested key) and fewer steps than the checkpoint's; recomputing the
    experts is no change of the model, and the run's other settings may change."""
    from moeflow.train.lm_checkpoint import inspect_run

    cfg, _ = _saved_run(tmp_path / "run", 3, 3, seed=4)
    changes = {"batch_size": 8, "grad_accum": 2, "seq_len": 32, "seed": 5, "tokenizer": "bpe", "bpe_vocab": 512,
               "val_works": ("sonnets",), "val_fraction": 0.2, "text_field": "body", "skip_empty": True}
    for name, value in changes.items():
        changed = dataclasses.replace(cfg, **{name: value})
        said = f"{name}={changed.to_dict()[name]!r} (the checkpoint's run: {cfg.to_dict()[name]!r}): resume=True"
        with pytest.raises(ValueError, match="^" + re.escape(said)):
            inspect_run(changed)
    assert inspect_run(dataclasses.replace(cfg, lr=1e-3, expert_recompute=True, eval_every=7)).start == 3
    said = "batch_size=8 (the checkpoint's run: 16), seed=5 (the checkpoint's run: 0): resume=True"
    with pytest.raises(ValueError, match="^" + re.escape(said)):
        inspect_run(dataclasses.replace(cfg, batch_size=8, seed=5))
    fresh = inspect_run(dataclasses.replace(cfg, out_dir=tmp_path / "new", resume=False))
    assert fresh.start == 0 and fresh.checkpoint is None and fresh.history == {
        "run_id": fresh.run_id, "step": [], "train_loss": [], "lr": [], "val": [], "load": [], "rebalance": [],
        "world_sizes": []}
    # a checkpoint written before a setting existed: its default is what that run used
    index_file = tmp_path / "run" / "checkpoints" / "step-00000003" / "index.json"
    index = json.loads(index_file.read_text())
    del index["extra"]["train"]["skip_empty"], index["extra"]["model"]["experts"]["recompute"]
    index["extra"]["model"]["experts"]["recompute_chunks"] = 4  # recomputing in chunks changes no model either
    index_file.write_text(json.dumps(index))
    assert inspect_run(cfg).start == 3
    with pytest.raises(ValueError, match=r"^skip_empty=True \(the checkpoint's run: False\)"):
        inspect_run(dataclasses.replace(cfg, skip_empty=True))
    with pytest.raises(ValueError, match=r"^n_layers=2 would change the model of the checkpoint .*step-00000003 "
                                         r"\(n_layers: 1 -> 2\), which resume=True continues"):
        inspect_run(dataclasses.replace(cfg, n_layers=2))
    with pytest.raises(ValueError, match=r"^load_balance_coef=0\.5 would change the model .*"
                                         r"\(router\.load_balance_coef: [0-9.e-]+ -> 0\.5\)"):
        inspect_run(dataclasses.replace(cfg, load_balance_coef=0.5))
    with pytest.raises(ValueError, match=r"^n_layers=2, dim=32 would change the model .*"
                                         r"\((n_layers: 1 -> 2; dim: 16 -> 32|dim: 16 -> 32; n_layers: 1 -> 2)\), which"):
        inspect_run(dataclasses.replace(cfg, n_layers=2, dim=32))
    with pytest.raises(ValueError, match=r"^preset='small' would change the model .*step-00000003 \(.*\), which"):
        inspect_run(dataclasses.replace(cfg, preset="small"))
    other, _ = _saved_run(tmp_path / "other", 2, 2, seed=5)  # a model of another size to start from
    other_index = other.out_dir / "checkpoints" / "step-00000002" / "index.json"
    other_extra = json.loads(other_index.read_text().replace('"n_layers": 1', '"n_layers": 3'))
    other_extra["extra"]["special_tokens"] = {"bos": 7}  # what a converted model carries on to the runs from it
    other_index.write_text(json.dumps(other_extra))
    from_other = dataclasses.replace(cfg, init_from=other.out_dir, **{k: None for k in ("n_layers", "dim", "n_heads",
                                                                                       "expert_hidden")})
    with pytest.raises(ValueError, match=r"^n_layers=None, dim=None, n_heads=None, expert_hidden=None, init_from='.*other' "
                                         r"would change the model .*\(n_layers: 1 -> 3\), which"):
        inspect_run(from_other)
    from moeflow.train.data import ByteTokenizer
    from moeflow.train.lm_checkpoint import checkpoint_extra

    carried = checkpoint_extra(from_other, from_other.model_config(vocab_size=256), ByteTokenizer(), "run-c")
    assert carried["special_tokens"] == {"bos": 7} and carried["model"]["n_layers"] == 3
    with pytest.raises(ValueError, match=r"^steps=2 is below step 3 of the checkpoint"):
        inspect_run(dataclasses.replace(cfg, steps=2))
    router = index["extra"]["model"].pop("router")  # a nested config the checkpoint lacks: named whole
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"^this run would change the model .*\(router: None -> \{.*\}\), which"):
        inspect_run(cfg)
    index["extra"]["model"]["router"] = router
    train = index["extra"].pop("train")  # no training settings at all: the defaults, and so another seq_len
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"^seq_len=16 \(the checkpoint's run: 128\)"):
        inspect_run(cfg)
    index["extra"]["train"] = train
    del index["extra"]["model"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index\.json: no model config; it cannot be resumed"):
        inspect_run(cfg)


# ----------------------------------------------------------------------------- non-finite steps


class _NaNGrad(torch.autograd.Function):
    """Identity forward, nan gradient: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g * float("nan")


def _poison_steps(setter, steps: set[int], *, grad_only: bool = False) -> None:
    """Make the training loss of these steps (counted from the first training call) nan, or
    only its gradient (``grad_only``); evaluation (no grad) is left alone. ``setter``:
    ``monkeypatch.setattr`` or ``setattr``."""
    from moeflow.models import MoEGPT

    original, calls = MoEGPT.loss, [0]

    def loss(self, x, y):  # type: ignore[no-untyped-def]
        out = original(self, x, y)
        if not torch.is_grad_enabled():
            return out
        calls[0] += 1
        if calls[0] not in steps:
            return out
        return _NaNGrad.apply(out) if grad_only else out * float("nan")

    setter(MoEGPT, "loss", loss)


def _strict_json(path: Path) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"{path} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _all_finite(path: Path) -> bool:
    model, _, _ = build_from_checkpoint(path)
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.e2e
def test_nonfinite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys) -> None:
    """``moeflow train``: a nan loss at step 5 stops the run with exit 1 and one line naming the
    step and the last good checkpoint (step 4, written in the background: the stop waits for it);
    nothing is saved after it, history.json stays strict JSON, and --resume continues from it."""
    from moeflow.cli.main import main

    run = tmp_path / "run"
    argv = ["train", "--out", str(run), "--steps", "6", "--checkpoint-every", "2", "--batch-size", "4",
            "--seq-len", "32", "--eval-batches", "1", "--warmup", "1", "--no-progress", "--no-plot",
            "--sample-tokens", "0"]
    with monkeypatch.context() as m:
        _poison_steps(m.setattr, {5})
        assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "training stopped at step 5: the loss is nan" in err and "step-00000004" in err and "--skip-nonfinite" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert _all_finite(run)
    history = _strict_json(run / "history.json")
    assert history["step"] == [1, 2, 3, 4] and history["skipped"] == [[5, "nan", "nan"]]
    assert main([*argv, "--resume"]) == 0  # the last good checkpoint carries on
    assert _strict_json(run / "history.json")["step"] == [1, 2, 3, 4, 5, 6]
    assert _all_finite(run)


@pytest.mark.e2e
def test_skip_nonfinite_skips_the_step_without_touching_the_weights(tmp_path, monkeypatch) -> None:
    """With skip_nonfinite=1 a step whose gradient (not its loss) is nan is skipped: the weights
    end exactly where a run without that last step ends (the warm-up keeps the learning rates of
    both runs equal); a second such step stops the run."""
    kw = dict(batch_size=4, seq_len=32, warmup_steps=10, eval_every=0, eval_batches=1, progress=False, plot=False,
              dtype="float64")
    clean = train_lm(LMTrainConfig(out_dir=tmp_path / "clean", steps=2, **kw))
    with monkeypatch.context() as m:
        _poison_steps(m.setattr, {3}, grad_only=True)
        skipped = train_lm(LMTrainConfig(out_dir=tmp_path / "skip", steps=3, skip_nonfinite=1, **kw))
    assert skipped["step"] == [1, 2] and skipped["train_loss"] == clean["train_loss"]
    assert [s[0] for s in skipped["skipped"]] == [3] and skipped["skipped"][0][2] == "nan"
    assert float(skipped["skipped"][0][1]) > 0  # the loss itself was finite
    assert sorted(p.name for p in (tmp_path / "skip" / "checkpoints").iterdir()) == ["step-00000003"]
    _same_parameters(tmp_path / "skip", tmp_path / "clean")
    with monkeypatch.context() as m:
        _poison_steps(m.setattr, {2, 3}, grad_only=True)
        with pytest.raises(NonFiniteLossError, match="stopped at step 3.*after skipping 1 such step"):
            train_lm(LMTrainConfig(out_dir=tmp_path / "twice", steps=3, skip_nonfinite=1, **kw))
    assert not (tmp_path / "twice" / "checkpoints").exists()


@pytest.mark.unit
def test_nonfinite_weights_are_never_saved() -> None:
    """A finite loss can be followed by an update that overflows the weights: every save checks them."""
    layer = torch.nn.Linear(3, 2)
    check_parameters_finite(layer, 7)
    with torch.no_grad():
        layer.bias[1] = float("inf")
    with pytest.raises(NonFiniteLossError, match=r"weights became non-finite in step 7 \(e.g. bias\)"):
        check_parameters_finite(layer, 7)


@pytest.mark.unit
@pytest.mark.parametrize(("content", "match"), [
    (None, "cannot read the tuner's choices"),
    (b"\xff\xfe garbage", "cannot read the tuner's choices"),
    (b"{not json", "cannot read the tuner's choices"),
    (b'{"a": 1}', "is not a tuned.json of moeflow train"),
    (b"[[1, 2]]", "is not a tuned.json of moeflow train"),
    (b"[[]]", "holds the choices of 1 MoE layer"),
    (b'[[{"parallel": "auto", "overlap_degree": "auto"}], [], [], []]', "tuned setting #0"),
])
def test_tuned_file_is_validated_before_any_rank_starts(tmp_path, content, match: str) -> None:
    """``--tuned`` is read and checked (schema, layer count, records) where the settings are, so
    ``moeflow train --nproc N`` refuses a bad file before starting ranks."""
    path = tmp_path / "tuned.json"
    if content is not None:
        path.write_bytes(content)
    cfg = LMTrainConfig(out_dir=tmp_path / "run", parallel="auto", overlap_degree="auto", tuned=path)
    with pytest.raises(ValueError, match=match):
        lm.check_world_settings(cfg, 2)


# ----------------------------------------------------------------------------- on gloo ranks


def _cfg(out: str, **kw) -> LMTrainConfig:
    base = dict(out_dir=Path(out), steps=3, batch_size=8, seq_len=32, warmup_steps=1, eval_every=0,
                eval_batches=1, progress=False, plot=False, val_works=("sonnets",))
    return LMTrainConfig(**{**base, **kw})


def _case_train(rank: int, world: int, out: str, aux: float, steps: int = 3, dtype: str = "float64",
                deterministic: bool = False, node_size: int | None = None) -> None:
    torch.manual_seed(1234 + rank)  # train_lm must not depend on the ranks' RNG state before it
    train_lm(_cfg(out, load_balance_coef=aux, steps=steps, dtype=dtype, deterministic=deterministic),
             node_size=node_size)


def _case_train_with(rank: int, world: int, out: str, kw: str) -> None:
    train_lm(_cfg(out, dtype="float64", load_balance_coef=0.0, **json.loads(kw)))


def _case_poisoned(rank: int, world: int, out: str) -> None:
    """Only rank 1's loss is nan, at step 2: every rank stops there (none waits in a collective)."""
    if rank == 1:
        _poison_steps(setattr, {2})
    with pytest.raises(NonFiniteLossError, match="training stopped at step 2: the loss is nan"):
        train_lm(_cfg(out, checkpoint_every=1))


CASES = {"train": _case_train, "train_with": _case_train_with, "poisoned": _case_poisoned}


@pytest.mark.distributed
def test_nonfinite_loss_on_one_rank_stops_every_rank(tmp_path) -> None:
    """The loss and gradient norm are reduced over the ranks before the optimizer step, so a nan
    on one rank stops all of them at the same step; the step-1 checkpoint is kept, finite."""
    spawn_ranks(2, __name__, "poisoned", str(tmp_path / "ep"))
    assert sorted(p.name for p in (tmp_path / "ep" / "checkpoints").iterdir()) == ["step-00000001"]
    assert _all_finite(tmp_path / "ep")
    assert _strict_json(tmp_path / "ep" / "history.json")["skipped"] == [[2, "nan", "nan"]]


@pytest.mark.distributed
def test_tuned_file_locks_the_auto_tuner(tmp_path) -> None:
    """``tuned=`` (``--tuned``) fixes the auto-tuner's choices from the first step: with every
    layer fixed to the data-parallel mode, "auto" trains bit for bit like parallel="data", and
    the run records the choices again in tuned.json."""
    import moeflow
    from moeflow.models import MoEGPT

    model_cfg = _cfg(str(tmp_path)).model_config(vocab_size=256)
    layers = len(moeflow.moe_layers(MoEGPT(model_cfg)))
    record = {"tokens": 8 * 32, "top_k": model_cfg.top_k, "capacity_factor": float(model_cfg.capacity_factor),
              "parallel": "auto", "overlap_degree": "auto", "choice": {"parallel": "data", "overlap_degree": 1}}
    (tmp_path / "tuned.json").write_text(json.dumps([[record]] * layers))
    spawn_ranks(2, __name__, "train_with", str(tmp_path / "data"), json.dumps({"parallel": "data"}))
    spawn_ranks(2, __name__, "train_with", str(tmp_path / "auto"), json.dumps(
        {"parallel": "auto", "overlap_degree": "auto", "tuned": str(tmp_path / "tuned.json")}))
    data = json.loads((tmp_path / "data" / "history.json").read_text())
    auto = json.loads((tmp_path / "auto" / "history.json").read_text())
    assert auto["train_loss"] == data["train_loss"]
    written = json.loads((tmp_path / "auto" / "tuned.json").read_text())
    assert all(record in per_layer for per_layer in written) and len(written) == layers
    # a file recorded under other arguments would never match: refused on every rank
    with pytest.raises(AssertionError, match="was recorded with"):
        spawn_ranks(2, __name__, "train_with", str(tmp_path / "other"), json.dumps(
            {"parallel": "auto", "overlap_degree": 1, "tuned": str(tmp_path / "tuned.json")}))
    with pytest.raises(ValueError, match="needs parallel or overlap_degree 'auto'"):
        _cfg(str(tmp_path), tuned=tmp_path / "tuned.json")
    with pytest.raises(ValueError, match="more than one rank"):
        train_lm(_cfg(str(tmp_path / "one"), parallel="auto", tuned=tmp_path / "tuned.json"))


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "node_size"), [(2, None), (4, None), (4, 2)], ids=["2", "4", "2x2-two-level"])
def test_expert_parallel_training_equals_one_process(tmp_path, world: int, node_size: int | None) -> None:
    """On 2 and 4 ranks with the flat exchange, and on 4 ranks as 2 "nodes" of 2 with the
    two-level one (what torchrun on two machines gives: tests/test_train_launch.py runs that
    job itself in the slow tier, the parallel guide in the default one)."""
    single = train_lm(_cfg(str(tmp_path / "one"), load_balance_coef=0.0, dtype="float64"))
    # fp64: exact up to summation order
    spawn_ranks(world, __name__, "train", str(tmp_path / "ep"), 0.0, 3, "float64", False, node_size)
    ep = json.loads((tmp_path / "ep" / "history.json").read_text())
    assert (ep["world_size"], ep["exchange"]) == (world, "flat" if node_size is None else "two-level")
    # without balance losses (which are per rank) the whole trajectory is the same step
    torch.testing.assert_close(torch.tensor(ep["train_loss"]), torch.tensor(single["train_loss"]), rtol=1e-10, atol=0)
    torch.testing.assert_close(torch.tensor([v for _, v in ep["val"]]), torch.tensor([v for _, v in single["val"]]),
                               rtol=1e-10, atol=0)
    # the final checkpoints hold the same parameters
    from moeflow.train import build_from_checkpoint

    m1, _, _ = build_from_checkpoint(tmp_path / "one")
    mw, _, info = build_from_checkpoint(tmp_path / "ep")
    assert info["world_size"] == world
    for (n, p), (_, q) in zip(m1.named_parameters(), mw.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-8, atol=1e-10, msg=n)


@pytest.mark.distributed
def test_training_with_balance_loss_equals_one_process_accumulating_the_ranks_halves(tmp_path, monkeypatch) -> None:
    """Balance losses are per rank (each on its rank's tokens), so 2-rank training with them is
    not one process on the whole batch; it is one process that accumulates the ranks' halves as
    two micro-batches, each with its own balance loss: the 1-process run here draws micro-batch
    ``m`` of a step as rank ``m``'s half of that step's global batch. Then 4 fp64 steps (the
    balance losses' gradients, the backward through the exchange, the gradient reduction and
    the optimizer) give the same losses and parameters. And the balance loss is in the
    objective: without it the same run goes elsewhere from step 2."""
    from moeflow.train import build_from_checkpoint
    from moeflow.train.tokens import TokenStream

    steps, coef = 4, 0.05
    spawn_ranks(2, __name__, "train", str(tmp_path / "ep"), coef, steps, "float64")
    ep = json.loads((tmp_path / "ep" / "history.json").read_text())
    real = TokenStream.batch

    def as_ranks(self, step, batch_size, *, rank=0, world=1):  # type: ignore[no-untyped-def]
        if batch_size == 4 and world == 1:  # a micro-batch of 4 of the 1-process run (training)
            return real(self, step // 2, 8, rank=step % 2, world=2)
        return real(self, step, batch_size, rank=rank, world=world)  # validation: whole batches of 8

    monkeypatch.setattr(TokenStream, "batch", as_ranks)
    single = train_lm(_cfg(str(tmp_path / "one"), steps=steps, load_balance_coef=coef, dtype="float64", grad_accum=2))
    plain = train_lm(_cfg(str(tmp_path / "plain"), steps=steps, load_balance_coef=0.0, dtype="float64", grad_accum=2))
    torch.testing.assert_close(torch.tensor(ep["train_loss"]), torch.tensor(single["train_loss"]), rtol=1e-10, atol=0)
    torch.testing.assert_close(torch.tensor([v for _, v in ep["val"]]), torch.tensor([v for _, v in single["val"]]),
                               rtol=1e-10, atol=0)
    (m1, _, _), (m2, _, _) = build_from_checkpoint(tmp_path / "one"), build_from_checkpoint(tmp_path / "ep")
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-8, atol=1e-10, msg=n)
    assert plain["train_loss"][0] == single["train_loss"][0]  # the task loss before any update
    assert abs(plain["train_loss"][1] - single["train_loss"][1]) > 1e-3  # the balance loss moved the weights


@pytest.mark.distributed
def test_deterministic_runs_repeat_bit_for_bit(tmp_path) -> None:
    """Two 2-rank fp32 runs with deterministic=True (ranks start from different RNG states):
    identical losses and parameters, bit for bit."""
    for name in ("a", "b"):
        spawn_ranks(2, __name__, "train_noisy", str(tmp_path / name))
    a, b = (json.loads((tmp_path / n / "history.json").read_text()) for n in ("a", "b"))
    assert a["train_loss"] == b["train_loss"] and a["val"] == b["val"]
    from moeflow.train import build_from_checkpoint

    ma, _, _ = build_from_checkpoint(tmp_path / "a")
    mb, _, _ = build_from_checkpoint(tmp_path / "b")
    for (n, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="deterministic"):
        _cfg(str(tmp_path), deterministic=True, parallel="auto")


def _case_train_noisy(rank: int, world: int, out: str) -> None:
    torch.manual_seed(99 + rank * 7)
    train_lm(_cfg(out, steps=3, dtype="float32", deterministic=True))


CASES["train_noisy"] = _case_train_noisy


def _case_train_placed(rank: int, world: int, out: str) -> None:
    train_lm(_cfg(out, load_balance_coef=0.0, steps=5, dtype="float64", vocab_parallel=True, rebalance_every=2,
                  expert_slots=8 // world + 1))


CASES["train_placed"] = _case_train_placed


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2])  # the modules are tested on 4 ranks too (test_parallel_placement, test_parallel_vocab)
def test_rebalanced_vocab_parallel_training_equals_one_process(tmp_path, world: int) -> None:
    """Experts moved (with replicas) every 2 steps and the vocabulary split over the ranks: the
    same trajectory and final parameters as one process (fp64)."""
    single = train_lm(_cfg(str(tmp_path / "one"), load_balance_coef=0.0, steps=5, dtype="float64"))
    spawn_ranks(world, __name__, "train_placed", str(tmp_path / "ep"))
    ep = json.loads((tmp_path / "ep" / "history.json").read_text())
    assert [s for s, _ in ep["rebalance"]] == [2, 4]
    assert any(len(set(x for r in layer for x in r)) < sum(len(r) for r in layer)  # replicas were made
               for _, moved in ep["rebalance"] for layer in moved["slots"])
    torch.testing.assert_close(torch.tensor(ep["train_loss"]), torch.tensor(single["train_loss"]), rtol=1e-10, atol=0)
    from moeflow.train import build_from_checkpoint

    m1, _, _ = build_from_checkpoint(tmp_path / "one")
    mw, _, _ = build_from_checkpoint(tmp_path / "ep")
    for (n, p), (_, q) in zip(m1.named_parameters(), mw.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-8, atol=1e-10, msg=n)
    with pytest.raises(ValueError, match="more than one rank"):
        train_lm(_cfg(str(tmp_path / "bad"), vocab_parallel=True))


@pytest.mark.distributed
def test_out_dir_rules_hold_on_two_ranks(tmp_path) -> None:
    """The same rules when every rank calls train_lm: a refusal raises on every rank (none is left
    waiting), a finished run is left untouched, raising steps continues the run like one
    process that went the whole way (fp64), and ``overwrite`` starts a new run in its place
    (``moeflow train --nproc 2 --overwrite`` is this first attempt on torchrun's ranks)."""
    flat = {"lr": 1e-3, "min_lr": 1e-3}
    ep = tmp_path / "ep"
    spawn_ranks(2, __name__, "train_with", str(ep), json.dumps(flat))
    before = file_states(ep)
    with pytest.raises(AssertionError, match=r"rank 1:(.|\n)*rank 0: ValueError: out_dir=.* already holds a run"):
        spawn_ranks(2, __name__, "train_with", str(ep), json.dumps(flat))
    spawn_ranks(2, __name__, "train_with", str(ep), json.dumps({**flat, "resume": True}))
    assert file_states(ep) == before
    spawn_ranks(2, __name__, "train_with", str(ep), json.dumps({**flat, "resume": True, "steps": 5}))
    single = train_lm(_cfg(str(tmp_path / "one"), steps=5, dtype="float64", load_balance_coef=0.0, **flat))
    resumed = json.loads((ep / "history.json").read_text())
    assert resumed["step"] == list(range(1, 6)) and resumed["world_size"] == 2
    torch.testing.assert_close(torch.tensor(resumed["train_loss"]), torch.tensor(single["train_loss"]), rtol=1e-10,
                               atol=0)
    (ep / "notes.txt").write_text("not moeflow's")
    spawn_ranks(2, __name__, "train_with", str(ep), json.dumps({**flat, "steps": 1, "overwrite": True}))
    fresh = json.loads((ep / "history.json").read_text())
    assert fresh["run_id"] != resumed["run_id"] and (fresh["step"], fresh["world_size"]) == ([1], 2)
    assert sorted(p.name for p in (ep / "checkpoints").iterdir()) == ["step-00000001"]
    assert (ep / "notes.txt").read_text() == "not moeflow's"


@pytest.mark.e2e
def test_init_from_starts_at_the_checkpoint_model(tmp_path) -> None:
    """``init_from``: the run starts from that checkpoint's weights (its first training loss is
    the checkpoint model's loss on the same batch, its validation loss before training that
    model's on the same held-out batches), with the checkpoint's model config (set here through the
    n_layers/dim/n_heads/expert_hidden overrides) and BPE tokenizer; a new run (its own id, a
    fresh optimizer from step 0)."""
    from moeflow.train.data import load_corpus
    from moeflow.train.tokens import TokenStream
    from moeflow.train.init_from import MODEL_FAMILY
    from moeflow.train.lm_checkpoint import MODEL_FAMILY as WRITTEN

    assert MODEL_FAMILY == WRITTEN
    kw = dict(batch_size=4, seq_len=32, warmup_steps=1, eval_every=0, eval_batches=1, progress=False, plot=False,
              dtype="float64")
    first = train_lm(LMTrainConfig(out_dir=tmp_path / "a", steps=2, n_layers=2, dim=64, n_heads=2, expert_hidden=48,
                                   tokenizer="bpe", bpe_vocab=300, **kw))
    tuned = train_lm(LMTrainConfig(out_dir=tmp_path / "b", steps=2, init_from=tmp_path / "a", seed=5, **kw))
    model, tok, _ = build_from_checkpoint(tmp_path / "a")
    cfg = model.config
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.expert_hidden, tok.vocab_size) == (2, 64, 2, 48, 300)
    corpus = load_corpus(LMTrainConfig(out_dir=tmp_path).val_works)
    x, y = TokenStream.from_text(corpus.train_text, tok, 32, 5).batch(0, 4)
    model.train()
    torch.manual_seed(5 * 1_000 + 1)  # train_lm's router-noise seed for rank 0
    with torch.no_grad():
        expected = float(model.loss(x, y))
    assert tuned["train_loss"][0] == pytest.approx(expected, rel=1e-12, abs=0)
    b_cfg = LMTrainConfig(out_dir=tmp_path / "b", steps=2, init_from=tmp_path / "a", seed=5, **kw)
    val = TokenStream.from_text(corpus.val_text, tok, 32, 5 + 1)
    assert tuned["val"][0][1] == pytest.approx(lm.evaluate(model, val, b_cfg, None, torch.device("cpu")), rel=1e-12)
    assert tuned["run_id"] != first["run_id"] and tuned["step"] == [1, 2]
    assert read_index(tuned["checkpoint"])["extra"]["model"] == cfg.to_dict()
    # without init_from, the same seed starts elsewhere: the equality above is the loaded weights
    fresh = train_lm(LMTrainConfig(out_dir=tmp_path / "c", steps=1, seed=5, n_layers=2, dim=64, n_heads=2,
                                   expert_hidden=48, tokenizer="bpe", bpe_vocab=300, **kw))
    assert fresh["train_loss"][0] != pytest.approx(expected, rel=1e-3)
    # the model is the checkpoint's: a field that would change it is refused
    with pytest.raises(ValueError, match="takes the model from the checkpoint: num_experts=4"):
        LMTrainConfig(out_dir=tmp_path / "d", init_from=tmp_path / "a", num_experts=4)
    with pytest.raises(ValueError, match="longer than the context of the init_from model"):
        LMTrainConfig(out_dir=tmp_path / "d", init_from=tmp_path / "a", seq_len=64)


@pytest.mark.unit
def test_training_figure_panels() -> None:
    """The report holds the loss, the lr schedule, the aux loss and tokens/s (from the metrics
    records), one load map per MoE layer whose colour bar marks the even share 1/E, and integer
    step ticks on every step axis."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from moeflow.train.plots import training_figure

    E = 4
    history = {"step": [1, 2, 3], "train_loss": [3.0, 2.5, 2.0], "lr": [1e-3, 2e-3, 1e-3], "val": [[0, 3.1], [3, 2.1]],
               "load": [[2, [[0.4, 0.2, 0.2, 0.2], [0.25] * 4]], [3, [[0.7, 0.1, 0.1, 0.1], [0.25] * 4]]]}
    metrics = [{"step": 0, "val_loss": 3.1}, *({"step": s, "loss": 1.0, "aux_loss": 0.01 * s, "tokens_per_s": 100.0 * s}
                                              for s in (1, 2, 3))]
    fig = training_figure(history, metrics=metrics)
    try:
        by_title = {a.get_title(): a for a in fig.axes}
        for title in ("learning rate", "routers' balance (aux) loss", "throughput"):
            assert title in by_title and by_title[title].lines, title
        assert list(by_title["throughput"].lines[0].get_ydata()) == [100.0, 200.0, 300.0]
        assert list(by_title["learning rate"].lines[0].get_ydata()) == history["lr"]
        maps = [a for t, a in by_title.items() if t.startswith("MoE layer")]
        assert len(maps) == 2
        bars = [a for a in fig.axes if not a.get_title() and a not in maps]
        assert len(bars) == 2 and all(f"1/E={1 / E:.3g}" in [t.get_text() for t in b.get_yticklabels()] for b in bars)
        for a in [*maps, *(by_title[t] for t in ("learning rate", "throughput", "moeflow MoE GPT: loss"))]:
            locator = a.xaxis.get_major_locator()
            assert isinstance(locator, MaxNLocator) and locator._integer, a.get_title()
    finally:
        plt.close(fig)


_PLACED_RESUMED = dict(load_balance_coef=0.0, dtype="float64", rebalance_every=2, checkpoint_every=1, keep_checkpoints=10)


def _case_train_placed_resumed(rank: int, world: int, out: str, stop: str) -> None:
    """Steps 1..6 with a move every 2 steps (replicas: one slot more than E / world), in one go
    (``stop`` 0) or interrupted right after the checkpoint of step ``stop`` and resumed."""
    cfg = _cfg(out, steps=6, **_PLACED_RESUMED, expert_slots=8 // world + 1)
    if int(stop):
        run_until_checkpoint(int(stop), lambda: train_lm(cfg))
    train_lm(dataclasses.replace(cfg, resume=bool(int(stop))))


CASES["train_placed_resumed"] = _case_train_placed_resumed


@pytest.mark.distributed
def test_a_resumed_rebalancing_run_continues_the_placement_and_load_window(tmp_path) -> None:
    """A run that moves its experts every 2 steps, stopped after step 3 (one step of load in the
    window, experts placed with replicas by the move at step 2) and resumed, equals the
    uninterrupted run bit for bit: the same moves (planned from the same window) and the same
    parameters. The checkpoint records the placement and the window (``extra["rebalance"]``)."""
    spawn_ranks(2, __name__, "train_placed_resumed", str(tmp_path / "whole"), "0")
    spawn_ranks(2, __name__, "train_placed_resumed", str(tmp_path / "resumed"), "3")
    whole, resumed = (json.loads((tmp_path / n / "history.json").read_text()) for n in ("whole", "resumed"))
    assert [s for s, _ in whole["rebalance"]] == [2, 4]
    assert resumed["rebalance"] == whole["rebalance"] and resumed["train_loss"] == whole["train_loss"]
    from moeflow.checkpoint import latest_checkpoint, read_index
    from moeflow.train import build_from_checkpoint

    record = read_index(tmp_path / "resumed" / "checkpoints" / "step-00000003")["extra"]["rebalance"]
    assert record["world"] == 2 and sum(map(sum, record["window"])) > 0  # step 3's rows, not yet moved on
    assert [p["slots"] for p in record["placements"]] == whole["rebalance"][0][1]["slots"]
    ma, _, _ = build_from_checkpoint(latest_checkpoint(tmp_path / "whole" / "checkpoints"))
    mb, _, _ = build_from_checkpoint(latest_checkpoint(tmp_path / "resumed" / "checkpoints"))
    for (n, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.unit
def test_a_rebalance_record_from_another_world_size_carries_only_the_window() -> None:
    """On another number of ranks the saved placements cannot apply (the experts start
    contiguous) but the window, a per-expert total, carries over into rank 0's counts; a record
    that does not fit the model is refused naming what it holds."""
    from moeflow.models import MoEGPT, gpt_config
    from moeflow.train.placement_state import restore_rebalance

    model = MoEGPT(gpt_config("tiny", vocab_size=32, dim=16, n_heads=2, n_layers=2, expert_hidden=8, max_seq_len=8))
    window = torch.rand(2, 8, dtype=torch.float64).mul(100).round()
    record = {"world": 2, "placements": [{"slots": [[0, 1, 2, 3], [4, 5, 6, 7]], "shares": None}] * 2,
              "window": window.tolist()}
    for rank in (0, 1):
        got = torch.full((2, 8), 7.0, dtype=torch.float64)
        assert restore_rebalance(model, record, world=4, rank=rank, window_LE=got) is False
        assert torch.equal(got, window if rank == 0 else torch.zeros_like(window))
    assert restore_rebalance(model, None, world=2, rank=0, window_LE=got) is False
    with pytest.raises(ValueError, match=r"rebalance record is for 1 MoE layers with a \(2, 8\) window"):
        restore_rebalance(model, {**record, "placements": record["placements"][:1]}, world=2, rank=0, window_LE=got)
    with pytest.raises(ValueError, match="rebalance record is malformed"):
        restore_rebalance(model, {"world": 2}, world=2, rank=0, window_LE=got)
    with pytest.raises(ValueError, match=r"rebalance record is malformed: placements\[1\]"):
        restore_rebalance(model, {**record, "placements": [record["placements"][0], [0, 1]]}, world=2, rank=0,
                          window_LE=got)
    # another --expert-slots on the same world size: the saved placement (4 slots) is not applied
    assert restore_rebalance(model, record, world=2, rank=0, window_LE=got, slots=5) is False

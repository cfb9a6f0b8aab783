"""Asynchronous checkpoints (``moeflow.checkpoint.background``): the same checkpoint as a
synchronous save, written while training goes on, on one process and on 2 gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch

import moeflow.checkpoint.io as ckpt_io
from moeflow.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint, save_checkpoint_async
from moeflow.models import MoEGPT, gpt_config

from helpers import spawn_ranks


def _model(seed: int = 0) -> tuple[MoEGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MoEGPT(gpt_config("tiny", vocab_size=64, dim=32, n_heads=2, n_layers=2, expert_hidden=48, max_seq_len=16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: MoEGPT, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))
    out = model(x)
    logits = out[0] if isinstance(out, tuple) else out
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x.reshape(-1)).backward()
    opt.step()


def _state(model: MoEGPT, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    states = opt.state_dict()["state"]
    for i in sorted(states):  # by parameter index (a loaded optimizer fills its state in another order)
        tensors += [states[i][k] for k in sorted(states[i]) if isinstance(states[i][k], torch.Tensor)]
    return [t.detach().clone() for t in tensors]


def _loaded(path) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    model, opt = _model(seed=99)
    load_checkpoint(path, model, opt)
    return _state(model, opt)


@pytest.mark.reference
def test_async_save_is_the_synchronous_checkpoint_of_the_state_at_the_call(tmp_path):
    model, opt = _model()
    _step(model, opt, 1)
    want = _state(model, opt)
    pending = save_checkpoint_async(tmp_path / "a", 1, model, opt)
    _step(model, opt, 2)  # training goes on; its optimizer step waits until the state is staged
    path = pending.wait()
    assert path == tmp_path / "a" / "step-00000001" and latest_checkpoint(tmp_path / "a") == path
    after = _state(model, opt)
    assert any(not torch.equal(a, b) for a, b in zip(want, after))  # the step did change the state ...
    assert all(torch.equal(a, b) for a, b in zip(want, _loaded(path)))  # ... not the saved one
    # a synchronous save of the same state writes the same tensors
    sync = save_checkpoint(tmp_path / "s", 1, *_reload(path))
    assert all(torch.equal(a, b) for a, b in zip(_loaded(sync), _loaded(path)))


def _reload(path) -> tuple[MoEGPT, torch.optim.Optimizer]:  # type: ignore[no-untyped-def]
    model, opt = _model(seed=99)
    load_checkpoint(path, model, opt)
    return model, opt


@pytest.mark.reference
def test_saves_of_one_root_complete_in_order_and_leave_no_hooks(tmp_path):
    model, opt = _model()
    _step(model, opt, 1)
    first = save_checkpoint_async(tmp_path, 1, model, opt, keep=5)
    _step(model, opt, 2)
    second = save_checkpoint_async(tmp_path, 2, model, opt, keep=5)  # waits for the first
    assert first.done()
    _step(model, opt, 3)
    third = save_checkpoint(tmp_path, 3, model, opt, keep=5)  # a synchronous save waits too
    assert second.done() and latest_checkpoint(tmp_path) == third
    assert len(opt._optimizer_step_pre_hooks) == 0  # each save's wait for staging is gone
    model2, opt2 = _model()
    _step(model2, opt2, 1)
    save_checkpoint_async(tmp_path / "no-opt", 1, model2).wait()  # no optimizer: staged before returning


@pytest.mark.reference
def test_a_failed_write_raises_at_wait_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = _model()
    _step(model, opt, 1)
    good = save_checkpoint(tmp_path, 1, model, opt)

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_io, "save_file", full_disk)
    pending = save_checkpoint_async(tmp_path, 2, model, opt)
    _step(model, opt, 2)  # not stuck: staging finished before the write failed
    with pytest.raises(CheckpointError, match="No space left on device"):
        pending.wait()
    assert latest_checkpoint(tmp_path) == good
    monkeypatch.undo()
    assert save_checkpoint(tmp_path, 2, model, opt).name == "step-00000002"  # the remains are cleaned up


def _case_expert_parallel(rank: int, world: int, root: str) -> None:
    """Every rank saves its experts in the background while the next expert-parallel steps run
    (their all-to-alls and the save's gathers on separate groups); the checkpoint equals a
    synchronous one, and a rank's failed write raises on every rank."""
    from moeflow.parallel import all_reduce_gradients, dense_parameters, expert_parallel

    model, _ = _model()
    expert_parallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over the experts this rank holds

    def step(seed: int) -> None:
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed + 100 * rank))
        out = model(x)
        logits = out[0] if isinstance(out, tuple) else out
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x.reshape(-1)).backward()
        all_reduce_gradients(dense_parameters(model), None)
        opt.step()

    step(1)
    sync_path = save_checkpoint(f"{root}/sync", 1, model, opt)
    pending = save_checkpoint_async(f"{root}/async", 1, model, opt)
    for s in range(2, 5):
        step(s)
    path = pending.wait()
    ref, got = (copy.deepcopy(model), copy.deepcopy(model))
    load_checkpoint(sync_path, ref)
    load_checkpoint(path, got)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), got.state_dict().values()))
    save_file = ckpt_io.save_file
    if rank == 1:
        ckpt_io.save_file = lambda *a, **k: (_ for _ in ()).throw(OSError(5, "I/O error"))  # type: ignore[assignment]
    try:
        failing = save_checkpoint_async(f"{root}/async", 5, model, opt)
        step(5)
        with pytest.raises(CheckpointError, match="rank 1: OSError"):
            failing.wait()
    finally:
        ckpt_io.save_file = save_file


CASES = {"expert_parallel": _case_expert_parallel}


@pytest.mark.distributed
def test_async_save_under_expert_parallelism_on_2_ranks(tmp_path):
    spawn_ranks(2, __name__, "expert_parallel", str(tmp_path))


@pytest.mark.unit
def test_a_save_that_lost_its_process_group_is_never_published(tmp_path):
    """Seen in an elastic run: a peer died, rank 0's main thread failed and shut the process
    group down while its background save still ran; the save's gather then answered for rank 0
    alone and rank 0 published a checkpoint holding only its own experts, which every restart
    then refused. The write must hear from every rank of the world it snapshotted."""
    import dataclasses

    model, opt = _model()
    _step(model, opt, 1)
    save_checkpoint(tmp_path, 1, model, opt)
    snapshot = ckpt_io._snapshot(tmp_path, 2, model, opt, extra=None, group=None, keep=3, stage=True)
    as_rank0_of_2 = dataclasses.replace(snapshot, world=2)  # no process group now: the gather answers alone
    with pytest.raises(CheckpointError, match=r"heard from 1 of its 2 ranks .* not published"):
        ckpt_io._write(as_rank0_of_2, None)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    assert not (tmp_path / "step-00000002").exists()


@pytest.mark.unit
def test_an_index_without_every_expert_is_refused_on_every_rank(tmp_path):
    """A published index that lacks some experts (such as the one above would have written) is
    refused when read, naming the experts, whichever experts the reading rank holds."""
    import json

    model, opt = _model()
    path = save_checkpoint(tmp_path, 1, model, opt)
    index = json.loads((path / "index.json").read_text())
    name = next(iter(index["experts"]))
    for entry in index["files"]:
        entry["tensors"] = {k: v for k, v in entry["tensors"].items() if k not in (f"param/{name}@1", f"param/{name}@3")}
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"expert\(s\) \[1, 3\] of {name} \(E=\d+\) are in none of its files"):
        ckpt_io.read_index(path)

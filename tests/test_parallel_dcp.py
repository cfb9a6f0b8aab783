"""PyTorch distributed checkpoint (DCP) for expert- and vocabulary-parallel models
(``moeflow.parallel.dcp.state``, ``moeflow.checkpoint.dcp``).

A MoE GPT (fp64, gated experts, vocabulary 41: uneven parts on 2 and 4 ranks) takes one AdamW
step in this process: the reference, written as a moeflow checkpoint. Ranks load it into a
layout (contiguous experts, hidden slices, a replicated placement; the vocabulary always split),
save with ``dcp.save``, ``dcp.async_save`` or ``DCPState``, and other ranks load into another
layout (a shuffled placement too) on another world size (2 -> 4, 4 -> 2) or in one process: every
parameter, buffer and optimizer tensor equals the reference's part bit for bit, and a forward
equals the reference. The plain ``model.state_dict()`` of such a model is refused by DCP with a
clear error, and the converter gives identical tensors moeflow -> DCP -> moeflow.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from safetensors import safe_open

import moeflow
from moeflow.checkpoint import load_checkpoint, read_index, save_checkpoint
from moeflow.checkpoint.state import expert_slices
from moeflow.cli.main import main
from moeflow.checkpoint.dcp import dcp_to_moeflow, moeflow_to_dcp
from moeflow.models import GPTConfig, MoEGPT
from moeflow.parallel import (
    ChunkedTensor,
    DCPState,
    Placement,
    RankLocalTensor,
    apply_placement,
    dcp_state_dict,
    expert_parallel,
    load_dcp,
    load_dcp_state_dict,
    plan_placement,
    save_dcp,
)
from moeflow.models import vocab_parallel

from helpers import spawn_ranks

pytestmark = pytest.mark.distributed

V, E = 41, 4
LAYOUTS = ("contiguous", "hidden", "replicated")


def _gpt(seed: int) -> MoEGPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=V, dim=16, n_layers=2, n_heads=2, max_seq_len=8, num_experts=E, top_k=2,
                    expert_hidden=12, router=moeflow.RouterConfig(load_balance_coef=0.0, bias_update_rate=1e-3))
    return MoEGPT(cfg, dtype=torch.float64)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10)
    return torch.randint(0, V, (4, 8), generator=gen), torch.randint(0, V, (4, 8), generator=gen)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _reference() -> tuple[MoEGPT, torch.optim.Optimizer]:
    """One process: one AdamW step, and the routers' bias moved (a buffer that differs from init)."""
    model = _gpt(0)
    opt = _optimizer(model)
    model.loss(*_batch()).backward()
    opt.step()
    moeflow.update_expert_bias(model)
    return model, opt


def _parallel(world: int, layout: str, seed: int) -> tuple[MoEGPT, torch.optim.Optimizer]:
    """A fresh model (weights from ``seed``) split over ``world`` ranks in ``layout``, and AdamW."""
    model = _gpt(seed)
    expert_parallel(model, hidden_shards=2 if layout == "hidden" else 1)
    if layout == "replicated":  # expert 0 hot: replicas of it on several ranks
        plan = plan_placement([5.0, 1.0, 1.0, 1.0], world=world, slots_per_rank=E // world + 1)
        assert max(plan.num_replicas) > 1
        apply_placement(model, [plan] * len(moeflow.moe_layers(model)))
    elif layout == "shuffled":  # any expert in any slot, in no order
        order = torch.randperm(E, generator=torch.Generator().manual_seed(4)).view(world, -1).tolist()
        apply_placement(model, [Placement(num_experts=E, slots=tuple(map(tuple, order)))] * 2)
    vocab_parallel(model)
    return model, _optimizer(model)


def _expected(model: torch.nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the reference tensor ``full`` of parameter ``name`` (or of state shaped
    like it), cut by the checkpoint module's layout (independent of moeflow.parallel.dcp.state)."""
    layout = expert_slices(model).get(name)
    if layout is not None:
        return torch.stack([layout.cut(i, full[g]) for i, g in enumerate(layout.ids)])
    p = dict(model.named_parameters())[name]
    if getattr(p, "moeflow_vocab_shard", False):
        return full[p.moeflow_vocab_start : p.moeflow_vocab_start + p.shape[0]]
    return full


def _check_equal(model, opt, ref, ref_opt, what: str) -> None:  # type: ignore[no-untyped-def]
    """Every parameter, buffer and optimizer tensor is the reference's part, bit for bit."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, _expected(model, name, ref_params[name].detach())), f"{what}: {name}"
        state, ref_state = opt.state[p], ref_opt.state[ref_params[name]]
        assert state.keys() == ref_state.keys(), f"{what}: {name} state keys"
        for key, value in ref_state.items():
            expected = _expected(model, name, value) if value.shape == ref_params[name].shape else value
            assert torch.equal(state[key], expected), f"{what}: {name} {key}"
    for (name, b), (_, b_ref) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.equal(b, b_ref), f"{what}: buffer {name}"
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups, strict=True):
        hyper, ref_hyper = ({k: v for k, v in g.items() if k != "params"} for g in (group, ref_group))
        assert hyper == ref_hyper, f"{what}: {hyper} != {ref_hyper}"


def _check_forward(model, ref, rank: int, world: int) -> None:  # type: ignore[no-untyped-def]
    """This rank's tokens through ``model`` give the reference's logits (in eval mode: training
    mode would move the routers' load counts, which later checks compare)."""
    idx, _ = _batch()
    per = idx.shape[0] // world
    mine = slice(rank * per, (rank + 1) * per)
    model.eval(), ref.eval()
    torch.testing.assert_close(model(idx[mine]), ref(idx)[mine], rtol=1e-12, atol=1e-12)
    ref.train()


def _loaded_reference(root: str) -> tuple[MoEGPT, torch.optim.Optimizer]:
    ref = _gpt(5)
    ref_opt = _optimizer(ref)
    load_checkpoint(Path(root) / "reference", ref, ref_opt, restore_rng=False)
    return ref, ref_opt


# ----------------------------------------------------------------------------- on gloo ranks


def _case_save(rank: int, world: int, root: str) -> None:
    """Each layout from the reference, saved three ways; the plain state dict is refused."""
    ref, ref_opt = _loaded_reference(root)
    for layout, how in zip(LAYOUTS, ("save", "async", "stateful")):
        model, opt = _parallel(world, layout, seed=1)
        load_checkpoint(Path(root) / "reference", model, opt, restore_rng=False)
        _check_equal(model, opt, ref, ref_opt, f"{layout} before saving")
        path = f"{root}/dcp-{layout}-w{world}"
        if how == "save":  # dcp.save(dcp_state_dict(model, opt)) in one call
            save_dcp(path, model, opt)
        elif how == "async":
            dcp.async_save(dcp_state_dict(model, opt), checkpoint_id=path).result()
        else:
            dcp.save({"train": DCPState(model, opt)}, checkpoint_id=path)
    _check_plain_state_dict_refused(model, root, rank, world)
    # parameters replaced after dcp_state_dict (a new placement) would not receive a load: refused
    state = dcp_state_dict(model, opt)
    apply_placement(model, [plan_placement([1.0, 1.0, 1.0, 5.0], world=world, slots_per_rank=E // world + 1)] * 2, opt)
    with pytest.raises(ValueError, match="no longer views the tensor"):
        load_dcp_state_dict(model, state, opt)


def _check_plain_state_dict_refused(model, root: str, rank: int, world: int) -> None:  # type: ignore[no-untyped-def]
    """The old failure mode: each rank's experts under one key. DCP now raises on every rank."""
    sd = model.state_dict()
    key = "layers.0.ffn.experts.w_in"
    assert isinstance(sd[key], RankLocalTensor) and isinstance(sd["embed.weight"], RankLocalTensor)
    refusal = "holds only this rank's part"
    with pytest.raises(CheckpointException, match=refusal):
        dcp.save(sd, checkpoint_id=f"{root}/plain-w{world}")
    with pytest.raises(CheckpointException, match=refusal):
        dcp.async_save({"model": model}, checkpoint_id=f"{root}/plain-async-w{world}").result()
    # loading into it: a checkpoint whose tensor has the local shape, so DCP's size check passes
    dcp.save({key: torch.zeros_like(sd[key].as_subclass(torch.Tensor))}, checkpoint_id=f"{root}/local-w{world}")
    with pytest.raises(CheckpointException, match=refusal):
        dcp.load({key: sd[key]}, checkpoint_id=f"{root}/local-w{world}")
    # everything else still sees plain tensors: values, load_state_dict, torch.save + weights_only
    params = dict(model.named_parameters())
    assert torch.equal(sd[key], params[key]) and model.state_dict(keep_vars=True)[key] is params[key]
    model.load_state_dict(sd)
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=True)
    assert type(again[key]) is torch.Tensor and torch.equal(again[key], params[key])


def _dcp_load(model, opt, path: Path) -> None:  # type: ignore[no-untyped-def]
    """Load the DCP checkpoint at ``path`` the way it was saved (``DCPState`` under its key; the
    others with ``load_dcp``, which is ``dcp.load`` into ``dcp_state_dict`` then
    ``load_dcp_state_dict``)."""
    if path.name.startswith("dcp-replicated"):
        dcp.load({"train": DCPState(model, opt)}, checkpoint_id=str(path))
    else:
        load_dcp(path, model, opt)


def _case_load(rank: int, world: int, root: str, plans: list[tuple[str, str]]) -> None:
    """Load each ``(checkpoint, layout)`` into a fresh model of that layout (the way it was saved:
    ``DCPState`` keeps its state under its key)."""
    ref, ref_opt = _loaded_reference(root)
    for source, layout in plans:
        model, opt = _parallel(world, layout, seed=7)
        _dcp_load(model, opt, Path(root) / source)
        _check_equal(model, opt, ref, ref_opt, f"{source} into {layout} on {world} ranks")
        _check_forward(model, ref, rank, world)


def _case_model(rank: int, world: int, root: str, device_type: str) -> None:
    """An MoE GPT with expert and vocabulary parallelism (on ``device_type``: ``"cuda"`` over NCCL
    from test_gpu.py, ``"cpu"`` over gloo here): logits equal the
    single process, a training step (global-norm clipping), expert moves with replicas, the
    load counts' reduction, moeflow's checkpoint and DCP all run, and what they load gives
    the same logits."""
    import torch.distributed.checkpoint as dcp

    from moeflow.checkpoint import load_checkpoint, save_checkpoint
    from moeflow.models import GPTConfig, MoEGPT
    from moeflow.parallel import (all_reduce_gradients, apply_placement, clip_grad_norm_, dcp_state_dict,
                                  dense_parameters, expert_parallel, load_dcp_state_dict, plan_placement,
                                  sync_load_counts)
    from moeflow.models import vocab_parallel

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    E = 4 * world

    def build() -> MoEGPT:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=41, dim=16, n_layers=2, n_heads=2, max_seq_len=8, num_experts=E, top_k=2,
                        expert_hidden=12, router=moeflow.RouterConfig(load_balance_coef=0.0, bias_update_rate=1e-3))
        return MoEGPT(cfg, dtype=torch.float64, device=device)

    def parallel(model: MoEGPT) -> MoEGPT:
        expert_parallel(model)
        vocab_parallel(model)
        return model.eval()  # (training mode is set where the case trains)

    gen = torch.Generator().manual_seed(10)
    idx = torch.randint(0, 41, (2 * world, 8), generator=gen).to(device)
    tgt = torch.randint(0, 41, (2 * world, 8), generator=gen).to(device)
    mine = slice(2 * rank, 2 * rank + 2)
    ref = build()
    model = parallel(build())
    with torch.no_grad():
        torch.testing.assert_close(model(idx[mine]), ref(idx)[mine], rtol=1e-10, atol=1e-10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    (model.loss(idx[mine], tgt[mine]) + moeflow.aux_loss(model)).backward()
    # the replicated (dense) parameters stay equal on every rank, as the trainer keeps them: a
    # checkpoint holds one copy of them
    all_reduce_gradients(dense_parameters(model), None)
    norm = clip_grad_norm_(model, 1.0)
    assert torch.isfinite(norm) and norm.device == device
    opt.step()
    sync_load_counts(model, None)
    moeflow.update_expert_bias(model)
    model.eval()
    with torch.no_grad():
        before = model(idx[mine])
        layers = moeflow.moe_layers(model)
        # one spare slot per rank holds a replica of the hot expert; one rank (a one-GPU machine)
        # has no room for a replica, so its plan only reorders
        apply_placement(model, [plan_placement([1.0] * (E - 1) + [5.0], world=world, slots_per_rank=min(E, E // world + 1))]
                        * len(layers), opt)
        torch.testing.assert_close(model(idx[mine]), before, rtol=1e-10, atol=1e-10)
    save_checkpoint(Path(root) / "moeflow", 1, model, opt)
    loaded = parallel(build())
    load_checkpoint(Path(root) / "moeflow", loaded, torch.optim.AdamW(loaded.parameters(), lr=1e-2), restore_rng=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx[mine]), before, rtol=1e-10, atol=1e-10)
    dcp.save(dcp_state_dict(model, opt), checkpoint_id=f"{root}/dcp")
    fresh = parallel(build())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = dcp_state_dict(fresh, fresh_opt)
    dcp.load(state, checkpoint_id=f"{root}/dcp")
    load_dcp_state_dict(fresh, state, fresh_opt)
    with torch.no_grad():
        torch.testing.assert_close(fresh(idx[mine]), before, rtol=1e-10, atol=1e-10)


CASES = {"save": _case_save, "load": _case_load, "model": _case_model}


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """The reference (moeflow format) and its DCP checkpoints from 2 and 4 ranks in each layout."""
    root = tmp_path_factory.mktemp("dcp")
    ref, ref_opt = _reference()
    save_checkpoint(root / "reference", 1, ref, ref_opt, extra={"data_position": 32})
    spawn_ranks(2, __name__, "save", str(root))
    spawn_ranks(4, __name__, "save", str(root))
    return root


def test_saved_on_2_loads_on_4_in_any_layout(saved):
    moeflow_to_dcp(saved / "reference", saved / "dcp-from-moeflow")  # converted, loaded like the rest
    spawn_ranks(4, __name__, "load", str(saved), [
        ("dcp-contiguous-w2", "contiguous"), ("dcp-hidden-w2", "hidden"), ("dcp-replicated-w2", "contiguous"),
        ("dcp-contiguous-w2", "replicated"), ("dcp-from-moeflow", "hidden"), ("dcp-hidden-w2", "shuffled"),
    ])


def test_saved_on_4_loads_on_2_in_any_layout(saved):
    spawn_ranks(2, __name__, "load", str(saved), [
        ("dcp-contiguous-w4", "hidden"), ("dcp-hidden-w4", "contiguous"), ("dcp-replicated-w4", "replicated"),
        ("dcp-replicated-w4", "shuffled"),
    ])


@pytest.mark.parametrize("source", ["dcp-contiguous-w2", "dcp-hidden-w4", "dcp-replicated-w2"])
def test_loads_in_one_process_without_a_process_group(saved, source):
    assert not dist.is_initialized()
    ref, ref_opt = _reference()
    model = _gpt(7)
    opt = _optimizer(model)
    assert type(dcp_state_dict(model)["model"]["layers.0.ffn.experts.w_in"]) is torch.Tensor  # it holds all
    if source.startswith("dcp-replicated"):  # DCP itself (through DCPState) warns that it assumes one process
        with pytest.warns(UserWarning, match="single process"):
            _dcp_load(model, opt, saved / source)
    else:  # load_dcp without a process group: one process is what the caller asked for, no warning
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*single process")
            _dcp_load(model, opt, saved / source)
    _check_equal(model, opt, ref, ref_opt, source)
    idx, _ = _batch()
    assert torch.equal(model(idx), ref(idx))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for entry in read_index(path)["files"]:
        with safe_open(str(path / entry["file"]), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_converter_round_trip_is_identical(saved, tmp_path):
    src = next((saved / "reference").iterdir())
    moeflow_to_dcp(src, tmp_path / "dcp")
    back = dcp_to_moeflow(tmp_path / "dcp", tmp_path / "back")
    first, second = _tensors(src), _tensors(back)
    assert first.keys() == second.keys() and any("@3" in k for k in first) and any(k.startswith("rng/") for k in first)
    for k in first:
        assert first[k].dtype == second[k].dtype and torch.equal(first[k], second[k]), k
    a, b = read_index(src), read_index(back)
    for field in ("step", "experts", "optimizer", "extra", "world_size"):
        assert a[field] == b[field], field


def test_converter_reads_dcp_written_by_ranks(saved, tmp_path):
    """DCP checkpoints saved by 4 ranks under hidden slices, and by 2 through ``DCPState``, become
    moeflow checkpoints that load exactly; without a recorded step the converter asks for one."""
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        dcp_to_moeflow(saved / "dcp-hidden-w4", tmp_path / "x")
    out = dcp_to_moeflow(saved / "dcp-hidden-w4", tmp_path / "ck", step=1)
    ref, ref_opt = _reference()
    model = _gpt(9)
    opt = _optimizer(model)
    load_checkpoint(out, model, opt)
    _check_equal(model, opt, ref, ref_opt, "converted from DCP")
    # saved through DCPState, under its key "train"
    out = dcp_to_moeflow(saved / "dcp-replicated-w2", tmp_path / "ck2", step=1)
    model = _gpt(10)
    opt = _optimizer(model)
    load_checkpoint(out, model, opt)
    _check_equal(model, opt, ref, ref_opt, "converted from DCPState's DCP")


def test_convert_cli(saved, tmp_path, capsys):
    assert main(["convert", str(saved / "reference"), "--to-dcp", str(tmp_path / "dcp")]) == 0
    assert main(["convert", "--from-dcp", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    assert json.loads(json.dumps(read_index(next((tmp_path / "back").iterdir()))["extra"])) == {"data_position": 32}
    assert main(["convert", "--from-dcp", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "no .metadata" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "foreign"))
    assert main(["convert", "--from-dcp", str(tmp_path / "foreign"), str(tmp_path / "y")]) == 2
    assert "holds no moeflow-dcp/1 state" in capsys.readouterr().err


def test_model_training_placement_and_checkpoints_on_2_ranks(tmp_path):
    """The case test_gpu.py runs over NCCL, on 2 gloo ranks: expert and vocabulary parallel
    logits equal one process, a step, a placement with a replica, moeflow's checkpoint and DCP."""
    spawn_ranks(2, __name__, "model", str(tmp_path), "cpu")


def test_fresh_optimizer_gets_state_without_moving_anything():
    model = _gpt(3)
    opt = _optimizer(model)
    model.loss(*_batch()).backward()
    before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
    state = dcp_state_dict(model, opt)
    assert set(state["optim"]["state"]["embed.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert [g["lr"] for g in opt.param_groups] == [1e-2]
    for (value, grad), p in zip(before, model.parameters(), strict=True):
        assert torch.equal(p, value) and torch.equal(p.grad, grad)


def test_load_refuses_another_model_or_format():
    state = dcp_state_dict(_gpt(0))
    other = MoEGPT(GPTConfig(vocab_size=V, dim=16, n_layers=2, n_heads=2, max_seq_len=8, num_experts=8, top_k=2,
                             expert_hidden=12), dtype=torch.float64)
    with pytest.raises(ValueError, match="experts per parameter"):
        load_dcp_state_dict(other, {**state, "model": {}})
    with pytest.raises(ValueError, match="moeflow-dcp/1"):
        load_dcp_state_dict(_gpt(0), {**state, "moeflow": "{}"})
    model = _gpt(0)
    with pytest.raises(ValueError, match="no 'optim' entry"):
        load_dcp_state_dict(model, dcp_state_dict(model), _optimizer(model))
    opt = _optimizer(model)
    with pytest.raises(TypeError, match="state must be the dict .* got AdamW"):
        load_dcp_state_dict(model, opt, dcp_state_dict(model, opt))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer must be .* got dict"):
        load_dcp_state_dict(model, {}, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be an nn.Module, got AdamW"):
        dcp_state_dict(opt)  # type: ignore[arg-type]


def test_chunked_tensor_checks_its_chunks_and_has_no_data():
    rows = torch.arange(12.0).view(3, 4)
    t = ChunkedTensor((5, 4), [((2, 0), rows, True)], dtype=torch.float32, device="cpu")
    assert t.shape == (5, 4) and t.chunks()[0][1] is rows and "(2, 0)+(3, 4)" in repr(t)
    with pytest.raises(NotImplementedError, match="checkpoint view"):
        t + 1
    with pytest.raises(ValueError, match="does not fit"):
        ChunkedTensor((4, 4), [((2, 0), rows, True)], dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="share an offset"):
        ChunkedTensor((9, 4), [((2, 0), rows, True), ((2, 0), rows, False)], dtype=torch.float32, device="cpu")

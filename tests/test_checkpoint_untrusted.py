"""Checkpoints and Hugging Face directories as untrusted input (issue 17): every damaged, edited or
hostile file gives a ``CheckpointError`` (the CLI: one line, exit 2) naming the file and the field,
never a bare ``KeyError``, a crash, a silently wrong model, or a read of a file outside the
directory. Each case starts from a good checkpoint (or HF directory) written by moeflow, applies
one edit, loads, and checks the error; a file outside the directory ("the secret") must never be
opened, which an audit hook on ``open`` and a wrapper around ``safetensors.safe_open`` watch.
The counts of the sweep are in ``docs/reliability.md``."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import moeflow
import moeflow.checkpoint.format as fmt
import moeflow.convert.hf_files as hf_files
from moeflow.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moeflow.cli.main import main
from moeflow.convert.mixtral import gpt_from_hf, gpt_to_hf
from moeflow.models import MoEGPT, gpt_config

pytestmark = pytest.mark.reference

_OPENED: list[str] = []  # every path opened while _WATCH is set (audit hooks cannot be removed)
_WATCH = [False]


def _audit(event: str, args: tuple) -> None:
    if _WATCH[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def watch(monkeypatch):
    """Record every file opened (Python ``open`` and ``safe_open``) during the test."""
    for module in (fmt, hf_files):
        real = module.safe_open

        def spy(path, *a, _real=real, **kw):
            _OPENED.append(os.fsdecode(path))
            return _real(path, *a, **kw)

        monkeypatch.setattr(module, "safe_open", spy)
    _OPENED.clear()
    _WATCH[0] = True
    yield _OPENED
    _WATCH[0] = False


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8, dtype=torch.float64),
        moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, capacity_factor=0, dtype=torch.float64),
    )


@pytest.fixture
def good(tmp_path) -> tuple[Path, Path]:
    """(checkpoint directory of a trained model with AdamW state, a secret file beside it)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(6, 8, dtype=torch.float64)).square().sum().backward()
    opt.step()
    path = save_checkpoint(tmp_path / "ck", 1, model, opt, extra={"data": 3})
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("x" * 12345)
    return path, secret


def _load(path: Path, optimizer: str = "adamw") -> None:
    model = _model()
    opt = {"adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3),
           "sgd": lambda: torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
           "none": lambda: None}[optimizer]()
    load_checkpoint(path, model, opt)


def _edit_index(path: Path, edit) -> None:
    index = json.loads((path / "index.json").read_text())
    index = edit(index)
    (path / "index.json").write_text(index if isinstance(index, str) else json.dumps(index))


def _set(keys: tuple, value: object):
    def edit(index):
        node = index
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        return index
    return edit


def _drop(*keys: str):
    def edit(index):
        node = index
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]
        return index
    return edit


def _first_tensor_key(index: dict) -> str:
    return next(iter(index["files"][0]["tensors"]))


# (case id, edit of the parsed index (or a str: the new file text), words the message must hold)
INDEX_EDITS = [
    ("not-json", lambda i: "{not json", "not valid JSON"),
    ("a-list", lambda i: "[1, 2]", "JSON object"),
    ("format", _set(("format",), "other/1"), "format"),
    *[(f"no-{k}", _drop(k), repr(k)) for k in ("step", "world_size", "experts", "files", "optimizer", "extra")],
    ("step-str", _set(("step",), "two"), "step='two'"),
    ("step-negative", _set(("step",), -1), "step=-1"),
    ("step-bool", _set(("step",), True), "step=True"),
    ("world-size-0", _set(("world_size",), 0), "world_size=0"),
    ("experts-list", _set(("experts",), [4]), "experts"),
    ("experts-count-str", lambda i: _set(("experts", next(iter(i["experts"]))), "4")(i), "experts["),
    ("files-dict", _set(("files",), {}), "files"),
    ("files-empty", _set(("files",), []), "files is empty"),
    ("entry-not-dict", _set(("files", 0), "rank0.safetensors"), "files[0]"),
    ("entry-no-sha", _drop("files", 0, "sha256"), "'sha256'"),
    ("entry-no-bytes", _drop("files", 0, "bytes"), "'bytes'"),
    ("entry-no-tensors", _drop("files", 0, "tensors"), "'tensors'"),
    ("bytes-negative", _set(("files", 0, "bytes"), -5), "bytes=-5"),
    ("bytes-str", _set(("files", 0, "bytes"), "10"), "bytes='10'"),
    ("sha-short", _set(("files", 0, "sha256"), "abc"), "sha256"),
    ("file-pickle", _set(("files", 0, "file"), "weights.pt"), "not a .safetensors file"),
    ("file-dir", _set(("files", 0, "file"), "sub/rank.safetensors"), "not a plain file name"),
    ("file-int", _set(("files", 0, "file"), 3), "not a plain file name"),
    ("file-nul", _set(("files", 0, "file"), "rank\x00.safetensors"), "is not a file name"),
    ("tensors-list", _set(("files", 0, "tensors"), []), "tensors"),
    ("tensor-bad-key", lambda i: _set(("files", 0, "tensors", "weights"), {"shape": [1], "dtype": "float64"})(i),
     "'weights'"),
    ("tensor-expert-out-of-range", lambda i: _set(("files", 0, "tensors", "param/1.experts.w_in@99"),
                                                  {"shape": [8, 16], "dtype": "float64"})(i), "experts"),
    ("tensor-rng-rank", lambda i: _set(("files", 0, "tensors", "rng/rank7/cpu"),
                                       {"shape": [1], "dtype": "uint8"})(i), "world_size"),
    ("tensor-shape-str", lambda i: _set(("files", 0, "tensors", _first_tensor_key(i), "shape"), "8x8")(i), "shape"),
    ("tensor-dtype", lambda i: _set(("files", 0, "tensors", _first_tensor_key(i), "dtype"), "Tensor")(i), "dtype"),
    ("tensor-wrong-shape", lambda i: _set(("files", 0, "tensors", _first_tensor_key(i), "shape"), [3, 3])(i),
     "index.json says"),
    ("optimizer-str", _set(("optimizer",), "adam"), "optimizer"),
    ("optimizer-no-groups", _drop("optimizer", "param_groups"), "'param_groups'"),
    ("optimizer-params-int", _set(("optimizer", "param_groups", 0, "params"), [1]), "params[0]"),
    ("hyper-nan", _set(("optimizer", "param_groups", 0, "hyper", "lr"), float("nan")), "finite"),
    ("hyper-inf", _set(("optimizer", "param_groups", 0, "hyper", "weight_decay"), float("inf")), "finite"),
    ("hyper-lr-str", _set(("optimizer", "param_groups", 0, "hyper", "lr"), "abc"), "'lr'"),
    ("hyper-betas-short", _set(("optimizer", "param_groups", 0, "hyper", "betas"), [0.9]), "'betas'"),
    ("hyper-unknown", _set(("optimizer", "param_groups", 0, "hyper", "momentum"), 0.9), "'momentum'"),
    ("optimizer-type", _set(("optimizer", "type"), "torch.optim.sgd.SGD"), "optimizer.type"),
    ("extra-list", _set(("extra",), [1]), "extra"),
]


@pytest.mark.parametrize("case,edit,words", INDEX_EDITS, ids=[c[0] for c in INDEX_EDITS])
def test_index_schema_edits_are_named(good, case, edit, words) -> None:
    path, _ = good
    first = json.loads((path / "index.json").read_text())["files"][0]["file"]
    _edit_index(path, edit)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    assert words in str(err.value), str(err.value)
    # the refusal starts with the file it refused: index.json, or the data file whose header disagrees
    assert str(err.value).startswith(f"{path / (first if case == 'tensor-wrong-shape' else 'index.json')}: "), str(err.value)


@pytest.mark.parametrize("name", ["../outside/secret.txt", "../../outside/secret.txt", "ABSOLUTE", "..",
                                  "C:\\secret.safetensors", "link.safetensors"])
def test_paths_leaving_the_directory_are_refused_unopened(good, watch, name) -> None:
    path, secret = good
    if name == "ABSOLUTE":
        name = str(secret)
    if name == "link.safetensors":  # a plain name that is a symbolic link leading out
        (path / name).symlink_to(secret)
    _edit_index(path, _set(("files", 0, "file"), name))
    with pytest.raises(CheckpointError) as err:
        _load(path)
    assert "12345" not in str(err.value)  # the secret's size is never revealed
    assert not [p for p in watch if Path(p).resolve() == secret.resolve()], watch


def test_a_data_file_that_is_a_link_out_is_refused(good, watch) -> None:
    path, secret = good
    index = json.loads((path / "index.json").read_text())
    name = index["files"][0]["file"]
    (path / name).unlink()
    (path / name).symlink_to(secret)
    with pytest.raises(CheckpointError, match="symbolic link"):
        _load(path)
    assert not [p for p in watch if Path(p).resolve() == secret.resolve()], watch


def test_an_index_that_is_a_link_out_is_refused(good, watch) -> None:
    path, secret = good
    (path / "index.json").unlink()
    (path / "index.json").symlink_to(secret)
    with pytest.raises(CheckpointError, match="symbolic link"):
        _load(path)
    assert not [p for p in watch if Path(p).resolve() == secret.resolve()], watch


def _rehash(path: Path, name: str) -> None:
    """Make the index agree with a replaced file (size and sha256): what an attacker can do."""
    data = (path / name).read_bytes()
    import hashlib

    def edit(index):
        for entry in index["files"]:
            if entry["file"] == name:
                entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        return index
    _edit_index(path, edit)


class _Boom:
    def __reduce__(self):  # would run at unpickling: never happens, safetensors does not unpickle
        return (os.system, ("touch /tmp/moeflow-pwned",))


@pytest.mark.parametrize("how", ["truncate", "flip", "garbage", "pickle", "pickle-rehashed", "garbage-rehashed",
                                 "empty-rehashed", "header-huge-rehashed"])
def test_damaged_or_hostile_data_files(good, how) -> None:
    path, _ = good
    name = json.loads((path / "index.json").read_text())["files"][0]["file"]
    file = path / name
    data = file.read_bytes()
    payload = {
        "truncate": data[: len(data) // 2], "flip": data[:200] + bytes([data[200] ^ 1]) + data[201:],
        "garbage": os.urandom(len(data)), "pickle": pickle.dumps(_Boom()), "empty": b"",
        "header-huge": (10**15).to_bytes(8, "little") + b"{}",
    }[how.removesuffix("-rehashed")]
    file.write_bytes(payload)
    if how.endswith("-rehashed"):
        _rehash(path, name)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    assert name in str(err.value)
    assert not Path("/tmp/moeflow-pwned").exists()


def test_optimizer_of_another_type_is_refused_before_anything_changes(good) -> None:
    path, _ = good
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with pytest.raises(CheckpointError, match="SGD"):
        load_checkpoint(path, model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.param_groups[0]["lr"] == 1e-3 and not opt.state


def test_index_without_type_still_checks_hyper_parameter_names(good) -> None:
    """Checkpoints written before the type was recorded: an AdamW one into SGD is still refused
    (its hyper-parameters are not SGD's)."""
    path, _ = good
    _edit_index(path, _drop("optimizer", "type"))
    with pytest.raises(CheckpointError, match="not a hyper-parameter of SGD"):
        _load(path, "sgd")
    _load(path)  # and loads into AdamW


def test_loaded_hyper_parameters_keep_their_types(good) -> None:
    path, _ = good
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_checkpoint(path, model, opt)
    group = opt.param_groups[0]
    assert group["lr"] == 1e-2 and isinstance(group["betas"], tuple)
    model(torch.randn(3, 8, dtype=torch.float64)).sum().backward()
    opt.step()  # usable


def test_newest_step_without_index_is_never_silently_replaced(good) -> None:
    path, _ = good
    root = path.parent
    model = _model()
    newer = save_checkpoint(root, 2, model)
    (newer / "index.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        _load(newer, "none")
    with pytest.warns(UserWarning, match="step-00000002 has no index.json"):
        _load(root)  # the root: the latest complete one, said out loud


# ------------------------------------------------------------------ Hugging Face directories


@pytest.fixture
def hf_dir(tmp_path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    model = MoEGPT(gpt_config("tiny", vocab_size=64, n_layers=1, num_experts=4))
    path = gpt_to_hf(model, tmp_path / "hf")
    secret = tmp_path / "outside" / "secret.safetensors"
    secret.parent.mkdir()
    shutil.copy(path / "model.safetensors", secret)  # a valid file, so reading it would "work"
    return path, secret


def _shard(path: Path, weight_map_of) -> None:
    """Turn the directory into a sharded one whose index maps tensors by ``weight_map_of``."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map_of(keys)}))


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg = edit(cfg)
    (path / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))


HF_CASES = [
    ("config-missing", lambda p, s: (p / "config.json").unlink(), "no config.json"),
    ("config-garbage", lambda p, s: (p / "config.json").write_text("{oops"), "not valid JSON"),
    ("config-list", lambda p, s: (p / "config.json").write_text("[]"), "expected an object"),
    ("no-hidden-size", lambda p, s: _edit_config(p, lambda c: {k: v for k, v in c.items() if k != "hidden_size"}),
     "'hidden_size'"),
    ("hidden-size-str", lambda p, s: _edit_config(p, lambda c: {**c, "hidden_size": "64"}), "hidden_size='64'"),
    ("experts-zero", lambda p, s: _edit_config(p, lambda c: {**c, "num_local_experts": 0}), "num_local_experts=0"),
    ("eps-nan", lambda p, s: _edit_config(p, lambda c: {**c, "rms_norm_eps": float("nan")}), "rms_norm_eps"),
    ("family", lambda p, s: _edit_config(p, lambda c: {**c, "model_type": "llama"}), "model_type"),
    ("shape-vs-config", lambda p, s: _edit_config(p, lambda c: {**c, "intermediate_size": c["intermediate_size"] + 1}),
     "config.json gives"),
    ("weights-missing", lambda p, s: (p / "model.safetensors").unlink(), "no model.safetensors"),
    ("weights-truncated", lambda p, s: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:300]),
     "not a readable safetensors"),
    ("weights-garbage", lambda p, s: (p / "model.safetensors").write_bytes(os.urandom(4000)), "not a readable safetensors"),
    ("weights-pickle", lambda p, s: (p / "model.safetensors").write_bytes(pickle.dumps(_Boom())),
     "not a readable safetensors"),
    ("weights-link-out", lambda p, s: ((p / "model.safetensors").unlink(), (p / "model.safetensors").symlink_to(s)),
     "symbolic link"),
    ("index-no-weight-map", lambda p, s: (p / "model.safetensors.index.json").write_text("{}"), "weight_map"),
    ("index-list", lambda p, s: (p / "model.safetensors.index.json").write_text("[]"), "weight_map"),
    ("index-traversal", lambda p, s: _shard(p, lambda ks: {k: "../outside/secret.safetensors" for k in ks}),
     "leaves the directory"),
    ("index-absolute", lambda p, s: _shard(p, lambda ks: {k: str(s) for k in ks}), "leaves the directory"),
    ("index-file-int", lambda p, s: _shard(p, lambda ks: {k: 7 for k in ks}), "not a file name"),
    ("index-wrong-file", lambda p, s: (shutil.copy(p / "model.safetensors", p / "b.safetensors"),
                                      _shard(p, lambda ks: {k: "b.safetensors" if i == 0 else "model.safetensors"
                                                            for i, k in enumerate(ks)})),
     "both"),
    ("index-missing-file", lambda p, s: _shard(p, lambda ks: {k: "gone.safetensors" for k in ks}), "missing"),
    ("extra-tensor", lambda p, s: _add_tensor(p, "model.layers.9.mlp.weight", torch.zeros(2)), "does not know"),
    ("int-tensor", lambda p, s: _add_tensor(p, "model.norm.weight", None),
     "floating-point"),
    ("generation-config-bad-eos", lambda p, s: (p / "generation_config.json").write_text('{"eos_token_id": 999}'),
     "eos_token_id"),
]


def _add_tensor(path: Path, key: str, value: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors[key] = value if value is not None else tensors[key].to(torch.int64)  # None: same shape, integer
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("case,damage,words", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_damaged_or_hostile_hf_directories(hf_dir, watch, tmp_path, capsys, case, damage, words) -> None:
    path, secret = hf_dir
    damage(path, secret)
    code = main(["convert", "--from-hf", str(path), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("moeflow convert: error:") and err.count("\n") == 1, err
    assert words in err, err
    assert not [p for p in watch if Path(p).resolve() == secret.resolve()], watch
    assert not (tmp_path / "out").exists()
    assert not Path("/tmp/moeflow-pwned").exists()


def test_hf_round_trip_keeps_tokenizer_and_special_tokens(tmp_path) -> None:
    """``--to-hf`` writes generation_config.json and the tokenizer; ``--from-hf`` keeps the ids."""
    torch.manual_seed(0)
    model = MoEGPT(gpt_config("tiny", vocab_size=256, n_layers=1, num_experts=4))
    path = gpt_to_hf(model, tmp_path / "hf", special_tokens={"eos_token_id": 10, "bos_token_id": None},
                     tokenizer={"kind": "byte"})
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 10
    tok = json.loads((path / "tokenizer.json").read_text())
    assert tok["model"]["vocab"]["a"] == ord("a")
    assert main(["convert", "--from-hf", str(path), str(tmp_path / "ck")]) == 0
    from moeflow.checkpoint import read_index
    from moeflow.checkpoint.format import latest_checkpoint

    extra = read_index(latest_checkpoint(tmp_path / "ck"))["extra"]
    assert extra["special_tokens"] == {"bos_token_id": None, "eos_token_id": 10, "pad_token_id": None}
    back = gpt_from_hf(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


def test_a_file_as_destination_is_one_line(tmp_path, capsys, hf_dir) -> None:
    path, _ = hf_dir
    (tmp_path / "f").write_text("keep me")
    assert main(["convert", "--from-hf", str(path), str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and err.count("\n") == 1
    assert (tmp_path / "f").read_text() == "keep me"


@pytest.mark.parametrize("seed", range(3))
def test_a_refused_value_is_shown_with_its_type_and_at_most_60_characters(seed) -> None:
    """A hostile index can hold values of any size: an error shows a refused value's repr whole
    up to 60 characters and cut to 57 and "..." beyond (a message stays one readable line), and
    names the value's JSON type, for repr lengths on both sides of the limit."""
    from moeflow.checkpoint.schema import check_index

    gen = torch.Generator().manual_seed(seed)
    for n in (58, 59, 60, 61, 62, int(torch.randint(63, 400, (1,), generator=gen))):
        text = "".join(chr(int(c)) for c in torch.randint(97, 123, (n - 2,), generator=gen))  # repr adds 2 quotes
        shown = repr(text) if n <= 60 else repr(text)[:57] + "..."
        with pytest.raises(CheckpointError) as err:
            check_index({"format": text}, "where")
        assert str(err.value) == f"where: format {shown}, expected 'moeflow-checkpoint/1'"
        with pytest.raises(CheckpointError) as err:
            check_index({"format": "moeflow-checkpoint/1", "step": text, "world_size": 1, "experts": {}, "files": [],
                         "optimizer": None, "extra": {}}, "where")
        assert str(err.value) == f"where: step={shown} (str), expected an int >= 0"
    step = float(torch.rand((), generator=gen))
    with pytest.raises(CheckpointError) as err:
        check_index({"format": "moeflow-checkpoint/1", "step": step, "world_size": 1, "experts": {}, "files": [],
                     "optimizer": None, "extra": {}}, "where")
    assert str(err.value) == f"where: step={step!r} (float), expected an int >= 0"


@pytest.mark.parametrize("state_key", ["exp_avg", "exp_avg_sq"])
def test_expert_optimizer_state_both_whole_and_per_expert_is_refused(good, state_key) -> None:
    """An expert parameter's optimizer state saved both whole and per expert (an edited file,
    rehashed to match) is ambiguous: refused, the optimizer left as it was."""
    path, _ = good
    name = json.loads((path / "index.json").read_text())["files"][0]["file"]
    with fmt.safe_open(str(path / name), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    whole = torch.stack([tensors[f"optim/1.experts.w_in/{state_key}@{g}"] for g in range(4)])
    tensors[f"optim/1.experts.w_in/{state_key}"] = torch.randn(whole.shape, dtype=whole.dtype)
    from moeflow.checkpoint.io import _write_tensors

    entry = _write_tensors(path / name, tensors)
    _edit_index(path, lambda index: {**index, "files": [entry]})
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match=f"1.experts.w_in/{state_key} is split per expert"):
        load_checkpoint(path, model, opt)
    assert not opt.state and opt.param_groups[0]["lr"] == 1e-3
    # refused before anything was copied: the model too is as it was (the optimizer's state is
    # read after the parameters)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_refusal_late_in_the_load_leaves_the_model_as_it_was(good) -> None:
    """A mismatch in the last layer (experts of another width), found after the first layer's
    tensors would have been copied, leaves every tensor of the model as it was; the same model
    of the checkpoint's shapes then loads."""
    path, _ = good
    torch.manual_seed(1)
    wider = torch.nn.Sequential(
        torch.nn.Linear(8, 8, dtype=torch.float64),
        moeflow.MoE(dim=8, hidden=16, num_experts=4, top_k=2, capacity_factor=0, dtype=torch.float64))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    opt = torch.optim.AdamW(wider.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match=r"param/1\.experts\.w_in@.* has shape .* the model expects"):
        load_checkpoint(path, wider, opt)
    assert all(torch.equal(v, before[k]) for k, v in wider.state_dict().items())
    assert not opt.state
    model = _model()
    load_checkpoint(path, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert not torch.equal(model[0].weight, _model()[0].weight)  # (the trained weights came in)


# ------------------------------------------------------------------ every field of the index, refused by name


def _index_of(gen: torch.Generator, x: str = "1.experts.w_in") -> dict:
    """A valid parsed ``index.json`` of random shape: E experts of one expert parameter ``x``
    spread over ``world_size`` rank files, dense tensors (one of them empty) and optimizer state
    in the first, one RNG state per rank, AdamW's param groups and a non-tensor scalar."""
    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    world, per = draw(1, 3), draw(1, 3)
    experts = {x: world * per}
    files = []
    for r in range(world):
        tensors = {f"rng/rank{r}/cpu": {"shape": [draw(1, 9000)], "dtype": "uint8"}}
        for g in range(r * per, (r + 1) * per):
            tensors[f"param/{x}@{g}"] = {"shape": [draw(1, 8), draw(1, 8)], "dtype": "float32"}
            tensors[f"optim/{x}/exp_avg@{g}"] = {"shape": [draw(1, 8), draw(1, 8)], "dtype": "float32"}
        if r == 0:
            tensors["param/0.weight"] = {"shape": [draw(1, 8), draw(1, 8)], "dtype": "float64"}
            tensors["buffer/0.mask"] = {"shape": [], "dtype": "bool"}
            tensors["param/0.bias"] = {"shape": [0, draw(0, 3)], "dtype": "float64"}  # empty: no rows
        sha = "".join("0123456789abcdef"[int(c)] for c in torch.randint(0, 16, (64,), generator=gen))
        files.append({"file": f"rank{r:05d}-of-{world:05d}.safetensors", "sha256": sha, "bytes": draw(0, 10**6),
                      "tensors": tensors})
    optimizer = {"type": "torch.optim.adamw.AdamW",
                 "param_groups": [{"params": ["0.weight", x],
                                   "hyper": {"lr": 0.01, "betas": [0.9, 0.999], "amsgrad": False}}],
                 "scalars": {"0.weight": {"note": [1, 2.5]}}}
    return {"format": "moeflow-checkpoint/1", "step": draw(0, 10**6), "world_size": world, "experts": experts,
            "files": files, "optimizer": optimizer, "extra": {"data": draw(0, 99)}}


def _id(text: str) -> str:
    """A test id of ``text``'s letters and digits (node ids that a command line can select)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text.encode("ascii", "backslashreplace").decode()).strip("-")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# (where in the index, the field as a refusal names it, what it expects, hostile values of the wrong
# type or range: one is drawn per case and seed). Every check of the schema that refuses a value by
# its type or range, one row each; a row reads the index it edits (an expert's key, a file's name)
_IS_NOT = {"str": "4", "float": 4.0, "bool": True, "none": None, "list": [4], "dict": {"a": 4}, "int": 4}
_FIELD_CASES = [
    ((), "the index", "a JSON object", ["list", "str", "int", "none"]),
    (("step",), "step", "an int >= 0", ["str", "float", "bool", "none", "list", -1]),
    (("world_size",), "world_size", "an int >= 1", ["str", "float", "bool", "none", "dict", 0, -3]),
    (("experts",), "experts", "a JSON object", ["list", "str", "int", "none"]),
    (("experts", "1.experts.w_in"), "experts['1.experts.w_in']", "an int >= 1", ["str", "float", "bool", 0, -2]),
    (("files",), "files", "a JSON list", ["dict", "str", "int", "none"]),
    (("files", 0), "files[0]", "a JSON object", ["list", "str", "int", "none"]),
    (("files", -1, "sha256"), "files[-1].sha256", "64 lowercase hex digits",
     ["int", "none", "list", "a" * 63, "A" * 64, "g" * 64, "0" * 65]),
    (("files", -1, "bytes"), "files[-1].bytes", "an int >= 0", ["str", "float", "bool", "none", -1]),
    (("files", -1, "tensors"), "files[-1].tensors", "a JSON object", ["list", "str", "int", "none"]),
    (("files", 0, "tensors", "param/0.weight"), "files[0].tensors['param/0.weight']", "a JSON object",
     ["list", "str", "int", "none"]),
    (("files", 0, "tensors", "param/0.weight", "shape"), "files[0].tensors['param/0.weight'].shape",
     "a list of non-negative ints", ["str", "int", "none", "dict", [2, -1], [2, True], [2.0], ["2"]]),
    (("files", 0, "tensors", "param/0.weight", "dtype"), "files[0].tensors['param/0.weight'].dtype",
     "a torch dtype name such as 'float32'", ["int", "none", "list", "Tensor", "float99", "nn", ""]),
    (("optimizer",), "optimizer", "a JSON object", ["list", "str", "int"]),
    (("optimizer", "type"), "optimizer.type", "a class name", ["int", "none", "list", "dict"]),
    (("optimizer", "param_groups"), "optimizer.param_groups", "a JSON list", ["dict", "str", "int", "none"]),
    (("optimizer", "param_groups", 0), "optimizer.param_groups[0]", "a JSON object", ["list", "str", "int"]),
    (("optimizer", "param_groups", 0, "params"), "optimizer.param_groups[0].params", "a JSON list",
     ["dict", "str", "int", "none"]),
    (("optimizer", "param_groups", 0, "params", 1), "optimizer.param_groups[0].params[1]", "a parameter name",
     ["int", "none", "list", "dict", "float"]),
    (("optimizer", "param_groups", 0, "hyper"), "optimizer.param_groups[0].hyper", "a JSON object",
     ["list", "str", "int", "none"]),
    (("optimizer", "param_groups", 0, "hyper", "lr"), "optimizer.param_groups[0].hyper['lr']", "a finite number",
     [float("nan"), float("inf"), -float("inf")]),
    (("optimizer", "param_groups", 0, "hyper", "betas", 1), "optimizer.param_groups[0].hyper['betas'][1]",
     "a finite number", [float("nan"), float("inf")]),
    (("optimizer", "scalars"), "optimizer.scalars", "a JSON object", ["list", "str", "int", "none"]),
    (("optimizer", "scalars", "0.weight"), "optimizer.scalars['0.weight']", "a JSON object",
     ["list", "str", "int", "none"]),
    (("optimizer", "scalars", "0.weight", "note", 1), "optimizer.scalars['0.weight']['note'][1]", "a finite number",
     [float("nan"), -float("inf")]),
    (("extra",), "extra", "a JSON object", ["list", "str", "int", "none"]),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("at,field,want,values", _FIELD_CASES, ids=[_id(c[1]) for c in _FIELD_CASES])
def test_every_refused_index_field_is_named_with_its_value_and_type(seed, at, field, want, values) -> None:
    """A hostile or damaged ``index.json`` is refused with one message naming the index file, the
    field (its path inside the index: which file entry, which tensor, which group), the refused
    value with its JSON type, and what was expected: for every field the schema checks by type or
    range, on a random valid index (random experts, ranks, files) that passes before the edit."""
    from moeflow.checkpoint.schema import check_index

    gen = torch.Generator().manual_seed(seed + 100 * _FIELD_CASES.index((at, field, want, values)))
    index = _index_of(gen)
    where = f"/ck{int(torch.randint(0, 999, (1,), generator=gen))}/step-00000001/index.json"
    assert check_index(json.loads(json.dumps(index)), where) == index
    field = field.replace("files[-1]", f"files[{len(index['files']) - 1}]")  # the last rank's file
    pick = values[int(torch.randint(0, len(values), (1,), generator=gen))]
    value = _IS_NOT.get(pick, pick) if isinstance(pick, str) else pick
    if at:
        node = index
        for k in at[:-1]:
            node = node[k]
        node[at[-1]] = value
    else:
        index = value
    with pytest.raises(CheckpointError) as err:
        check_index(index, where)
    assert str(err.value) == f"{where}: {field}={_shown(value)} ({type(value).__name__}), expected {want}"


# (key, accepted): every form of tensor key the loaders take apart, and near misses of each. x is
# the index's expert parameter (a name with a "/" too: torch allows it), E its experts, W the world
# size
_KEYS = [
    ("param/0.weight", True), ("param/a/b", True), ("buffer/0.mask", True), ("optim/0.weight/exp_avg", True),
    ("optim/a/b/step", True), ("param/{x}@{last}", True), ("optim/{x}/exp_avg@{last}", True),
    ("optim/{x}/exp_avg@0", True), ("rng/rank{rank}/cpu", True), ("rng/rank0/cuda", True),
    ("weights", False), ("params/0.weight", False), ("param/", False), ("rng/", False), ("param/x@", False),
    ("param/{x}@1a", False), ("param/{x}@\u0663", False), ("param/{x}@-1", False),
    ("param/{x}@{E}", False), ("optim/{x}/exp_avg@{E}", False), ("param/other@0", False),
    ("optim/other/exp_avg@0", False), ("buffer/{x}@0", False), ("optim/0.weight", False),
    ("optim/{x}@0", False), ("rng/rank{W}/cpu", False), ("rng/rank0/", False), ("rng/rank0/cuda:0", False),
    ("rng/rankx/cpu", False), ("rng/rank0/cpu/x", False), ("rng/cpu", False), ("/param/x", False),
    ("param/{x}@0@0", False), ("param/a@b", False), ("optim/{x}/a@b@0", False),
]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("key,accepted", _KEYS, ids=[_id(k.replace("{x}", "x")) for k, _ in _KEYS])
def test_index_tensor_keys_are_checked_by_form(seed, key, accepted) -> None:
    """A tensor key of ``index.json`` is one of ``param/<n>[@<g>]``, ``buffer/<n>``,
    ``optim/<n>/<state>[@<g>]``, ``rng/rank<r>/<device>``, with ``g`` below the parameter's
    expert count and ``r`` below the world size: each form is accepted (at the limits: the last
    expert, the last rank) and each near miss refused, naming the file entry and the key."""
    from moeflow.checkpoint.schema import check_index

    gen = torch.Generator().manual_seed(seed + 1000 * [k for k, _ in _KEYS].index(key))
    x = ("1.experts.w_in", "blocks/1.experts.w_in")[seed]
    index = _index_of(gen, x)
    E, W = index["experts"][x], index["world_size"]
    key = key.format(x=x, last=E - 1, E=E, rank=W - 1, W=W)
    for entry in index["files"]:  # (a key the index holds moves to the last file)
        entry["tensors"].pop(key, None)
    index["files"][-1]["tensors"][key] = {"shape": [3], "dtype": "float32"}
    where = f"/ck/step-{seed:08d}/index.json"
    if accepted:
        assert check_index(index, where)["files"][-1]["tensors"][key] == {"shape": [3], "dtype": "float32"}
        return
    with pytest.raises(CheckpointError) as err:
        check_index(index, where)
    assert str(err.value).startswith(f"{where}: files[{W - 1}].tensors has key {key!r}"), str(err.value)


def test_index_structure_refusals_name_what_is_wrong() -> None:
    """What the schema refuses beyond a value's type: a missing field, an empty file list, a file
    listed twice, a key in two files, an expert in no file, a group without its lists, each with
    a message naming the index and what is wrong, on random valid indexes; and an index with no
    optimizer (``null``: a model saved alone) is valid."""
    from moeflow.checkpoint.schema import check_index

    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        where = f"/ck/step-{seed:08d}/index.json"

        def refused(edit, words: str) -> None:
            index = _index_of(gen)
            check_index(json.loads(json.dumps(index)), where)
            edit(index)
            with pytest.raises(CheckpointError) as err:
                check_index(index, where)
            assert str(err.value).startswith(f"{where}: ") and words in str(err.value), (words, str(err.value))

        for field in ("step", "world_size", "experts", "files", "optimizer", "extra"):
            refused(lambda i, f=field: i.pop(f), f"required field {field!r} is missing")
        refused(lambda i: i.update(format="moeflow-checkpoint/2"), "format 'moeflow-checkpoint/2', expected")
        refused(lambda i: i.pop("format"), "format None, expected")
        refused(lambda i: i.update(files=[]), "files is empty")
        for field in ("file", "sha256", "bytes", "tensors"):
            refused(lambda i, f=field: i["files"][0].pop(f), f"files[0] has no {field!r} field")
        for name in (".", "..", "a/b.safetensors", "/abs.safetensors", "a\\b.safetensors", "../x.safetensors"):
            refused(lambda i, n=name: i["files"][0].update(file=n), f"files[0].file={name!r} is not a plain file name")
        for name in ("x.pt", "x.safetensors.bak", "safetensors", ".json"):
            refused(lambda i, n=name: i["files"][0].update(file=n), f"files[0].file={name!r} is not a .safetensors file")
        refused(lambda i: i["files"].append({**i["files"][0], "tensors": {}}), "is listed twice")
        refused(lambda i: i["files"].append({**i["files"][0], "file": "b.safetensors",
                                            "tensors": {"param/0.weight": {"shape": [1], "dtype": "float32"}}}),
                "'param/0.weight' is listed in both rank00000-of-")
        g = int(torch.randint(0, 2, (1,), generator=gen))  # the first or the last expert

        def drop_expert(i, g=g):
            E = i["experts"]["1.experts.w_in"]
            for entry in i["files"]:
                entry["tensors"].pop(f"param/1.experts.w_in@{g * (E - 1)}", None)
        refused(drop_expert, "expert(s) [")
        refused(lambda i: i["experts"].update({"9.experts.w_out": 2}), "expert(s) [0, 1] of 9.experts.w_out (E=2)")
        for field in ("param_groups", "scalars"):
            refused(lambda i, f=field: i["optimizer"].pop(f), f"optimizer has no {field!r} field")
        for field in ("params", "hyper"):
            refused(lambda i, f=field: i["optimizer"]["param_groups"][0].pop(f),
                    "optimizer.param_groups[0] needs 'params' and 'hyper'")
        index = _index_of(gen)
        index["optimizer"] = None
        assert check_index(index, where)["optimizer"] is None
        index["optimizer"] = {"param_groups": [], "scalars": {}}  # no type: an older checkpoint's
        assert check_index(index, where)["optimizer"] == {"param_groups": [], "scalars": {}}


@pytest.mark.parametrize("where", ["dense", "expert"])
def test_a_name_holding_an_at_sign_is_refused_at_save(tmp_path, where) -> None:
    """``@`` marks the expert in a checkpoint's keys, and ``index.json``'s check refuses a key
    whose ``@`` is not followed by an expert of that parameter: a module named with ``@`` (torch
    allows it) would give a checkpoint that saves and never loads. The save refuses it instead,
    naming the parameter, and publishes nothing; the same model under a plain name round-trips."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    name = "m@1" if where == "expert" else "blocks"
    model.add_module(name, moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, capacity_factor=0,
                                       dtype=torch.float64))
    model.add_module("norm@2" if where == "dense" else "norm", torch.nn.LayerNorm(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="cannot checkpoint '(m@1|norm@2)[^']*': '@' marks the expert"):
        save_checkpoint(tmp_path, 1, model)
    assert fmt.latest_checkpoint(tmp_path) is None
    from moeflow.checkpoint.schema import check_index

    index = _index_of(torch.Generator().manual_seed(len(where)), "m@1.experts.w_in")  # such a one made by hand
    with pytest.raises(CheckpointError, match="has key 'param/m@1.experts.w_in@0'"):
        check_index(index, "index.json")
    plain = torch.nn.Sequential(torch.nn.LayerNorm(8, dtype=torch.float64),
                                moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, capacity_factor=0,
                                            dtype=torch.float64))
    path = save_checkpoint(tmp_path, 1, plain)
    again = torch.nn.Sequential(torch.nn.LayerNorm(8, dtype=torch.float64),
                                moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, capacity_factor=0,
                                            dtype=torch.float64))
    load_checkpoint(path, again)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), again.state_dict().values()))


def test_inside_takes_only_names_that_stay_in_the_directory(tmp_path) -> None:
    """``format.inside``, the one gate every checkpoint and Hugging Face file name passes before
    it is opened: a non-empty relative name (nested is fine) resolves inside the root, links that
    stay inside included; anything else is refused with a ``CheckpointError`` naming ``what``:
    not a string, empty, a NUL byte, absolute, a Windows drive or backslash, a ``..`` part even
    when it would come back inside, a link (or a directory link on the way) that leads out."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (root / "sub" / "a.safetensors").write_bytes(b"x")
    (root / "in-link").symlink_to(root / "sub" / "a.safetensors")
    (root / "out-link").symlink_to(tmp_path / "out")
    (root / "out-file").symlink_to(tmp_path / "out" / "b")
    gen = torch.Generator().manual_seed(0)
    what = f"what-{int(torch.randint(0, 10**6, (1,), generator=gen))}"
    for name, resolved in [("sub/a.safetensors", root / "sub" / "a.safetensors"), ("sub", root / "sub"),
                           ("in-link", root / "sub" / "a.safetensors"), ("new.json", root / "new.json"),
                           ("sub/./a.safetensors", root / "sub" / "a.safetensors")]:
        assert fmt.inside(root, name, what) == resolved.resolve(), name
    for name in [None, 3, b"sub", "", "sub/\x00a", "/etc/passwd", str(root / "sub" / "a.safetensors"), "C:a",
                 "C:\\a", "sub\\a.safetensors", "..", "../root/sub/a.safetensors", "sub/../sub/a.safetensors",
                 "out-link/b", "out-file", "out-link"]:
        with pytest.raises(CheckpointError) as err:
            fmt.inside(root, name, what)
        assert str(err.value).startswith(f"{what}: "), (name, str(err.value))


def test_read_json_refusals_name_the_file(tmp_path) -> None:
    """``format.read_json`` (``index.json``, and a Hugging Face directory's JSON files): each
    refusal is a ``CheckpointError`` that starts with the file it refused (``root/name``), for a
    missing file, a directory, text that is not JSON, bytes that are not UTF-8, nesting past the
    parser's recursion limit, and a link that leads out; a good file comes back parsed."""
    gen = torch.Generator().manual_seed(0)
    root = tmp_path / "ck"
    root.mkdir()
    (tmp_path / "secret.json").write_text("{}")
    value = {"a": [int(v) for v in torch.randint(0, 99, (5,), generator=gen)], "b": {"c": None, "d": 0.5}}
    (root / "good.json").write_text(json.dumps(value))
    assert fmt.read_json(root, "good.json") == value
    (root / "dir.json").mkdir()
    (root / "text.json").write_text("{not json")
    (root / "bytes.json").write_bytes(b'{"a": "\xff\xfe"}')
    (root / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (root / "out.json").symlink_to(tmp_path / "secret.json")
    for name, words in [("gone.json", "missing"), ("dir.json", "missing"), ("text.json", "not valid JSON"),
                        ("bytes.json", "not valid JSON"), ("deep.json", "not valid JSON"),
                        ("out.json", "symbolic link")]:
        with pytest.raises(CheckpointError) as err:
            fmt.read_json(root, name)
        assert str(err.value).startswith(f"{root / name}: ") and words in str(err.value), str(err.value)


def test_a_root_loads_its_latest_complete_step_and_names_a_newer_one_it_skips(tmp_path) -> None:
    """``load_checkpoint(root)``: the latest complete step, silently when every step without an
    index is older than it (or a ``.tmp-step-*``), with one warning, pointing at the caller's
    line, naming the newest one when some are newer; such a step named directly is refused,
    naming the latest complete one when there is one."""
    import warnings

    gen = torch.Generator().manual_seed(0)
    steps = sorted(int(s) for s in torch.randperm(50, generator=gen)[:3] + 10)  # three complete ones
    model = torch.nn.Linear(4, 4)
    for s in steps:
        save_checkpoint(tmp_path, s, model, keep=5)
    latest = tmp_path / f"step-{steps[-1]:08d}"
    (tmp_path / f"step-{steps[0] + 1:08d}").mkdir()  # older than the latest, without an index
    (tmp_path / f".tmp-step-{steps[-1] + 3:08d}").mkdir()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert load_checkpoint(tmp_path, torch.nn.Linear(4, 4))["path"] == str(latest)
    assert not seen, [str(w.message) for w in seen]
    newer = sorted(steps[-1] + int(d) for d in torch.randperm(9, generator=gen)[:2] + 1)
    for s in newer:
        (tmp_path / f"step-{s:08d}").mkdir()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert load_checkpoint(tmp_path, torch.nn.Linear(4, 4))["path"] == str(latest)
    assert len(seen) == 1 and seen[0].category is UserWarning
    if "MUTANT_UNDER_TEST" not in os.environ:  # (mutmut's trampolines add frames between the two)
        assert seen[0].filename == __file__
    assert str(seen[0].message) == (f"{tmp_path}: loading {latest.name}, the latest complete checkpoint; "
                                    f"step-{newer[-1]:08d} has no index.json (an interrupted save or a partial "
                                    "copy) and is never loaded")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / f"step-{newer[0]:08d}", torch.nn.Linear(4, 4))
    assert str(err.value).endswith(f"never loaded; the latest complete one is {latest}")
    alone = tmp_path / "alone" / "step-00000003"
    alone.mkdir(parents=True)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(alone, torch.nn.Linear(4, 4))
    assert str(err.value).endswith("never loaded")
    with pytest.raises(CheckpointError, match="no complete checkpoint here"):
        load_checkpoint(tmp_path / "alone", torch.nn.Linear(4, 4))


def test_read_index_of_a_directory_without_one_or_with_a_dangling_link(tmp_path) -> None:
    """``read_index`` (``describe_checkpoint``, ``reshard_checkpoint``, ``convert --info``): a
    directory without ``index.json`` is refused as not a complete checkpoint; an ``index.json``
    that is a link leading out to nothing is still refused as a link leading out (never taken
    for a missing file, which would hide where it points to)."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as err:
        fmt.read_index(tmp_path / "empty")
    assert str(err.value) == f"{tmp_path / 'empty'}: no index.json (not a complete moeflow checkpoint)"
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "index.json").symlink_to(tmp_path / "gone" / "index.json")
    with pytest.raises(CheckpointError, match="symbolic link that leads outside"):
        fmt.read_index(tmp_path / "dangling")


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_data_file_whose_header_disagrees_with_the_index_is_refused_before_anything_is_loaded(good, change) -> None:
    """A data file rewritten (and rehashed, so size and checksum agree) with the model's last
    tensor in another dtype or shape than ``index.json`` lists: the checking pass reads each
    file's header and refuses it, naming the file, the key and both sides, before any tensor
    of the model or the optimizer is touched (a refusal only when that tensor's data is read
    would leave the tensors before it loaded)."""
    path, _ = good
    name = json.loads((path / "index.json").read_text())["files"][0]["file"]
    with fmt.safe_open(str(path / name), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = "param/1.experts.w_out@3"  # the last expert of the model's last parameter
    tensors[key] = tensors[key].float() if change == "dtype" else tensors[key][:, :-1].clone()
    from safetensors.torch import save_file

    save_file(tensors, str(path / name))
    _rehash(path, name)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, model, opt)
    listed = json.loads((path / "index.json").read_text())["files"][0]["tensors"][key]
    now = ("float32", listed["shape"]) if change == "dtype" else ("float64", [listed["shape"][0], listed["shape"][1] - 1])
    assert str(err.value) == (f"{path / name}: {key} is {now[0]} {now[1]} in the file, index.json says "
                              f"{listed['dtype']} {listed['shape']}")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state and opt.param_groups[0]["lr"] == 1e-3


def test_a_dtype_outside_the_header_table_round_trips(tmp_path) -> None:
    """A tensor whose safetensors dtype code is not in ``format``'s header table (a float8
    buffer, uint16 state) is checked against ``index.json`` when it is read instead, and loads:
    a dtype the table does not know is never refused for that alone."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model.register_buffer("scale8", torch.randn(3, 5, generator=gen).to(torch.float8_e4m3fn))
    model.register_buffer("count16", torch.randint(0, 60000, (7,), generator=gen).to(torch.uint16))
    path = save_checkpoint(tmp_path, 1, model)
    again = torch.nn.Linear(4, 4)
    again.register_buffer("scale8", torch.zeros(3, 5).to(torch.float8_e4m3fn))
    again.register_buffer("count16", torch.zeros(7).to(torch.uint16))
    load_checkpoint(path, again)
    for k, v in model.state_dict().items():
        assert v.dtype == again.state_dict()[k].dtype and torch.equal(v.view(torch.uint8), again.state_dict()[k].view(torch.uint8))

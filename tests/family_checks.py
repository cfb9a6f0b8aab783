"""The checks every public-family test runs (``tests/test_family_<family>.py``, issue 47): a tiny
random model built with transformers' own config class (every option of the family on), saved
sharded with ``save_pretrained``, read with ``moeflow.convert.hf.gpt_from_hf`` and held to
transformers:

- ``check_logits``: logits of a left-padded batch (transformers given the attention mask and
  the positions ``generate`` gives it), fp64 at 1e-10 and fp32 at 1e-5;
- ``check_gradients``: a next-token loss and every parameter's gradient, transformers' taken
  through the family's tensor map (no balance losses: transformers adds its own only with
  ``output_router_logits``);
- ``check_generate``: greedy tokens of ``generate`` over 32 steps, eager and compiled, equal
  transformers' ``generate`` (fp32);
- ``check_round_trip``: ``gpt_to_hf`` -> the family's transformers class loads it -> saved
  again -> ``gpt_from_hf``: no tensor changes, and the tensor map agrees with
  ``moeflow.convert.moe_blocks`` (``ffn_from_hf`` / ``ffn_to_hf``) on every block;
- ``check_cli_round_trip``: ``moeflow convert --from-hf`` then ``--to-hf`` gives the same
  config and tensors;
- ``ep_step_case``: on 2 gloo ranks, a fine-tuning step (loss, backward, gradient reduction,
  AdamW) of the loaded model with its experts spread over the ranks equals the step of one
  process on the whole batch, in fp64;
- ``check_refusal``: a bad or unsupported ``config.json`` field is refused naming it.

In fp64, transformers' fp32 casts are kept in fp64 (``helpers.KeepFp64``) and its rotary
frequencies, which it computes in fp32 only, are replaced by moeflow's fp64 ones
(``moeflow.models.rope.rope_frequencies``); ``check_logits`` in fp32 first checks that its own
frequencies and scaling equal moeflow's bit for bit.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moeflow.checkpoint.schema import CheckpointError
from moeflow.convert.hf import FAMILIES, gpt_from_hf, gpt_to_hf
from moeflow.convert.hf_model import state_dict_from_tensors
from moeflow.convert.moe_blocks import ffn_from_hf, ffn_to_hf
from moeflow.models.generation import generate
from moeflow.models.gpt import MoEGPT
from moeflow.models.kv_cache import step_inputs
from moeflow.models.rope import rope_frequencies

from helpers import KeepFp64, rel_err

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
PROMPT_LENGTHS = (11, 6, 9)  # a left-padded batch: rows of different lengths
NEW_TOKENS = 32
SHARD = "24KB"  # small: every saved tiny model spans several shards


def transformers():  # type: ignore[no-untyped-def]
    return pytest.importorskip("transformers", reason="transformers is not installed: the HF families are not tested")


def randomize_hf(model: torch.nn.Module, seed: int, std: dict[str, float] | None = None) -> None:
    """Every parameter of a transformers model drawn fresh: norm weights around one, the rest
    (biases, sinks, routers included) N(0, 0.3^2) unless ``std`` names a larger scale for
    parameters whose name contains its key."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = next((s for key, s in (std or {}).items() if key in name), 0.3)
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale
            p.copy_((noise + (1.0 if "norm" in name else 0.0)).to(p.dtype))


def save_random(config, path: Path, seed: int,  # type: ignore[no-untyped-def]
                std: dict[str, float] | None = None) -> Path:
    """A transformers model of ``config`` with random parameters, saved sharded at ``path``."""
    model = transformers().AutoModelForCausalLM.from_config(config)
    randomize_hf(model, seed, std)
    model.save_pretrained(path, max_shard_size=SHARD)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2, "the test checkpoint should span several shards"
    return path


def load_hf(path: Path, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """transformers' model of ``path`` in ``dtype``, its readable paths (eager attention, the
    per-expert loop); in fp64 with moeflow's fp64 rotary frequencies (module docstring)."""
    model = transformers().AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                experts_implementation="eager").to(dtype)
    if dtype == torch.float64:
        hf = json.loads((path / "config.json").read_text())
        cfg = FAMILIES[hf["model_type"]].config_from_hf(hf)
        inv_freq, factor = rope_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, dtype=torch.float64)
        rotary = model.model.rotary_emb
        assert rotary.attention_scaling == factor
        rotary.inv_freq = inv_freq
    return model


def padded_batch(vocab: int, seed: int) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """``(prompts, idx [B, S] left-padded, mask [B, S])`` of ``PROMPT_LENGTHS`` random prompts
    (pad id 0: any id, the mask says what is real)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    S = max(PROMPT_LENGTHS)
    idx = torch.tensor([[0] * (S - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in prompts])
    return prompts, idx, mask


def padded_logits(model: MoEGPT, idx_BS: torch.Tensor, pad_B: torch.Tensor) -> torch.Tensor:
    """moeflow's logits ``[B, S, V]`` of every column of a left-padded batch: the cached prefill
    (``MoEGPT.forward_cached``'s path: pad columns neither keys nor tokens of the FFN, each
    row's positions from its first real token), with the head applied to every column."""
    cache = model.new_cache(pad_B, idx_BS.shape[1])
    step = step_inputs(cache, idx_BS.shape[1])
    x_BSD = model.embed(idx_BS)
    for i, block in enumerate(model.layers):
        x_BSD = block(x_BSD, step, i)
    return model.lm_head(model.norm(x_BSD))


@torch.no_grad()
def check_logits(path: Path, dtype: torch.dtype, seed: int) -> None:
    ours = gpt_from_hf(path, dtype=dtype).eval()
    theirs = load_hf(path, dtype).eval()
    cfg = ours.config
    if dtype == torch.float32:  # transformers' own rotary tables equal moeflow's in fp32
        inv_freq, factor = rope_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, dtype=torch.float32)
        assert torch.equal(theirs.model.rotary_emb.inv_freq, inv_freq)
        assert theirs.model.rotary_emb.attention_scaling == factor
    _, idx, mask = padded_batch(cfg.vocab_size, seed)
    pad_B = (mask == 0).sum(1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what transformers' generate passes
    with KeepFp64():
        ref = theirs(input_ids=idx, attention_mask=mask, position_ids=positions).logits
    got = padded_logits(ours, idx, pad_B)
    real = mask.bool()
    assert rel_err(got[real], ref[real]) <= TOL[dtype], rel_err(got[real], ref[real])
    # the path generation takes agrees: the last column, and the unpadded row alone
    torch.testing.assert_close(ours.forward_cached(idx, ours.new_cache(pad_B, idx.shape[1])), got[:, -1],
                               rtol=TOL[dtype], atol=TOL[dtype])
    full = int(pad_B.argmin())
    assert rel_err(ours(idx[full:full + 1])[0], got[full]) <= TOL[dtype]


def check_gradients(path: Path, dtype: torch.dtype, seed: int) -> None:
    ours = gpt_from_hf(path, dtype=dtype).train()
    theirs = load_hf(path, dtype).train()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ours.config.vocab_size, (3, 13), generator=gen)
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    loss = ours.loss(idx, targets)
    loss.backward()
    with KeepFp64():
        logits = theirs(input_ids=idx).logits
        ref = F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                              targets.flatten())
        ref.backward()
    assert rel_err(loss, ref) <= TOL[dtype]
    family = FAMILIES[theirs.config.model_type]
    hf_grads = {name: p.grad for name, p in theirs.named_parameters()}
    assert all(g is not None for g in hf_grads.values())
    mapped = state_dict_from_tensors(hf_grads, family, ours.config)  # (transformers' in-memory layout)
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        err = rel_err(p.grad, mapped[name])
        assert err <= TOL[dtype], (name, err)


@torch.no_grad()
def check_generate(path: Path, seed: int) -> None:
    ours = gpt_from_hf(path, dtype=torch.float32).eval()
    theirs = load_hf(path, torch.float32).eval()
    prompts, idx, mask = padded_batch(ours.config.vocab_size, seed)
    out = theirs.generate(input_ids=idx, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = out[:, idx.shape[1]:].tolist()
    assert generate(ours, prompts, NEW_TOKENS, temperature=0).tokens == ref
    # the compiled static step (one model compiled once for this family's asserts)
    assert generate(ours, prompts, NEW_TOKENS, temperature=0, compile=True).tokens == ref


def read_files(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def check_round_trip(path: Path, out: Path) -> None:
    ours = gpt_from_hf(path)
    source = json.loads((path / "config.json").read_text())
    model_type, family = source["model_type"], FAMILIES[source["model_type"]]
    state, cfg = ours.state_dict(), ours.config
    # the tensor map agrees with moe_blocks' FFN maps on every block (files in, files out)
    files = read_files(path)
    for i in range(cfg.n_layers):
        for name, t in ffn_from_hf(model_type, files, cfg, i).items():
            assert torch.equal(state[name], t), name
        for name, t in ffn_to_hf(model_type, state, cfg, i).items():
            assert torch.equal(files[name], t), name
    gpt_to_hf(ours, out / "moeflow", family=model_type, max_shard_size=SHARD)
    cls = getattr(transformers(), source["architectures"][0])  # the family's own class, e.g. Qwen3MoeForCausalLM
    theirs, info = cls.from_pretrained(out / "moeflow", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert theirs.config.model_type == family.model_type
    inner = {k: v for k, v in theirs.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    for name, t in state_dict_from_tensors(inner, family, cfg).items():
        assert torch.equal(t, state[name]), name
    theirs.save_pretrained(out / "transformers", max_shard_size=SHARD)
    for directory in ("moeflow", "transformers"):
        back = gpt_from_hf(out / directory)
        assert back.config == cfg, directory
        for name, t in back.state_dict().items():
            if not name.endswith("router.load_counts"):
                assert torch.equal(t, state[name]), (directory, name)


def check_cli_round_trip(path: Path, out: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``moeflow convert --from-hf`` (``import_hf``: the special tokens and kept files too) then
    ``--to-hf`` writes the family's directory back (the family kept in the checkpoint): the
    same config and tensors as the source."""
    from moeflow.cli.main import main

    assert main(["convert", "--from-hf", str(path), str(out / "ck")]) == 0
    assert main(["convert", str(out / "ck"), "--to-hf", str(out / "hf")]) == 0
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    assert f"({FAMILIES[model_type].name}," in capsys.readouterr().out
    assert json.loads((out / "hf" / "config.json").read_text())["model_type"] == model_type
    source, back = gpt_from_hf(path), gpt_from_hf(out / "hf")
    assert back.config == source.config
    for name, t in source.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def ep_step_case(rank: int, world: int, path: str) -> None:
    """On every rank: the model of ``path`` in fp64, one AdamW step on the whole batch (the
    reference) and one with the experts spread over the ranks, each rank on its share of the
    batch; the losses, every gradient and the parameters after the step agree."""
    import moeflow
    from moeflow.parallel import all_reduce_gradients, dense_parameters, expert_parallel

    model = gpt_from_hf(path, dtype=torch.float64).train()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, model.config.vocab_size, (2 * world, 11), generator=gen)
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    ref_loss = ref.loss(idx, targets)
    ref_loss.backward()
    ep = expert_parallel(model)
    rows = slice(2 * rank, 2 * rank + 2)
    loss = ep.loss(idx[rows], targets[rows]) / world  # (equal shares: the mean over the whole batch)
    loss.backward()
    all_reduce_gradients(dense_parameters(ep), None, average=False)
    e = model.config.num_experts // world
    ref_params = dict(ref.named_parameters())

    def expected(name: str, t: torch.Tensor) -> torch.Tensor:
        p = ep.get_parameter(name)
        return t[rank * e:(rank + 1) * e] if getattr(p, "moeflow_expert", False) else t

    for name, p in ep.named_parameters():
        torch.testing.assert_close(p.grad, expected(name, ref_params[name].grad), rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    for m in (ref, ep):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        opt.step()
    for name, p in ep.named_parameters():
        torch.testing.assert_close(p, expected(name, ref_params[name]), rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"{name} after the step: {m}")
    assert moeflow.moe_layers(ep), "no MoE layer: nothing was spread"
    assert torch.isfinite(ref_loss) and float(loss) > 0


DELETE = object()  # an edit's value that removes the field


def edited(base: dict, edit: dict) -> dict:
    """``base`` with ``edit`` applied (``DELETE`` removes a field)."""
    return {k: v for k, v in {**base, **edit}.items() if v is not DELETE}


def check_refusal(config_from_hf, base: dict, edit: dict, words: str) -> None:  # type: ignore[no-untyped-def]
    """``config_from_hf`` of ``edited(base, edit)`` raises a ``CheckpointError`` containing
    ``words``."""
    with pytest.raises(CheckpointError) as err:
        config_from_hf(edited(base, edit))
    assert words in str(err.value), str(err.value)

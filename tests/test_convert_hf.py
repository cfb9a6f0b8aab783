"""The conversion framework every family shares (``moeflow.convert``): the registry, config.json
read so that no field is ignored, RoPE parameters, sharded safetensors read lazily and written
with an index, and the tokenizer and generation files kept with a converted checkpoint and
written back. Mixtral is the registered family the tests go through."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from moeflow.checkpoint import CheckpointError, read_index
from moeflow.checkpoint.format import latest_checkpoint
from moeflow.cli.main import main
from moeflow.convert import hf_model
from moeflow.convert import tensor_map as tm
from moeflow.convert.family import IGNORED, Fields, rope_from_hf, rope_to_hf
from moeflow.convert.hf import FAMILIES, gpt_from_hf, gpt_to_hf
from moeflow.convert.hf_files import HFWeights, parse_size
from moeflow.convert.hf_tokenizer import tokenizer_output
from moeflow.convert.mixtral import gpt_config_from_hf, hf_config_from_gpt
from moeflow.models import MoEGPT
from moeflow.models.gpt_config import RopeScaling

MIXTRAL = {"model_type": "mixtral", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 24,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 64}


# ------------------------------------------------------------------ config.json


@pytest.mark.unit
def test_the_registry_refuses_an_unknown_family_naming_the_supported_ones(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"model_type 'llama' is not supported; moeflow converts 'deepseek_v3', "
                                              r"'gpt_oss', 'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe'"):
        gpt_from_hf(tmp_path)
    assert {"deepseek_v3", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss"} <= set(FAMILIES)
    assert all(fam.model_type == key for key, fam in FAMILIES.items()) and FAMILIES["mixtral"].name == "Mixtral"
    with pytest.raises(ValueError, match="family must be one of"):
        gpt_to_hf(MoEGPT(gpt_config_from_hf(MIXTRAL)), tmp_path / "out", family="llama")


@pytest.mark.unit
@pytest.mark.parametrize("edit,words", [
    ({"qk_layernorm": True}, "qk_layernorm=True"),  # a field Mixtral does not have: refused, not dropped
    ({"mlp_bias": False}, "mlp_bias=False"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "low_freq_factor": 1}}, "low_freq_factor"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"type": "linear", "factor": 2}}, "disagree"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"num_local_experts": "8"}, "num_local_experts='8'"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5"),
])
def test_config_fields_moeflow_cannot_express_are_refused_by_name_and_value(edit, words) -> None:
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(")):
        gpt_config_from_hf({**MIXTRAL, **edit})


@pytest.mark.unit
def test_the_ignored_fields_are_only_those_of_transformers_api() -> None:
    """Every documented field passes, whatever its value; a typo of a real field does not."""
    cfg = gpt_config_from_hf({**MIXTRAL, **{k: "anything" for k in IGNORED if k != "model_type"}})
    assert cfg == gpt_config_from_hf(MIXTRAL)
    with pytest.raises(CheckpointError, match="num_local_expert=4"):
        gpt_config_from_hf({**MIXTRAL, "num_local_expert": 4})
    fields = Fields({"a": 1, "b": {"c": 2}}, "Test")
    fields.get("a", "count")
    fields.section("b")  # read: its own keys are the section's business
    fields.done()


@pytest.mark.unit
def test_fields_take_each_kind_exactly_and_refuse_by_name_value_and_kind() -> None:
    """``Fields.get``: each kind takes exactly its values (a bool is no number, 0 no count, an
    infinite or negative number no number); a refusal names the field, its value and type, and
    the kind; absent and null give the default, or are refused (differently) without one;
    ``expect`` refuses any other value; ``section`` is ``Fields`` over the nested object, which
    refuses its own unread keys; ``done`` names every unread field with its value, up to 8."""
    takes = {"count": [1, 7], "index": [0, 3], "number": [0, 0.5, 3, 1e300], "bool": [True, False], "str": ["", "a"],
             "dict": [{}, {"a": 1}], "list": [[], [1]]}
    refuses = {"count": [0, -1, 1.0, True, "1"], "index": [-1, 1.5, False, "0"],
               "number": [-1e-9, float("inf"), float("nan"), True, "1"], "bool": [0, 1, "true"],
               "str": [1, ["a"]], "dict": [[], "a"], "list": [{}, "a"]}
    wants = {"count": "an int >= 1", "index": "an int >= 0", "number": "a finite number >= 0", "bool": "a bool",
             "str": "a string", "dict": "a JSON object", "list": "a JSON list"}
    for kind in takes:
        for value in takes[kind]:
            assert Fields({"f": value}, "Test").get("f", kind) == value, (kind, value)
        for value in refuses[kind]:
            with pytest.raises(CheckpointError, match=re.escape(
                    f"config.json: f={value!r} ({type(value).__name__}), expected {wants[kind]}")):
                Fields({"f": value}, "Test").get("f", kind)
    f = Fields({"n": None, "x": 2}, "Test", "config.json: outer")
    assert f.get("n", "count", 5) == 5 and f.get("absent", "count", None) is None
    with pytest.raises(CheckpointError, match=re.escape("config.json: outer: n=null, expected a value")):
        f.get("n", "count")
    with pytest.raises(CheckpointError, match=re.escape("config.json: outer: required field 'm' is missing")):
        f.get("m", "count")
    assert f.expect("x", "count", 2) == 2 and f.expect("y", "count", 4, 4) == 4
    with pytest.raises(CheckpointError, match=re.escape("config.json: outer: x=2 is not supported by moeflow's Test "
                                                        "conversion (it needs 3)")):
        f.expect("x", "count", 3)
    inner = Fields({"s": {"a": 1, "b": [2]}}, "Test").section("s")
    assert (inner.hf, inner.family, inner.where) == ({"a": 1, "b": [2]}, "Test", "config.json: s")
    assert Fields({}, "Test").section("s") is None and Fields({"s": None}, "Test").section("s") is None
    with pytest.raises(CheckpointError, match=re.escape("config.json: s: field(s) a=1, b=[2] not understood by "
                                                        "moeflow's Test conversion")):
        inner.done()
    inner.mark(["a"])
    assert inner.mark(["b"]) is inner.hf
    inner.done(ignored=())
    many = Fields({f"k{i}": i for i in range(10)}, "Test")
    with pytest.raises(CheckpointError, match=re.escape(f"field(s) {', '.join(f'k{i}={i}' for i in range(8))} not")):
        many.done()
    with pytest.raises(CheckpointError, match=re.escape("config.json: a JSON list, expected an object")):
        Fields([1], "Test")
    left = Fields({"model_type": "x", "k": 1}, "Test")
    left.done(ignored={"k", "model_type"})
    with pytest.raises(CheckpointError, match="model_type='x'"):
        left.done(ignored=())


@pytest.mark.unit
def test_mixtral_head_dim_and_sliding_window_map_onto_the_attention_config() -> None:
    cfg = gpt_config_from_hf({**MIXTRAL, "head_dim": 16, "sliding_window": 8, "rope_theta": 5e5})
    assert (cfg.attention.head_dim, cfg.attention.sliding_window, cfg.rope_theta) == (16, 8, 5e5)
    assert gpt_config_from_hf({**MIXTRAL, "head_dim": 8}).attention.head_dim is None  # hidden_size / heads
    back = hf_config_from_gpt(cfg)
    assert (back["head_dim"], back["sliding_window"], back["rope_parameters"]["rope_theta"]) == (16, 8, 5e5)
    assert gpt_config_from_hf({**MIXTRAL, **back}) == cfg


@pytest.mark.unit
@pytest.mark.parametrize("rope,theta,scaling", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 1e4, None),
    ({"rope_theta": 3e5}, 3e5, None),
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}, 1e4,
     RopeScaling(kind="linear", factor=4.0)),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, 1e4, RopeScaling(kind="linear", factor=2.0)),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0, "beta_fast": 32.0,  # gpt-oss
                          "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}},
     1.5e5, RopeScaling(kind="yarn", factor=32.0, original_max_seq_len=4096, truncate=False)),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40, "beta_fast": 32, "beta_slow": 1,  # V3
                          "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}},
     1e4, RopeScaling(kind="yarn", factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0)),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 16,  # factor from
                          "mscale": 0.707, "mscale_all_dim": 0}}, 1e4,  # the lengths; mscale alone is unused
     RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=16)),
])
def test_rope_parameters_map_both_ways(rope, theta, scaling) -> None:
    got = rope_from_hf(Fields({**MIXTRAL, **rope}, "Test"), 64, 1e6)
    assert got == (theta, scaling, 1.0)
    cfg = gpt_config_from_hf({**MIXTRAL, **rope})
    assert (cfg.rope_theta, cfg.rope_scaling) == (theta, scaling)
    assert rope_from_hf(Fields({"rope_parameters": rope_to_hf(cfg)}, "Test"), 64, 1e6) == (theta, scaling, 1.0)


@pytest.mark.unit
def test_partial_rotary_factor_is_read_where_transformers_puts_it(gen) -> None:
    """Top level or inside ``rope_parameters`` (which wins), returned as the rotary fraction,
    refused outside (0, 1] naming where it was found; written back when it is not 1."""
    frac = float(torch.rand((), generator=gen)) * 0.9 + 0.05
    for hf in [{"partial_rotary_factor": frac}, {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": frac}},
               {"partial_rotary_factor": 1.0, "rope_scaling": {"type": "default", "partial_rotary_factor": frac}},
               {"partial_rotary_factor": frac, "rope_parameters": {"rope_type": "default"}}]:  # kept when not given there
        fields = Fields(hf, "Test")
        assert rope_from_hf(fields, 64, 1e4) == (1e4, None, frac), hf
        fields.done()  # every field read
    assert rope_from_hf(Fields({"partial_rotary_factor": 1}, "Test"), 64, 1e4) == (1e4, None, 1.0)  # the whole head
    for hf, words in [({"partial_rotary_factor": 0}, "config.json: partial_rotary_factor=0 must be in (0, 1]"),
                      ({"rope_parameters": {"partial_rotary_factor": 1.5}},
                       "config.json: rope_parameters: partial_rotary_factor=1.5 must be in (0, 1]"),
                      ({"partial_rotary_factor": "0.5"}, "config.json: partial_rotary_factor='0.5' (str), expected a "
                                                         "finite number >= 0"),
                      ({"rope_parameters": {"partial_rotary_factor": "0.5"}},
                       "config.json: rope_parameters: partial_rotary_factor='0.5' (str), expected a finite number")]:
        with pytest.raises(CheckpointError, match=re.escape(words)):
            rope_from_hf(Fields(hf, "Test"), 64, 1e4)


@pytest.mark.unit
def test_rope_parameters_without_a_type_are_the_default_rope(gen) -> None:
    """Neither ``rope_type`` nor ``type``: transformers' default RoPE at the object's theta."""
    theta = float(torch.randint(1000, 10**6, (), generator=gen))
    for section in ("rope_parameters", "rope_scaling"):
        fields = Fields({section: {"rope_theta": theta}}, "Test")
        assert rope_from_hf(fields, 64, 1e4) == (theta, None, 1.0)
        fields.done()


@pytest.mark.unit
def test_every_yarn_field_is_read_and_each_absent_one_takes_transformers_default(gen) -> None:
    """YaRN with every field at a random value comes back as given (``rope_to_hf`` writes it
    back); with only a factor, ``original_max_position_embeddings`` is ``max_position_embeddings``,
    the betas 32 and 1, no mscale or attention factor, truncation on."""
    r = [float(x) for x in torch.rand(5, generator=gen)]
    given = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2 + 30 * r[0], "original_max_position_embeddings": 16,
             "beta_fast": 20 + 20 * r[1], "beta_slow": 0.5 + r[2], "mscale": 0.5 + r[3], "mscale_all_dim": 0.5 + r[4],
             "attention_factor": 0.5 + r[0], "truncate": False}
    fields = Fields({"rope_parameters": given}, "Test")
    want = RopeScaling(kind="yarn", factor=given["factor"], original_max_seq_len=16, beta_fast=given["beta_fast"],
                       beta_slow=given["beta_slow"], mscale=given["mscale"], mscale_all_dim=given["mscale_all_dim"],
                       attention_factor=given["attention_factor"], truncate=False)
    assert rope_from_hf(fields, 64, 1e6) == (1e4, want, 1.0)
    fields.done()
    alone = rope_from_hf(Fields({"rope_parameters": {"rope_type": "yarn", "factor": 3.0}}, "Test"), 64, 1e6)
    assert alone == (1e6, RopeScaling(kind="yarn", factor=3.0, original_max_seq_len=64, beta_fast=32.0, beta_slow=1.0,
                                      mscale=None, mscale_all_dim=None, attention_factor=None, truncate=True), 1.0)


@pytest.mark.unit
def test_a_default_rope_takes_both_type_names_and_refuses_a_scaling_field() -> None:
    """transformers writes ``rope_type`` and ``type`` side by side: both are read; a default
    RoPE's object with a scaling field (``factor``) is refused, not read as scaling."""
    fields = Fields({"rope_parameters": {"rope_type": "default", "type": "default", "rope_theta": 5e4}}, "Test")
    assert rope_from_hf(fields, 64, 1e4) == (5e4, None, 1.0)
    fields.done()
    with pytest.raises(CheckpointError, match=re.escape("config.json: rope_parameters: field(s) factor=2.0 not understood")):
        rope_from_hf(Fields({"rope_parameters": {"rope_type": "default", "factor": 2.0}}, "Test"), 64, 1e4)


@pytest.mark.unit
@pytest.mark.parametrize("field", ["original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                                   "mscale_all_dim", "attention_factor", "truncate"])
def test_a_linear_rope_takes_its_own_fields_and_refuses_yarns(gen, field) -> None:
    """A linear RoPE reads ``factor`` (with the fields every RoPE has: both type names,
    ``rope_theta``, ``partial_rotary_factor``); a YaRN field in its object (a YaRN config retyped
    by hand, whose scaling would silently change) is refused naming the field and its value, as
    any field nothing reads is. transformers 5 knows only those four in a linear RoPE too (it
    warns about the rest) and writes ``original_max_position_embeddings`` only for YaRN, llama3
    and longrope."""
    factor, theta, part = 1 + 7 * float(torch.rand(1, generator=gen)), float(torch.randint(1, 10**6, (1,), generator=gen)), 0.5
    own = {"rope_type": "linear", "type": "linear", "factor": factor, "rope_theta": theta, "partial_rotary_factor": part}
    fields = Fields({"rope_parameters": dict(own)}, "Test")
    assert rope_from_hf(fields, 64, 1e4) == (theta, RopeScaling(kind="linear", factor=factor), part)
    fields.done()
    value = {"truncate": False, "original_max_position_embeddings": 16}.get(field, 2.0)
    with pytest.raises(CheckpointError, match=re.escape(f"config.json: rope_parameters: field(s) {field}={value!r} not understood")):
        rope_from_hf(Fields({"rope_parameters": {**own, field: value}}, "Test"), 64, 1e4)
    # the same field in a YaRN RoPE is read
    yarn = {**own, "rope_type": "yarn", "type": "yarn", field: value}
    fields = Fields({"rope_parameters": yarn}, "Test")
    rope_from_hf(fields, 64, 1e4)
    fields.done()


@pytest.mark.unit
def test_a_rope_error_names_the_object_once_and_is_a_checkpoint_error() -> None:
    """A field of the wrong type is refused as ``Fields`` words it; a value ``RopeScaling``
    refuses (a factor of 0) becomes a ``CheckpointError`` naming the object, once; a scaled
    RoPE too takes ``rope_type`` and ``type`` side by side."""
    with pytest.raises(CheckpointError) as err:
        rope_from_hf(Fields({"rope_parameters": {"rope_type": "linear", "factor": "2"}}, "Test"), 64, 1e4)
    assert str(err.value) == "config.json: rope_parameters: factor='2' (str), expected a finite number >= 0"
    with pytest.raises(CheckpointError) as err:
        rope_from_hf(Fields({"rope_parameters": {"rope_type": "linear", "factor": 0}}, "Test"), 64, 1e4)
    assert str(err.value).startswith("config.json: rope_parameters: factor") and str(err.value).count("config.json") == 1
    fields = Fields({"rope_parameters": {"rope_type": "linear", "type": "linear", "factor": 2.0}}, "Test")
    assert rope_from_hf(fields, 64, 1e4) == (1e4, RopeScaling(kind="linear", factor=2.0), 1.0)
    fields.done()


@pytest.mark.unit
def test_rope_to_hf_writes_every_field_rope_from_hf_reads(gen) -> None:
    """A partial rotation and YaRN with every field set (random values) written and read back
    to the same config, each field under transformers' name; unset optional fields omitted."""
    from moeflow.models.gpt_config import AttentionConfig, GPTConfig

    r = [float(x) for x in torch.rand(6, generator=gen)]
    yarn = RopeScaling(kind="yarn", factor=2 + 30 * r[0], original_max_seq_len=16, beta_fast=20 + 20 * r[1],
                       beta_slow=0.5 + r[2], mscale=0.5 + r[3], mscale_all_dim=0.5 + r[4], attention_factor=0.5 + r[5],
                       truncate=False)
    cfg = GPTConfig(vocab_size=8, dim=16, n_layers=1, n_heads=2, max_seq_len=64, rope_theta=2e4, rope_scaling=yarn,
                    attention=AttentionConfig(rotary_fraction=0.5))
    out = rope_to_hf(cfg)
    assert out == {"rope_theta": 2e4, "rope_type": "yarn", "partial_rotary_factor": 0.5, "factor": yarn.factor,
                   "original_max_position_embeddings": 16, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
                   "truncate": False, "mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim,
                   "attention_factor": yarn.attention_factor}
    assert rope_from_hf(Fields({"rope_parameters": out}, "Test"), 64, 1e4) == (2e4, yarn, 0.5)
    plain = GPTConfig(vocab_size=8, dim=16, n_layers=1, n_heads=2, max_seq_len=64,
                      rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=16))
    assert rope_to_hf(plain) == {"rope_theta": plain.rope_theta, "rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": True}


# ------------------------------------------------------------------ weights


def _tiny(tmp_path: Path, gen: torch.Generator, **kw: object) -> tuple[MoEGPT, Path]:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = MoEGPT(gpt_config_from_hf({**MIXTRAL, **kw}))
    return model, gpt_to_hf(model, tmp_path / "hf")


# ------------------------------------------------------------------ tensor maps


def _int_tensor(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Distinct values in a random order: an element moved anywhere shows."""
    return torch.randperm(math.prod(shape), generator=gen).double().reshape(shape)


@pytest.mark.unit
def test_each_layout_puts_every_element_where_its_format_does_and_back(gen) -> None:
    """Each layout of ``moeflow.convert.tensor_map`` on a tensor of distinct values, element by
    element against the format's definition (module docstring: ``w_in [E, D, 2H]`` gate columns
    then up), both ways: ``load(save(t)) == t``, ``save(load(hf)) == hf``, every tensor
    contiguous, and ``hf_shapes`` the shapes ``save`` gives."""
    E, D, H = (int(n) for n in torch.randint(2, 6, (3,), generator=gen))

    def both_ways(layout, ours: torch.Tensor, hf: list[torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
        assert torch.equal(layout.load(hf), ours) and layout.load(hf).is_contiguous()
        saved = layout.save(ours)
        assert len(saved) == len(hf) == len(layout.hf)
        assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(saved, hf))
        assert tm.hf_shapes(layout, ours.shape) == {n: tuple(t.shape) for n, t in zip(layout.hf, hf)}

    # per-expert linear weights [H, D] (gate, up), and [D, H] (down)
    gate, up, down = _int_tensor(gen, E, H, D), _int_tensor(gen, E, H, D) + 10**6, _int_tensor(gen, E, D, H)
    w_in = torch.empty(E, D, 2 * H, dtype=torch.float64)
    for e in range(E):
        for d in range(D):
            for h in range(H):
                w_in[e, d, h], w_in[e, d, H + h] = gate[e, h, d], up[e, h, d]
    layout = tm.linear_experts(["x.{e}.gate", "x.{e}.up"], E)
    assert layout.hf == tuple(n for e in range(E) for n in (f"x.{e}.gate", f"x.{e}.up"))
    both_ways(layout, w_in, [t for e in range(E) for t in (gate[e], up[e])])
    layout = tm.linear_experts(["x.{e}.down"], E)
    assert layout.hf == tuple(f"x.{e}.down" for e in range(E))
    both_ways(layout, down.transpose(1, 2), list(down))
    # fused: [E, 2H, D] (transformers' in memory), gpt-oss's interleaved [E, D, 2H] and its bias [E, 2H]
    both_ways(tm.fused_experts("x", transposed=True), w_in, [w_in.transpose(1, 2)])
    both_ways(tm.fused_experts("x", transposed=False), w_in, [w_in])
    mixed = torch.empty_like(w_in)
    mixed[..., 0::2], mixed[..., 1::2] = w_in[..., :H], w_in[..., H:]
    both_ways(tm.fused_experts("x", transposed=False, interleaved=True), w_in, [mixed])
    both_ways(tm.fused_experts("x", transposed=True, interleaved=True), w_in, [mixed.transpose(1, 2)])
    b_in = _int_tensor(gen, E, 2 * H)
    both_ways(tm.fused_experts("b", transposed=False, interleaved=True), b_in,
              [torch.stack((b_in[:, :H], b_in[:, H:]), dim=-1).flatten(1)])
    # a dense FFN: gate and up rows stacked
    g, u = _int_tensor(gen, H, D), _int_tensor(gen, H, D) + 10**6
    both_ways(tm.stacked_rows("g", "u"), torch.cat((g, u)), [g, u])
    assert tm.stacked_rows("g", "u").hf == ("g", "u")
    both_ways(tm.rename("r"), g, [g])
    ffn = tm.dense_ffn("layers.1.ffn", "model.layers.1.mlp")
    assert [(e.ours, [lay.hf for lay in e.layouts], e.tied_to) for e in ffn] == [
        ("layers.1.ffn.proj_in.weight", [("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")],
         None),
        ("layers.1.ffn.proj_out.weight", [("model.layers.1.mlp.down_proj.weight",)], None)]
    both_ways(ffn[0].layouts[0], torch.cat((g, u)), [g, u])
    entry = tm.same("lm_head.weight", "lm_head.weight", "output.weight", tied_to="embed.weight")
    assert (entry.ours, [lay.hf for lay in entry.layouts], entry.tied_to) == \
        ("lm_head.weight", [("lm_head.weight",), ("output.weight",)], "embed.weight")
    assert tm.same("a", "b").tied_to is None
    with pytest.raises(ValueError, match="Entry 'a' needs at least one layout"):
        tm.Entry("a", ())
    # shapes are found without memory: a 2**46-element expert stack (256 TB in float32) costs nothing
    huge = (64, 2**20, 2**20)
    assert tm.hf_shapes(tm.fused_experts("x", transposed=True), huge) == {"x": (64, 2**20, 2**20)}
    with pytest.raises(ValueError):  # a layout naming more tensors than it saves is a broken map, not cut short
        tm.hf_shapes(tm.Layout(("a", "b"), lambda ts: ts[0], lambda t: (t,)), (2, 3))


@pytest.mark.reference
def test_everything_is_checked_before_a_tensor_is_read(tmp_path, gen, monkeypatch) -> None:
    from safetensors.torch import load_file, save_file

    model, path = _tiny(tmp_path, gen)
    reads: list[str] = []
    real = HFWeights.read
    monkeypatch.setattr(HFWeights, "read", lambda self, name: (reads.append(name), real(self, name))[1])
    back = gpt_from_hf(path)
    stored = load_file(str(path / "model.safetensors"))
    assert sorted(reads) == sorted(stored)  # each once
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    for name, value, words in [("model.layers.0.mlp.extra.weight", torch.ones(2), "does not know"),
                               ("model.norm.weight", torch.ones(31), "config.json gives")]:
        save_file({**stored, name: value}, str(path / "model.safetensors"))
        reads.clear()
        with pytest.raises(CheckpointError, match=words):
            gpt_from_hf(path)
        assert reads == []
    del stored["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(stored, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"no tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight'"):
        gpt_from_hf(path)


@pytest.mark.reference
def test_a_tied_output_projection_held_anyway_must_equal_the_embedding(tmp_path, gen) -> None:
    from safetensors.torch import load_file, save_file

    model, path = _tiny(tmp_path, gen, tie_word_embeddings=True)
    stored = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in stored
    save_file({**stored, "lm_head.weight": stored["model.embed_tokens.weight"].clone()}, str(path / "model.safetensors"))
    back = gpt_from_hf(path)
    assert back.lm_head.weight is back.embed.weight
    save_file({**stored, "lm_head.weight": torch.randn(40, 32, generator=gen)}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="differ from embed.weight"):
        gpt_from_hf(path)


@pytest.mark.reference
def test_sharded_writing_keeps_groups_whole_and_leaves_no_stale_file(tmp_path, gen) -> None:
    model, _ = _tiny(tmp_path, gen)
    out = gpt_to_hf(model, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    experts = {v for k, v in index["weight_map"].items() if "layers.1.block_sparse_moe.experts" in k and ".w1." in k}
    assert len(experts) == 1  # one layer's expert stack is one group, in one file
    sizes = sum(t.numel() * t.element_size() for t in hf_model.state_dict_to_tensors(
        model.state_dict(), FAMILIES["mixtral"], model.config).values())
    assert index["metadata"]["total_size"] == sizes
    back = gpt_from_hf(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    gpt_to_hf(model, out)  # one file now: the shards and their index go
    assert sorted(p.name for p in out.iterdir() if "safetensors" in p.name) == ["model.safetensors"]


@pytest.mark.unit
def test_a_damaged_shard_index_is_refused_naming_the_index_and_what_it_holds(tmp_path) -> None:
    """The index must be an object whose ``weight_map`` is a non-empty object of file names
    inside the directory; the message names the index and shows what it held (``none`` when
    there was no ``weight_map``; its value cut to 60 characters otherwise)."""
    index = tmp_path / "model.safetensors.index.json"
    where = f"{index}: weight_map"
    long = [f"model-{i:05d}-of-00009.safetensors" for i in range(9)]
    for value, words in [
        ([1, 2], f"{where} is none, expected {{tensor name: safetensors file}} (a JSON object)"),
        ({}, f"{where} is none, expected"),
        ({"metadata": {}}, f"{where} is none, expected"),
        ({"weight_map": {}}, f"{where} is {{}}, expected"),
        ({"weight_map": None}, f"{where} is None, expected"),
        ({"weight_map": ["a.safetensors"]}, f"{where} is ['a.safetensors'], expected"),
        ({"weight_map": long}, f"{where} is {repr(long)[:60]}, expected"),
        ({"weight_map": {"a": 5}}, f"{where}['a']=5 is not a file name"),
        ({"weight_map": {"a": "../a.safetensors"}}, f"{where}: '../a.safetensors' leaves the directory {tmp_path}"),
    ]:
        index.write_text(json.dumps(value))
        with pytest.raises(CheckpointError, match=re.escape(words)):
            HFWeights(tmp_path)
    index.unlink()  # one weights file, a link leading out: the message names the directory, there is no index
    (tmp_path / "model.safetensors").symlink_to(tmp_path.parent / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{tmp_path}: 'model.safetensors' is or passes a "
                                                              "symbolic link that leads outside")):
        HFWeights(tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize("value,size", [(1000, 1000), ("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2**31),
                                        ("20kb", 20000), ("7", 7)])
def test_shard_sizes_read_as_transformers_writes_them(value, size) -> None:
    assert parse_size(value) == size


@pytest.mark.unit
def test_every_size_unit_reads_in_any_case_and_one_byte_is_the_least(gen) -> None:
    n = int(torch.randint(1, 1000, (), generator=gen))
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    for unit, factor in units.items():
        for text in (f"{n}{unit}", f" {n} {unit.lower()} ", f"{n}{unit.upper()}"):
            assert parse_size(text) == n * factor, text
    assert parse_size(1) == parse_size("1") == parse_size("1B") == 1
    for bad in ("5XB", 0):  # the option is named by default
        with pytest.raises(ValueError, match=r"^max_shard_size must be"):
            parse_size(bad)


@pytest.mark.reference
def test_a_shard_holds_exactly_max_shard_size_bytes(tmp_path, gen) -> None:
    """Groups that fill ``max_shard_size`` exactly stay in one file; a byte less splits them."""
    model, _ = _tiny(tmp_path, gen)
    total = sum(t.numel() * t.element_size() for t in hf_model.state_dict_to_tensors(
        model.state_dict(), FAMILIES["mixtral"], model.config).values())
    one = gpt_to_hf(model, tmp_path / "one", max_shard_size=total)
    assert sorted(p.name for p in one.glob("*.safetensors")) == ["model.safetensors"]
    two = gpt_to_hf(model, tmp_path / "two", max_shard_size=total - 1)
    assert sorted(p.name for p in two.glob("*.safetensors")) == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]


@pytest.mark.reference
def test_a_tensor_of_a_dtype_torch_has_no_name_for_here_is_refused_by_its_safetensors_name(tmp_path, gen) -> None:
    from safetensors.torch import load_file, save_file

    _, path = _tiny(tmp_path, gen)
    stored = load_file(str(path / "model.safetensors"))
    stored["model.norm.weight"] = stored["model.norm.weight"].to(torch.uint16)
    save_file(stored, str(path / "model.safetensors"))
    with HFWeights(path) as weights:
        assert weights.dtype("model.norm.weight") == "U16" and weights.dtype("model.embed_tokens.weight") == torch.float32
    with pytest.raises(CheckpointError, match=re.escape("tensor 'model.norm.weight' (for norm.weight) is U16, expected a "
                                                        "floating-point dtype")):
        gpt_from_hf(path)


@pytest.mark.unit
@pytest.mark.parametrize("value", ["", "5XB", "-3", "1.5GB", 0, True, None])
def test_a_bad_shard_size_is_refused_naming_the_option(value) -> None:
    with pytest.raises(ValueError, match="--max-shard-size"):
        parse_size(value, "--max-shard-size")


@pytest.mark.unit
def test_only_the_known_tokenizer_files_are_written_back() -> None:
    with pytest.raises(CheckpointError, match="'../config.json'"):
        tokenizer_output(None, {"../config.json": "{}"}, {}, 40, 64)
    out = tokenizer_output(None, {"special_tokens_map.json": "{}"}, {"eos_token_id": 3}, 40, 64)
    assert out == {"generation_config.json": json.dumps({"eos_token_id": 3}, indent=2), "special_tokens_map.json": "{}"}


# ------------------------------------------------------------------ through transformers and the CLI


def _tokenizer_files(path: Path) -> dict[str, str]:
    """A small HF tokenizer with a chat end token, as a published chat model ships it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3, **{c: i + 4 for i, c in enumerate("abcdefgh ")}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "</s>", "<|im_end|>"])
    template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    files = {"tokenizer.json": tok.to_str(pretty=True),
             "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                                  "eos_token": "<|im_end|>", "unk_token": "<unk>",
                                                  "chat_template": template}, indent=1),
             "special_tokens_map.json": json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>"}),
             "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": [3, 2], "do_sample": True,
                                                   "temperature": 0.6}),
             "chat_template.jinja": template}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


@pytest.mark.integration
def test_a_sharded_transformers_checkpoint_round_trips_with_its_tokenizer(tmp_path, gen, capsys) -> None:
    """save_pretrained (sharded, small shards) -> convert --from-hf -> the checkpoint generates
    with the model's own tokenizer and eos -> convert --to-hf (sharded) -> transformers loads the
    same tensors, and every tokenizer and generation file comes back unchanged."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(**{k: v for k, v in MIXTRAL.items() if k != "model_type"}, bos_token_id=1,
                                     eos_token_id=2)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    files = _tokenizer_files(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0
    assert "tokenizer" in capsys.readouterr().out
    extra = read_index(latest_checkpoint(tmp_path / "ck"))["extra"]
    assert extra["tokenizer"] == {"kind": "hf", "json": files["tokenizer.json"], "eod": 3}
    assert extra["special_tokens"] == {"bos_token_id": 1, "eos_token_id": [3, 2], "pad_token_id": None}
    assert extra["hf"] == {"model_type": "mixtral", "files": {k: v for k, v in files.items() if k != "tokenizer.json"}}

    from moeflow.train import build_from_checkpoint

    model, tok, _ = build_from_checkpoint(tmp_path / "ck")
    assert tok.encode("bad") == [5, 4, 7] and tok.eod == 3 and tok.decode([5, 4, 7]) == "bad"
    assert main(["generate", str(tmp_path / "ck"), "--prompt", "bad", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("bad")

    assert main(["convert", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "back"), "--max-shard-size", "30KB"]) == 0
    out = tmp_path / "back"
    assert len(list(out.glob("model-*.safetensors"))) > 1
    for name, text in files.items():
        assert (out / name).read_text() == text, name
    back = transformers.MixtralForCausalLM.from_pretrained(out)
    a, b = hf.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto.eos_token == "<|im_end|>" and auto("bad")["input_ids"] == [5, 4, 7]
    assert auto.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "ab<|im_end|>"


@pytest.mark.e2e
@pytest.mark.parametrize("argv,words", [
    (["convert", "{ck}", "--info", "--max-shard-size", "5GB"], "--max-shard-size 5GB goes with --to-hf"),
    (["convert", "--from-hf", "{hf}", "{new}", "--family", "mixtral"], "--family mixtral goes with --to-hf"),
    (["convert", "{ck}", "--to-hf", "{new}", "--max-shard-size", "lots"], "--max-shard-size must be"),
    (["convert", "{ck}", "--to-hf", "{new}", "--family", "llama"], "--family llama: moeflow converts deepseek_v3, "),
])
def test_convert_flags_refuse_clearly(tmp_path, gen, capsys, argv, words) -> None:
    _, hf = _tiny(tmp_path, gen)
    assert main(["convert", "--from-hf", str(hf), str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    paths = {"ck": str(tmp_path / "ck"), "hf": str(hf), "new": str(tmp_path / "new")}
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeflow convert: error:") and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()


@pytest.mark.e2e
def test_train_init_from_a_converted_model_trains_with_its_own_tokenizer(tmp_path, gen, capsys) -> None:
    """The converted checkpoint's tokenizer (not bytes) is the fine-tuning run's."""
    _, hf = _tiny(tmp_path, gen)
    files = _tokenizer_files(hf)
    assert main(["convert", "--from-hf", str(hf), str(tmp_path / "ck")]) == 0
    assert main(["train", "--device", "cpu", "--init-from", str(tmp_path / "ck"), "--out", str(tmp_path / "ft"),
                 "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--no-plot",
                 "--sample-tokens", "0"]) == 0
    capsys.readouterr()
    saved = read_index(json.loads((tmp_path / "ft" / "history.json").read_text())["checkpoint"])["extra"]["tokenizer"]
    from tokenizers import Tokenizer

    assert saved["kind"] == "hf" and saved["eod"] == 3
    assert Tokenizer.from_str(saved["json"]).get_vocab() == Tokenizer.from_str(files["tokenizer.json"]).get_vocab()

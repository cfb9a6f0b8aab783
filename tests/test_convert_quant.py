"""Quantised weights dequantised at load (``moeflow.convert.quant``): DeepSeek-V3's block-wise
FP8 and gpt-oss's MXFP4. Random tensors are rounded to each format by a quantiser written here,
from the formats' definitions; the dequantisation must give the rounded values to the bit, equal
transformers' own, and the converter must load a checkpoint made here to those values."""

from __future__ import annotations

import json
import re
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeflow.checkpoint import CheckpointError
from moeflow.convert import mixtral
from moeflow.convert.family import Family
from moeflow.convert.hf import gpt_from_hf
from moeflow.convert.hf_model import load_hf, save_hf, state_dict_from_tensors
from moeflow.convert.quant import MXFP4, BlockFP8, fp8_block_dequantize, mxfp4_dequantize, quantization_from_config
from moeflow.convert.tensor_map import Entry, fused_experts
from moeflow.models import MoEGPT, gpt_config

FP8_MAX = 448.0  # the largest float8_e4m3fn
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes by code; bit 3 is the sign


# ------------------------------------------------------------------ the test-side quantisers


def quantise_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fp8 weight, scale_inv per block, the values they stand for)``: each block scaled so its
    largest magnitude is FP8_MAX, rounded to float8_e4m3fn; the values as exact float64 products
    rounded once to float32."""
    O, I = w.shape
    scale = torch.empty(math.ceil(O / block[0]), math.ceil(I / block[1]))
    q = torch.empty(O, I, dtype=torch.float8_e4m3fn)
    ref = torch.empty(O, I)
    for a in range(scale.shape[0]):
        for b in range(scale.shape[1]):
            rows, cols = slice(a * block[0], (a + 1) * block[0]), slice(b * block[1], (b + 1) * block[1])
            scale[a, b] = w[rows, cols].abs().max() / FP8_MAX
            q[rows, cols] = (w[rows, cols] / scale[a, b]).to(torch.float8_e4m3fn)
            ref[rows, cols] = (q[rows, cols].double() * scale[a, b].double()).float()
    return q, scale, ref


def quantise_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blocks [..., G, 16], scales [..., G], the values [..., G*32])`` of ``x [..., G*32]``:
    per block of 32 the power of two that brings the largest magnitude to at most 6, each value
    rounded to the nearest e2m1 magnitude with its sign, packed two codes a byte (even element in
    the low nibble), the values decoded in float64."""
    xb = x.double().unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(xb.abs().amax(-1) / 6.0)).clamp(-100, 100)
    y = xb / torch.exp2(exp).unsqueeze(-1)
    mags = torch.tensor(E2M1, dtype=torch.float64)
    code = (y.abs().unsqueeze(-1) - mags).abs().argmin(-1) + 8 * (y < 0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    signed = torch.cat([mags, -mags])
    values = (signed[code] * torch.exp2(exp).unsqueeze(-1)).flatten(-2)
    return blocks, (exp + 127).to(torch.uint8), values


# ------------------------------------------------------------------ the formats


@pytest.mark.reference
@pytest.mark.parametrize("shape,block", [((40, 56), (16, 16)), ((200, 300), (128, 128)), ((33, 17), (8, 32))])
def test_fp8_block_dequantisation_is_the_rounded_value_to_the_bit(gen, shape, block) -> None:
    """Edges not divisible by the block are short blocks with their own scale."""
    w = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).add(0.1)
    q, scale, ref = quantise_fp8(w, block)
    got = fp8_block_dequantize(q, scale, block)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    assert torch.equal(BlockFP8(block).dequantize((q, scale)), ref)
    assert (got - w).abs().max() <= w.abs().max() / 8  # the rounding of e4m3: the values are w's


@pytest.mark.reference
def test_mxfp4_every_code_and_nibble_decodes_as_the_format_says(gen) -> None:
    """Random bytes and scales, decoded element by element in Python."""
    blocks = torch.randint(0, 256, (3, 5, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 5, 2), generator=gen, dtype=torch.uint8)
    got = mxfp4_dequantize(blocks, scales)
    assert got.shape == (3, 5, 64) and got.dtype == torch.float32
    signed = [*E2M1, *(-m for m in E2M1)]
    for idx in [(0, 0), (1, 3), (2, 4)]:
        for g in range(2):
            for j in range(16):
                byte, s = int(blocks[idx][g, j]), int(scales[idx][g])
                for k, code in ((2 * j, byte & 15), (2 * j + 1, byte >> 4)):
                    want = signed[code] * 2.0 ** (s - 127)
                    assert got[idx][g * 32 + k].item() == want and math.copysign(1, got[idx][g * 32 + k]) == \
                        math.copysign(1, want)


@pytest.mark.reference
def test_mxfp4_dequantisation_is_the_rounded_value_to_the_bit(gen) -> None:
    x = torch.randn(2, 6, 96, generator=gen) * torch.exp2(torch.randint(-6, 6, (2, 6, 96), generator=gen).float())
    blocks, scales, values = quantise_mxfp4(x)
    assert torch.equal(mxfp4_dequantize(blocks, scales), values.float())
    # the checkpoint's layout: blocks run along the input dimension, the tensor is [E, I, O]
    assert torch.equal(MXFP4().dequantize((blocks, scales)), values.float().transpose(1, 2))
    bad = scales.clone()
    bad[0, 0, 0] = 255
    with pytest.raises(CheckpointError, match="255"):
        MXFP4().dequantize((blocks, bad))


@pytest.mark.reference
@pytest.mark.parametrize("lead", [(), (3,), (2, 3), (2, 1, 3)])
def test_mxfp4_decodes_any_leading_shape_to_float32_where_the_blocks_are(gen, lead) -> None:
    """``[..., G, 16]`` with any leading dimensions (none too) gives ``[..., G*32]`` float32 values
    on the blocks' device, whatever the default dtype (float64 here) and device (``meta`` here:
    a tensor made without naming its device would land there)."""
    G = int(torch.randint(1, 4, (), generator=gen))
    x = torch.randn(*lead, G * 32, generator=gen) * 4
    blocks, scales, values = quantise_mxfp4(x)
    fp8_w, fp8_s, fp8_ref = quantise_fp8(torch.randn(20, 12, generator=gen), (8, 8))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            got = mxfp4_dequantize(blocks, scales)
            got_fp8 = fp8_block_dequantize(fp8_w, fp8_s, (8, 8))
    finally:
        torch.set_default_dtype(default)
    assert got.shape == (*lead, G * 32) and got.dtype == torch.float32 and got.device.type == "cpu"
    assert torch.equal(got, values.float())
    assert got_fp8.dtype == torch.float32 and got_fp8.device.type == "cpu" and torch.equal(got_fp8, fp8_ref)


@pytest.mark.integration
def test_dequantisation_equals_transformers(gen) -> None:
    pytest.importorskip("transformers")
    from transformers.integrations import finegrained_fp8, mxfp4

    x = torch.randn(3, 10, 64, generator=gen)
    blocks, scales, _ = quantise_mxfp4(x)
    ref = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(MXFP4().dequantize((blocks, scales)), ref)
    w = torch.randn(70, 45, generator=gen)
    q, scale, _ = quantise_fp8(w, (32, 16))
    ref = finegrained_fp8._dequantize_fp8_weight(q, scale, [32, 16], torch.float32)
    assert torch.equal(fp8_block_dequantize(q, scale, (32, 16)), ref)


@pytest.mark.unit
@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "awq"}, "quant_method='awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ("fp8", "not a JSON object"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "group_size": 64}, "group_size"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
])
def test_unsupported_quantisation_is_refused_by_name(qc, words) -> None:
    with pytest.raises(CheckpointError, match=words.replace("[", r"\[")):
        quantization_from_config(qc)


@pytest.mark.unit
def test_every_field_a_format_takes_is_read_and_any_other_value_refused(gen) -> None:
    """Each field of the fp8 and mxfp4 configs, at its supported value or null, is read (not
    refused as unknown); the block size is the config's (128 x 128 when absent, refused when
    null: moeflow reads block-wise scales only); any other
    value of a checked field, a field of the other format, a block size that is not two ints
    >= 1 and a skip list of anything but names are refused by name."""
    b = [int(n) for n in torch.randint(1, 300, (2,), generator=gen)]
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": b, "activation_scheme": "dynamic",
           "scale_fmt": "float", "dequantize": False, "modules_to_not_convert": ["lm_head"], "expert_dtype": "fp8"}
    assert quantization_from_config(fp8).block == tuple(b) and quantization_from_config(fp8).method == "fp8"
    nulls = dict.fromkeys(fp8, None) | {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert quantization_from_config(nulls).block == (128, 128)
    assert quantization_from_config({"quant_method": "fp8"}).block == (128, 128)
    assert quantization_from_config({**fp8, "weight_block_size": [1, b[1]]}).block == (1, b[1])  # the smallest
    oss = {"quant_method": "mxfp4", "modules_to_not_convert": None, "dequantize": True}
    assert isinstance(quantization_from_config(oss), MXFP4) and quantization_from_config(oss).method == "mxfp4"
    assert isinstance(quantization_from_config({"quant_method": "mxfp4", "modules_to_not_convert": []}), MXFP4)
    where = "config.json: quantization_config"
    for qc, words in [
        ({**fp8, "expert_dtype": "bf16"}, f"{where}.expert_dtype='bf16' is not supported (moeflow reads 'fp8')"),
        ({**fp8, "fmt": "E4M3"}, f"{where}.fmt='E4M3' is not supported (moeflow reads 'e4m3')"),
        ({**fp8, "scale_fmt": "float32"}, f"{where}.scale_fmt='float32' is not supported (moeflow reads 'float')"),
        ({**fp8, "activation_scheme": "Dynamic"}, f"{where}.activation_scheme='Dynamic' is not supported"),
        ({**oss, "fmt": "e4m3"}, f"{where}: field(s) ['fmt'] not understood for quant_method 'mxfp4'"),
        ({**oss, "weight_block_size": b, "expert_dtype": "fp8"},
         f"{where}: field(s) ['expert_dtype', 'weight_block_size'] not understood for quant_method 'mxfp4'"),
        ({"quant_method": None}, f"{where}.quant_method=None is not supported; moeflow dequantises ['fp8', 'mxfp4']"),
        ({}, f"{where}.quant_method=None is not supported"),
        ({**fp8, "weight_block_size": [128, True]}, f"{where}.weight_block_size=[128, True] is not two ints >= 1"),
        ({**fp8, "weight_block_size": [128.0, 128]}, f"{where}.weight_block_size=[128.0, 128] is not two ints >= 1"),
        ({**fp8, "weight_block_size": [1, 1, 1]}, f"{where}.weight_block_size=[1, 1, 1] is not two ints >= 1"),
        ({**fp8, "weight_block_size": [1, 0]}, f"{where}.weight_block_size=[1, 0] is not two ints >= 1"),
        ({**fp8, "weight_block_size": None}, f"{where}.weight_block_size=None is not two ints >= 1"),
        ({**fp8, "weight_block_size": "128"}, f"{where}.weight_block_size='128' is not two ints >= 1"),
        ({**oss, "modules_to_not_convert": ["a", 1]}, f"{where}.modules_to_not_convert=['a', 1] is not a list of names"),
        ({**fp8, "modules_to_not_convert": "lm_head"}, f"{where}.modules_to_not_convert='lm_head' is not a list"),
        ([], f"{where}=[] is not a JSON object"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(words)):
            quantization_from_config(qc)
    assert BlockFP8([1, 300]).block == (1, 300) and BlockFP8((7.0, 2)).block == (7, 2)


@pytest.mark.unit
def test_published_quantisation_configs_are_read() -> None:
    v3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert isinstance(quantization_from_config(v3), BlockFP8) and quantization_from_config(v3).block == (128, 128)
    oss = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                      "lm_head"], "quant_method": "mxfp4"}
    assert isinstance(quantization_from_config(oss), MXFP4)
    assert quantization_from_config(None) is None


# ------------------------------------------------------------------ the converter


def _tiny(**kw: object) -> MoEGPT:
    cfg = dict(vocab_size=64, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, expert_hidden=32, num_experts=4,
               max_seq_len=32, tie_embeddings=False)
    return MoEGPT(gpt_config("tiny", **{**cfg, **kw}))


def _edit(path, config_edit, tensors_edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config_edit(cfg)))
    save_file(tensors_edit(load_file(str(path / "model.safetensors"))), str(path / "model.safetensors"))


@pytest.mark.reference
def test_an_fp8_checkpoint_loads_to_the_dequantised_values(tmp_path, gen) -> None:
    """Every linear weight of the blocks in block-wise FP8 (as DeepSeek-V3 publishes them;
    the router, norms and embeddings unquantised), with blocks that do not divide the shapes."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = _tiny(dim=48, expert_hidden=40)
    path = mixtral.gpt_to_hf(model, tmp_path / "hf")
    plain = load_file(str(path / "model.safetensors"))
    block = (16, 16)
    stored, expected = {}, {}
    for name, t in plain.items():
        if "self_attn" in name or ".experts." in name:
            q, scale, ref = quantise_fp8(t, block)
            stored.update({name: q, f"{name}_scale_inv": scale})
            expected[name] = ref
        else:
            stored[name] = expected[name] = t
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    _edit(path, lambda c: {**c, "quantization_config": qc}, lambda _: stored)
    want = state_dict_from_tensors(expected, mixtral.MIXTRAL, model.config)
    got = gpt_from_hf(path).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(got["layers.0.ffn.experts.w_in"], model.state_dict()["layers.0.ffn.experts.w_in"])
    half = gpt_from_hf(path, dtype=torch.bfloat16).state_dict()  # one rounding, from the float32 value
    assert all(torch.equal(half[k], want[k].to(torch.bfloat16)) for k in want)


@pytest.mark.reference
@pytest.mark.parametrize("case,words", [
    ("no-config", "quantization_config"),  # an fp8 weight, no quantization_config
    ("no-scale", "expected a floating-point dtype"),  # an fp8 weight without its scale
    ("scale-shape", "weight_scale_inv: shape"),
    ("weight-dtype", "float8_e4m3fn"),
    ("scale-dtype", "quantised tensor model.layers.0.self_attn.q_proj.weight_scale_inv: dtype torch.float64, "
                    "expected float32"),
    ("scale-shape-whole", "quantised tensor model.layers.0.self_attn.q_proj.weight_scale_inv: shape (4, 1), "
                          "expected (4, 4) (one scale per (16, 16) block)"),
    ("weight-dtype-whole", "quantised tensor model.layers.0.self_attn.q_proj.weight: dtype torch.float8_e5m2, "
                           "expected float8_e4m3fn (fmt e4m3)"),
    ("weight-shape", "quantised tensor model.layers.0.self_attn.q_proj.weight: shape (64, 63), expected (64, 64) "
                     "(config.json gives it; fp8 holds 2-D linear weights)"),
])
def test_a_damaged_fp8_checkpoint_is_refused_by_name(tmp_path, case, words) -> None:
    torch.manual_seed(0)
    model = _tiny(n_layers=1)
    path = mixtral.gpt_to_hf(model, tmp_path / "hf")
    name = "model.layers.0.self_attn.q_proj.weight"
    qc = {"quant_method": "fp8", "weight_block_size": [16, 16]}

    def tensors(sd: dict) -> dict:
        q, scale, _ = quantise_fp8(sd[name], (16, 16))
        sd.update({name: q, f"{name}_scale_inv": scale})
        if case == "no-scale":
            del sd[f"{name}_scale_inv"]
        elif case.startswith("scale-shape"):
            sd[f"{name}_scale_inv"] = scale[:, :1].contiguous()
        elif case.startswith("weight-dtype"):
            sd[name] = q.to(torch.float8_e5m2)
        elif case == "scale-dtype":
            sd[f"{name}_scale_inv"] = scale.double()
        elif case == "weight-shape":
            sd[name] = q[:, :-1].contiguous()
        return sd

    _edit(path, lambda c: c if case == "no-config" else {**c, "quantization_config": qc}, tensors)
    with pytest.raises(CheckpointError, match=re.escape(words)):
        gpt_from_hf(path)


def _fused_map(cfg):  # type: ignore[no-untyped-def]
    """Mixtral's map with gpt-oss's expert layout: ``gate_up_proj [E, D, 2H]`` with gate and up
    interleaved, ``down_proj [E, H, D]``."""
    out = []
    for entry in mixtral.tensor_map(cfg):
        layer = entry.ours.split(".")[1] if entry.ours.startswith("layers.") else None
        if entry.ours.endswith("experts.w_in"):
            entry = Entry(entry.ours, (fused_experts(f"model.layers.{layer}.mlp.experts.gate_up_proj", transposed=False,
                                                     interleaved=True),))
        elif entry.ours.endswith("experts.w_out"):
            entry = Entry(entry.ours, (fused_experts(f"model.layers.{layer}.mlp.experts.down_proj", transposed=False),))
        out.append(entry)
    return out


@pytest.mark.reference
def test_an_mxfp4_checkpoint_loads_to_the_dequantised_values(tmp_path, gen) -> None:
    """Fused experts stored as gpt-oss stores them in MXFP4 (``*_blocks``, ``*_scales``), read
    through a family whose map has gpt-oss's expert layout."""
    family = Family(model_type="mixtral", name="fused-experts", config_from_hf=mixtral.gpt_config_from_hf,
                    hf_config_from=mixtral.hf_config_from_gpt, tensor_map=_fused_map)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = _tiny()
    path = save_hf(model, tmp_path / "hf", family)
    plain = load_file(str(path / "model.safetensors"))
    stored, expected = {}, {}
    for name, t in plain.items():
        if name.endswith(("gate_up_proj", "down_proj")):  # [E, I, O], quantised along I
            blocks, scales, values = quantise_mxfp4(t.transpose(1, 2))
            stored.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
            expected[name] = values.float().transpose(1, 2)
        else:
            stored[name] = expected[name] = t
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    _edit(path, lambda c: {**c, "quantization_config": qc}, lambda _: stored)
    want = state_dict_from_tensors(expected, family, model.config)
    got = load_hf(path, family).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    gate = expected["model.layers.1.mlp.experts.gate_up_proj"][..., 0::2]  # de-interleaved: gate columns first
    assert torch.equal(got["layers.1.ffn.experts.w_in"][..., :32], gate)


def _mxfp4_checkpoint(tmp_path, gen, damage, **kw):  # type: ignore[no-untyped-def]
    """A checkpoint of ``_fused_map``'s family with its expert weights in MXFP4, ``damage``
    (``(name, {stored name: tensor}) -> None``) applied to each expert tensor's stored parts;
    the family and the model it was written from."""
    family = Family(model_type="mixtral", name="fused-experts", config_from_hf=mixtral.gpt_config_from_hf,
                    hf_config_from=mixtral.hf_config_from_gpt, tensor_map=_fused_map)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = _tiny(**kw)
    path = save_hf(model, tmp_path / "hf", family)
    stored = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        if name.endswith(("gate_up_proj", "down_proj")):
            I = t.shape[1] // 32 * 32 or 32  # an I that 32 does not divide is stored as if it were cut
            blocks, scales, _ = quantise_mxfp4(torch.nn.functional.pad(t.transpose(1, 2), (0, I - t.shape[1]))
                                               [..., :I].contiguous())
            parts = {f"{name}_blocks": blocks, f"{name}_scales": scales}
            damage(name, parts)
            stored.update(parts)
        else:
            stored[name] = t
    qc = {"quant_method": "mxfp4"}
    _edit(path, lambda c: {**c, "quantization_config": qc}, lambda _: stored)
    return path, family, model


@pytest.mark.reference
@pytest.mark.parametrize("case", ["blocks-dtype", "scales-dtype", "blocks-shape", "scales-shape", "no-scales",
                                  "plain-too", "odd-I"])
def test_a_damaged_mxfp4_checkpoint_is_refused_by_name(tmp_path, gen, case) -> None:
    """Each stored part of an MXFP4 tensor is checked against the shape config.json gives the
    tensor (``[E, I, O]``: blocks ``[E, O, I/32, 16]``, scales ``[E, O, I/32]``, both uint8),
    and the whole message names the part, what is wrong, what was found and what was expected;
    a tensor stored both plain and quantised, or blocks without their scales, is refused too."""
    E, D, H = 4, 64, 32
    down = "model.layers.1.mlp.experts.down_proj"  # [E, H, D]: blocks [E, D, H/32, 16]

    def damage(name: str, parts: dict) -> None:
        if name != down:
            return
        blocks, scales = parts[f"{name}_blocks"], parts[f"{name}_scales"]
        if case == "blocks-dtype":
            parts[f"{name}_blocks"] = blocks.view(torch.int8)
        elif case == "scales-dtype":
            parts[f"{name}_scales"] = scales.to(torch.int16)
        elif case == "blocks-shape":
            parts[f"{name}_blocks"] = blocks[..., :8].contiguous()
        elif case == "scales-shape":
            parts[f"{name}_scales"] = scales[:, :D - 1].contiguous()
        elif case == "no-scales":
            del parts[f"{name}_scales"]
        elif case == "plain-too":
            parts[name] = torch.randn(E, H, D, generator=gen)

    words = {
        "blocks-dtype": f"quantised tensor {down}_blocks: dtype torch.int8, expected uint8",
        "scales-dtype": f"quantised tensor {down}_scales: dtype torch.int16, expected uint8",
        "blocks-shape": f"quantised tensor {down}_blocks: shape ({E}, {D}, 1, 8), expected ({E}, {D}, 1, 16)",
        "scales-shape": f"quantised tensor {down}_scales: shape ({E}, {D - 1}, 1), expected ({E}, {D}, 1)",
        "no-scales": f"has no tensor '{down}'",
        "plain-too": f"does not know: ['{down}_blocks', '{down}_scales']",
        "odd-I": f"quantised tensor {down.replace('.1.', '.0.')}: unquantised shape ({E}, 40, {D}), expected [..., I, O] with I a multiple of 32",
    }[case]
    path, family, _ = _mxfp4_checkpoint(tmp_path, gen, damage, **({"expert_hidden": 40} if case == "odd-I" else {}))
    with pytest.raises(CheckpointError, match=re.escape(words)):
        load_hf(path, family)


@pytest.mark.reference
def test_an_mxfp4_checkpoint_with_tied_embeddings_loads(tmp_path, gen) -> None:
    """A tied output projection is absent from the files: only the expert tensors' parts are
    looked for quantised (an absent plain tensor is not taken for an MXFP4 one)."""
    path, family, model = _mxfp4_checkpoint(tmp_path, gen, lambda name, parts: None, tie_embeddings=True)
    got = load_hf(path, family).state_dict()
    assert torch.equal(got["lm_head.weight"], model.state_dict()["embed.weight"])
    assert torch.equal(got["layers.0.attn.q_proj.weight"], model.state_dict()["layers.0.attn.q_proj.weight"])


@pytest.mark.unit
def test_mxfp4_checks_any_leading_shape(gen) -> None:
    """``[..., I, O]``: a 2-D tensor's parts are checked as a 3-D one's are; fewer than two
    dimensions is no MXFP4 tensor."""
    I, O = 32 * int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 50, (1,), generator=gen))
    good = {"x_blocks": ((O, I // 32, 16), torch.uint8), "x_scales": ((O, I // 32), torch.uint8)}
    MXFP4().check("x", good, (I, O))
    with pytest.raises(CheckpointError, match=re.escape(f"x_blocks: shape {(O, I // 32, 16)}, expected (2, {O}, "
                                                        f"{I // 32}, 16)")):
        MXFP4().check("x", good, (2, I, O))
    with pytest.raises(CheckpointError, match=re.escape(f"x: unquantised shape {(I,)}, expected [..., I, O]")):
        MXFP4().check("x", {"x_blocks": ((I // 32, 16), torch.uint8), "x_scales": ((I // 32,), torch.uint8)}, (I,))

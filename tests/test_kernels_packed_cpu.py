"""The CPU's few-row grouped product over packed weights (``moeflow.kernels.packed_cpu``) and the
experts that use it (``moeflow.experts.packed``): the product equals the reference
``grouped_mm_loop`` on fresh random inputs (odd sizes, partial strips, empty experts, rows past
the counts, one and two threads, strided weights); ``packable`` is the one rule of which experts
a stand-in replaces; a ``PackedCPUExperts`` equals the experts it stands in for and sends them
every call the kernel is not for (gradients, many rows, autocast, the padded layout); it repacks
into the same memory after any change; the compiled decoder swaps stand-ins in for a generation
and always back; and the kernel's build (``torch.utils.cpp_extension`` in a child process)
tries every flag set, is bounded in time and leaves nothing behind when it fails."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

import moeflow.experts.packed as packed
import moeflow.kernels.packed_cpu as packed_cpu
from moeflow import ExpertsConfig, GroupedExperts, ModuleExperts
from moeflow.compat.tutel.experts import TutelLlamaExperts
from moeflow.experts.packed import PackedCPUExperts, packable
from moeflow.kernels.grouped_mm import grouped_mm_loop
from moeflow.kernels.packed_cpu import MAX_ROWS_PER_EXPERT, STRIP, pack_weight, packed_grouped_mm
from moeflow.layer.moe import moe_layers
from moeflow.models.compiled_decode import CompiledDecoder
from moeflow.models.packed_dense import PackedCPULinear

from helpers import random_counts, small_gpt

# only a missing compiler skips: where one is, a kernel that does not build fails these tests
needs_compiler = pytest.mark.skipif(packed_cpu._compiler() is None, reason="no C++ compiler on the PATH")


def _case(seed: int, E: int, K: int, N: int, R: int, empty: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(R, K, generator=gen), torch.randn(E, K, N, generator=gen),
            random_counts(gen, E, R, empty) if R else torch.zeros(E, dtype=torch.long))


@needs_compiler
@pytest.mark.reference
@pytest.mark.parametrize("E, K, N, R, empty", [
    (8, 64, 256, 16, 0),  # a decode step's shape: ~2 rows per expert, whole strips
    (3, 17, 37, 11, 1),  # odd K, a partial last strip, an empty expert
    (2, 5, 9, 20, 0),    # one partial strip only; 10 rows per expert: register blocks of 6 and 4
    (1, 33, 16, 7, 0),   # one expert
    (4, 8, 48, 3, 2),    # fewer rows than experts
])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_the_reference(E, K, N, R, empty, threads, bias):
    """With a bias, each row's expert's bias row is added (the products start from it)."""
    x_RK, w_EKN, counts_E = _case(E * 1000 + K * 10 + N + R, E, K, N, R, empty)
    b_EN = torch.randn(E, N, generator=torch.Generator().manual_seed(N)) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y_RN = packed_grouped_mm(x_RK, pack_weight(w_EKN), counts_E, N, b_EN)
    finally:
        torch.set_num_threads(before)
    ref_RN = grouped_mm_loop(x_RK.double(), w_EKN.double(), counts_E.cumsum(0))
    if bias:
        ref_RN[:int(counts_E.sum())] += b_EN.double().repeat_interleave(counts_E, dim=0)
    assert y_RN.shape == (R, N) and y_RN.dtype == torch.float32
    torch.testing.assert_close(y_RN.double(), ref_RN, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.reference
def test_packed_product_of_strided_weights_int32_counts_and_rows_past_the_counts():
    """A weight given as the transpose of an ``[E, N, K]`` tensor packs the same; int32 counts
    work; rows past ``counts.sum()`` come out as zeros (never uninitialised memory); no rows and
    no columns give empty outputs."""
    gen = torch.Generator().manual_seed(3)
    w_ENK = torch.randn(3, 40, 24, generator=gen)
    x_RK = torch.randn(9, 24, generator=gen)
    counts = torch.tensor([2, 0, 4], dtype=torch.int32)
    y = packed_grouped_mm(x_RK, pack_weight(w_ENK.transpose(1, 2)), counts, 40)
    ref = grouped_mm_loop(x_RK[:6], w_ENK.transpose(1, 2), counts.long().cumsum(0))
    torch.testing.assert_close(y[:6], ref[:6], rtol=1e-5, atol=1e-5)
    assert torch.equal(y[6:], torch.zeros(3, 40))
    assert packed_grouped_mm(x_RK[:0], pack_weight(w_ENK.transpose(1, 2)), counts * 0, 40).shape == (0, 40)


@pytest.mark.unit
def test_pack_layout_and_bad_input():
    """``pack_weight`` puts column ``16 s + j`` of row ``k`` at ``[e, s, k, j]`` (zeros past N);
    bad weights, packs, counts and column counts are refused by name."""
    w = torch.arange(2 * 3 * 20, dtype=torch.float32).reshape(2, 3, 20)
    p = pack_weight(w)
    assert p.shape == (2, 2, 3, STRIP) and p.is_contiguous()
    assert p[1, 1, 2, 3] == w[1, 2, 16 + 3] and p[0, 0, 1, 15] == w[0, 1, 15]
    assert torch.equal(p[:, 1, :, 4:], torch.zeros(2, 3, 12))
    assert pack_weight(w * 2, out=p) is p and p[1, 1, 2, 3] == 2 * w[1, 2, 16 + 3]
    with pytest.raises(ValueError, match="w_EKN"):
        pack_weight(w.double())
    with pytest.raises(ValueError, match="w_EKN"):
        pack_weight(w[0])
    with pytest.raises(ValueError, match="out"):
        pack_weight(w, out=torch.empty(2, 2, 3, 8))
    x = torch.randn(4, 3)
    counts = torch.tensor([1, 3])
    with pytest.raises(ValueError, match="x_RK"):
        packed_grouped_mm(x.double(), p, counts, 20)
    with pytest.raises(ValueError, match="w_ESKP"):
        packed_grouped_mm(torch.randn(4, 5), p, counts, 20)
    with pytest.raises(ValueError, match="w_ESKP"):  # (a pointer the kernel must never be given)
        packed_grouped_mm(x, p.to("meta"), counts, 20)
    with pytest.raises(ValueError, match="n must"):
        packed_grouped_mm(x, p, counts, 33)
    with pytest.raises(ValueError, match="n must"):
        packed_grouped_mm(x, p, counts, 16)
    with pytest.raises(ValueError, match="counts_E"):
        packed_grouped_mm(x, p, counts.float(), 20)
    with pytest.raises(ValueError, match="counts_E"):
        packed_grouped_mm(x, p, torch.tensor([4]), 20)
    with pytest.raises(ValueError, match="bias_En"):
        packed_grouped_mm(x, p, counts, 20, torch.zeros(2, 21))
    with pytest.raises(ValueError, match="bias_En"):
        packed_grouped_mm(x, p, counts, 20, torch.zeros(2, 20, dtype=torch.float64))


def _experts(seed: int = 0, *, activation: str = "swiglu", E: int = 4, D: int = 16, H: int = 24, **kw) -> GroupedExperts:
    """Built-in experts with weights drawn N(0, 0.2^2) from ``seed``."""
    torch.manual_seed(seed)
    experts = GroupedExperts(num_experts=E, dim=D, hidden=H, config=ExpertsConfig(activation=activation, **kw))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    return experts


def _rows(seed: int, E: int, R: int, D: int = 16, empty: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(R, D, generator=gen), random_counts(gen, E, R, empty)


@pytest.mark.unit
def test_packable_is_the_one_rule_of_which_experts_are_packed():
    """fp32 CPU built-in experts without recompute whose backend resolves to ``grouped_mm``
    (with or without biases): yes; recompute, another dtype, the ``loop`` backend (chosen, or
    what ``auto`` resolves to where ``F.grouped_mm`` cannot take the shapes), a subclass that
    computes something else, experts of one's own: no."""
    assert packable(_experts())
    assert packable(_experts(activation="gelu")) and packable(_experts(activation="swiglu_oai"))
    assert packable(_experts(bias=True)) and packable(_experts(bias=True, activation="swiglu_oai"))
    assert not packable(_experts(recompute=True))
    assert not packable(_experts().to(torch.bfloat16)) and not packable(_experts().double())
    assert not packable(_experts(backend="loop"))
    assert not packable(_experts(D=18))  # rows of 72 bytes: F.grouped_mm refuses them, auto is "loop"
    tutel = TutelLlamaExperts(num_experts=4, model_dim=16, hidden_size_per_expert=24, activation_fn=torch.tanh)
    assert not packable(tutel)
    assert not packable(ModuleExperts([torch.nn.Linear(16, 16) for _ in range(4)]))
    assert not packable(torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match="packable"):
        PackedCPUExperts(_experts(recompute=True))


@needs_compiler
@pytest.mark.reference
@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("gelu", False), ("swiglu_oai", True),
                                              ("swiglu", True)])
def test_stand_in_equals_its_experts_and_sends_them_what_the_kernel_is_not_for(activation, bias, monkeypatch):
    """No-grad grouped calls of a ``PackedCPUExperts`` run the kernel (twice: both products,
    eagerly and as the ``moeflow::packed_ffn`` op) and equal its experts' own output up to
    rounding, on fresh random rows with an empty expert; calls in grad mode (with the experts'
    gradients, exactly), under autocast, of more than ``MAX_ROWS_PER_EXPERT`` rows per expert,
    of no rows or in the padded layout go to the experts themselves, unchanged."""
    experts = _experts(activation=activation, bias=bias)  # (biases drawn N(0, 0.2^2) too: not zeros)
    stand_in = PackedCPUExperts(experts)
    assert stand_in.num_experts == 4 and stand_in.source is experts
    assert list(stand_in.parameters()) == [] and stand_in.state_dict() == {}  # no second copy of the model's weights
    calls = []
    real = packed.packed_grouped_mm
    monkeypatch.setattr(packed, "packed_grouped_mm", lambda *a: calls.append(a[1].shape) or real(*a))
    x, counts = _rows(5, 4, 10)
    with torch.no_grad():
        ref = experts(x, counts)
        torch.testing.assert_close(stand_in(x, counts), ref, rtol=1e-5, atol=1e-6)
        assert len(calls) == 2
        op = torch.ops.moeflow.packed_ffn(x, stand_in.packed_in, stand_in.packed_out, counts, activation,
                                          stand_in.width_in, stand_in.width_out, stand_in.bias_in, stand_in.bias_out)
        torch.testing.assert_close(op, ref, rtol=1e-5, atol=1e-6)
        assert len(calls) == 4
        many, many_counts = _rows(6, 4, MAX_ROWS_PER_EXPERT * 4 + 1, empty=0)
        assert torch.equal(stand_in(many, many_counts), experts(many, many_counts))
        x_ECD = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(7))
        assert torch.equal(stand_in(x_ECD, torch.tensor([3, 1, 0, 2])), experts(x_ECD, torch.tensor([3, 1, 0, 2])))
        assert stand_in(x[:0], counts * 0).shape == (0, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(stand_in(x, counts), experts(x, counts))
    assert len(calls) == 4

    grads = []
    for module in (experts, stand_in):
        xr = x.clone().requires_grad_()
        experts.zero_grad()
        y = module(xr, counts)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9)))
        grads.append((y.detach(), xr.grad, experts.w_in.grad.clone(), experts.w_out.grad.clone()))
    assert len(calls) == 4  # the gradient-recording calls never reached the kernel
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@needs_compiler
@pytest.mark.reference
def test_stand_in_repacks_into_the_same_memory_after_any_change():
    """``repack`` packs the weights as they are, each time, into the packs of before: after a
    write through ``.data`` (no version moves) and an in-place change the packs equal the new
    weights and the outputs follow; replaced parameters of the same shape reuse the memory;
    experts of another shape get new packs; experts of inference tensors (no version counter)
    pack; experts that are not packable are refused by name."""
    experts = _experts()
    stand_in = PackedCPUExperts(experts)
    first_in, first_out = stand_in.packed_in, stand_in.packed_out
    x, counts = _rows(3, 4, 8)
    with torch.no_grad():
        experts.w_in.data.mul_(-1.0)  # an EMA-style write: the version does not move
        experts.w_out.add_(0.5)
        stand_in.repack(experts)
        assert stand_in.packed_in is first_in and stand_in.packed_out is first_out
        assert torch.equal(stand_in.packed_in, pack_weight(experts.w_in)) and torch.equal(
            stand_in.packed_out, pack_weight(experts.w_out))
        torch.testing.assert_close(stand_in(x, counts), experts(x, counts), rtol=1e-5, atol=1e-6)
        experts.w_in = torch.nn.Parameter(experts.w_in.detach().clone() + 1.0)
        stand_in.repack(experts)
        assert stand_in.packed_in is first_in and torch.equal(first_in, pack_weight(experts.w_in))
        wider = _experts(1, H=40)
        stand_in.repack(wider)
        assert stand_in.source is wider and stand_in.packed_in is not first_in
        torch.testing.assert_close(stand_in(x, counts), wider(x, counts), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not packable"):
        stand_in.repack(_experts().to(torch.bfloat16))
    biased = _experts(3, bias=True)
    with torch.no_grad():  # biases are copied in, then copied into the same memory after a change
        stand_in.repack(biased)
        first_bias = stand_in.bias_in
        assert torch.equal(first_bias, biased.b_in) and first_bias is not biased.b_in
        biased.b_in.data.add_(1.0)
        biased.b_out.mul_(-1.0)
        stand_in.repack(biased)
        assert stand_in.bias_in is first_bias and torch.equal(first_bias, biased.b_in)
        torch.testing.assert_close(stand_in(x, counts), biased(x, counts), rtol=1e-5, atol=1e-6)
        stand_in.repack(experts)  # no biases again: none held
        assert stand_in.bias_in is None and stand_in.bias_out is None
    with torch.inference_mode():
        frozen = _experts(2)
        frozen_in = PackedCPUExperts(frozen)
        torch.testing.assert_close(frozen_in(x, counts), frozen(x, counts), rtol=1e-5, atol=1e-6)


@needs_compiler
@pytest.mark.reference
def test_the_decoder_swaps_stand_ins_in_for_a_generation_and_always_back():
    """``CompiledDecoder.generation`` puts a ``PackedCPUExperts`` in place of every packable MoE
    layer's experts (a layer cast to bf16 keeps its own) and a ``PackedCPULinear`` in place of
    every plain fp32 linear but the head (which ``HeadProduct`` packs), the same stand-in objects
    generation after generation (a compiled step reads their buffers), and puts every module back
    on the way out, also when the generation fails; a module no longer packable loses its
    stand-in."""
    model = small_gpt(n_layers=4)  # MoE on blocks 1 and 3
    layers = moe_layers(model)
    experts = [layer.experts for layer in layers]
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear and m is not model.lm_head}
    assert "layers.0.attn.q_proj" in linears and len(linears) >= 8  # q, k, v, o of each block, the routers
    decoder = CompiledDecoder(model)  # (nothing compiles before a step runs)
    with torch.no_grad():
        with decoder.generation(model):
            assert all(isinstance(layer.experts, PackedCPUExperts) for layer in layers)
            assert [layer.experts.source for layer in layers] == experts
            for name, linear in linears.items():
                stand_in = model.get_submodule(name)
                assert isinstance(stand_in, PackedCPULinear) and stand_in.source is linear
                assert stand_in.weight is linear.weight  # code that reads .weight reads the linear's
            assert model.lm_head is not None and type(model.lm_head) is torch.nn.Linear
            assert decoder.head is not None and decoder.head.packed is not None
            stand_ins, linear_stand_ins = dict(decoder.stand_ins), dict(decoder.linear_stand_ins)
        assert [layer.experts for layer in layers] == experts and decoder.head.packed is None
        assert all(model.get_submodule(name) is linear for name, linear in linears.items())
        layers[0].experts.to(torch.bfloat16)
        model.layers[0].attn.q_proj.to(torch.float64)
        with pytest.raises(RuntimeError, match="inside"), decoder.generation(model):
            assert layers[0].experts is experts[0] and layers[1].experts is stand_ins[1]
            assert model.layers[0].attn.q_proj is linears["layers.0.attn.q_proj"]
            assert model.layers[0].attn.k_proj is linear_stand_ins["layers.0.attn.k_proj"]
            raise RuntimeError("a failure inside the generation")
        assert [layer.experts for layer in layers] == experts and list(decoder.stand_ins) == [1]
        assert all(model.get_submodule(name) is linear for name, linear in linears.items())
        assert "layers.0.attn.q_proj" not in decoder.linear_stand_ins


@pytest.mark.unit
@pytest.mark.skipif(not hasattr(__import__("os"), "getuid"), reason="POSIX permissions")
def test_kernel_cache_must_be_this_users_alone(tmp_path, monkeypatch):
    """The built library is loaded from the cache: a directory others may write is refused."""
    cache = tmp_path / "kernels"
    monkeypatch.setattr(packed_cpu, "KERNEL_CACHE", cache)
    packed_cpu._check_cache_dir()
    assert cache.is_dir() and cache.stat().st_mode & 0o777 == 0o700
    cache.chmod(0o777)
    with pytest.raises(RuntimeError, match="writable by nobody else"):
        packed_cpu._check_cache_dir()


def _fake_compiler(path, on_compile: str):  # type: ignore[no-untyped-def]
    """A shell script at ``path`` that answers ``cpp_extension``'s questions about the compiler
    (``--version``, ``-v``) as the host's g++ does and runs ``on_compile`` instead of compiling
    the kernel's source (linking is never reached)."""
    real = packed_cpu.shutil.which("g++") or packed_cpu.shutil.which("c++")
    if real is None:
        pytest.skip("no C++ compiler to stand in for")
    path.write_text(f"#!/bin/sh\ncase \"$*\" in *packed_grouped_mm.cpp*) {on_compile};; esac\nexec {real} \"$@\"\n")
    path.chmod(0o755)
    return path


@contextlib.contextmanager
def _fresh_build(monkeypatch, tmp_path, compiler: str):  # type: ignore[no-untyped-def]
    """A build of the kernel from scratch with ``compiler``, in a cache under ``tmp_path``."""
    monkeypatch.setattr(packed_cpu, "KERNEL_CACHE", tmp_path / "kernels")
    monkeypatch.setattr(packed_cpu, "_compiler", lambda: compiler)
    packed_cpu._library.cache_clear()
    packed_cpu.packed_cpu_available.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        packed_cpu._library.cache_clear()
        packed_cpu.packed_cpu_available.cache_clear()


@pytest.mark.e2e
def test_a_compiler_that_fails_is_an_error_naming_it_and_a_warning_for_the_decoder(tmp_path, monkeypatch):
    """``_library`` raises with the compiler's own message when every flag set fails (each one
    tried: the build runs ``torch.utils.cpp_extension`` in a child process); ``packed_cpu_available``
    turns that into one ``RuntimeWarning`` and False (the decoder then multiplies the weights
    themselves), never a crash in the middle of a generation; nothing is left in the cache."""
    broken = _fake_compiler(tmp_path / "broken-c++", f"echo x >> {tmp_path / 'tries'}; echo 'no such luck' >&2; exit 1")
    tries = tmp_path / "tries"
    with _fresh_build(monkeypatch, tmp_path, str(broken)):
        with pytest.raises(RuntimeError, match="no such luck"):
            packed_cpu._library()
        assert len(tries.read_text().split()) == len(packed_cpu._FLAG_SETS)  # every flag set was compiled
        with pytest.warns(RuntimeWarning, match="(?s)did not build.*no such luck"):
            assert packed_cpu.packed_cpu_available() is False
        assert list((tmp_path / "kernels").iterdir()) == []  # no half-written build left behind


@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(os, "killpg") or not os.path.exists("/proc/self/stat"), reason="POSIX process groups, /proc")
def test_a_compiler_that_hangs_is_killed_after_the_build_timeout(tmp_path, monkeypatch):
    """``cpp_extension`` has no time limit: the child process building the kernel is killed,
    with the compiler it started, once ``BUILD_TIMEOUT_S`` (every flag set together) is spent;
    the error says so and nothing is left in the cache."""
    pids = tmp_path / "pids"
    hanging = _fake_compiler(tmp_path / "hanging-c++", f"echo $$ >> {pids}; sleep 600; exit 1")
    with _fresh_build(monkeypatch, tmp_path, str(hanging)):
        monkeypatch.setattr(packed_cpu, "BUILD_TIMEOUT_S", 20.0)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="did not finish within the 20 s of BUILD_TIMEOUT_S"):
            packed_cpu._library()
        assert time.monotonic() - t0 < 60
        assert list((tmp_path / "kernels").iterdir()) == []
        for pid in map(int, pids.read_text().split()):  # the compiler went with its build
            assert _dead(pid)


def _dead(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (killed, not yet reaped), within 5 s."""
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.unit
def test_every_flag_set_is_tried_when_building_or_loading_fails(tmp_path, monkeypatch):
    """The first flag set whose library both builds and loads is the kernel: a set that fails to
    build and a set whose library fails to load (an ``ImportError``, as an unresolved symbol
    gives) are each followed by the next one, and their directories are removed."""
    built, loaded = [], []

    def build(compiler, name, directory, cflags, ldflags, deadline):  # type: ignore[no-untyped-def]
        built.append(cflags)
        if len(built) == 1:
            raise RuntimeError("the compiler refused these flags")
        (directory / f"{name}.so").write_bytes(b"not a library")

    def load(name, path):  # type: ignore[no-untyped-def]
        loaded.append(path.parent)
        if len(loaded) == 1:
            raise ImportError(f"{path}: undefined symbol")
        return "the module"

    with _fresh_build(monkeypatch, tmp_path, "/bin/true"):
        monkeypatch.setattr(packed_cpu, "_build_in_child", build)
        monkeypatch.setattr(packed_cpu, "_load", load)
        assert packed_cpu._library() == "the module"
        assert built == [flags for flags, _ in packed_cpu._FLAG_SETS]
        assert [p.exists() for p in loaded] == [False, True]  # the library that did not load was removed
        assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [loaded[1].name]


@needs_compiler
@pytest.mark.e2e
def test_expert_products_bench_reports_both_candidates_on_the_same_outputs(tmp_path, capsys):
    """A tiny run of bench/expert_products.py: a row per batch size with both candidates' times,
    the weights read, and outputs that agree; bad flags are refused by name."""
    import json

    from bench.expert_products import main as bench_main

    out = tmp_path / "products.json"
    threads = torch.get_num_threads()
    assert bench_main(["--dim", "16", "--hidden", "24", "--experts", "4", "--layers", "2", "--batch-sizes", "1,3",
                       "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["results"]] == [1, 3] and report["threads"] == 1
    for r in report["results"]:
        assert sum(r["counts"]) == r["rows"] == 2 * r["batch"]
        assert r["grouped_mm_us"] > 0 and r["packed_us"] > 0 and r["max_abs_diff"] < 1e-5 and r["packed_kernel_ran"]
        assert r["weights_read_MiB"] == sum(c > 0 for c in r["counts"]) * (16 * 48 + 24 * 16) * 4 / 2**20
    assert "ratio" in capsys.readouterr().out and torch.get_num_threads() == threads  # restored
    with pytest.raises(SystemExit, match="--top-k"):
        bench_main(["--experts", "2", "--top-k", "3", "--json", str(out)])
    with pytest.raises(SystemExit, match="--batch-sizes"):
        bench_main(["--batch-sizes", "0", "--json", str(out)])



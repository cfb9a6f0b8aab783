"""Expert weight gradients added into existing ``.grad`` (``moeflow.experts.weight_grads``):
the same sums as autograd's own accumulation, no ``[E, ...]`` temporary, and autograd's
semantics kept wherever the fused way would change them (hooks, ``autograd.grad``, ``inputs=``)."""

from __future__ import annotations

import pytest
import torch
from helpers import ffn_operands

from moeflow import MoE, MoEConfig
from moeflow.bench.memory import LiveTensorBytes
from moeflow.experts.lean import ffn_reference, lean_ffn

pytestmark = pytest.mark.reference

LAYOUTS = [("bmm", torch.float64), ("loop", torch.float64), ("grouped_mm", torch.float32)]
ACTS = ["swiglu", "relu", "gelu"]


def _operands(gemm: str, dtype: torch.dtype, seed: int, *, E: int = 5, C: int = 6, D: int = 16, H: int = 16,
              activation: str = "swiglu"):
    gen = torch.Generator().manual_seed(seed)
    x, w_in, w_out, offs = ffn_operands(gen, gemm, activation, dtype, E=E, C=C, D=D, H=H)
    return x, w_in, w_out, offs, gen


def _micro_batches(x: torch.Tensor, gen: torch.Generator, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` pairs of rows like ``x`` and an output gradient (the FFN maps D to D)."""
    return [(torch.randn(x.shape, generator=gen, dtype=x.dtype), torch.randn(x.shape, generator=gen, dtype=x.dtype))
            for _ in range(n)]


def _accumulate(fn, w_in, w_out, batches, *, hooks: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Run ``fn`` fwd+bwd over ``batches`` into fresh copies of the weights; ``hooks``: an
    identity tensor hook on each weight, which keeps autograd's own accumulation."""
    a, b = w_in.detach().clone().requires_grad_(), w_out.detach().clone().requires_grad_()
    if hooks:
        a.register_hook(lambda g: g)
        b.register_hook(lambda g: g)
    dxs = []
    for x, dy in batches:
        x = x.clone().requires_grad_()
        fn(x, a, b).backward(dy)
        dxs.append(x.grad)
    return a.grad, b.grad, dxs


def _lean(gemm: str, offs, activation: str, recompute: bool):
    offs32 = None if offs is None else offs.to(torch.int32)
    return lambda x, a, b: lean_ffn(x, a, b, offs32, activation=activation, gemm=gemm, recompute=recompute)


@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute"])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("gemm,dtype", LAYOUTS, ids=[g for g, _ in LAYOUTS])
def test_added_gradients_equal_autograd_accumulation(gemm, dtype, activation, recompute):
    x, w_in, w_out, offs, gen = _operands(gemm, dtype, 0, activation=activation)
    batches = _micro_batches(x, gen, 3)
    fused = _accumulate(_lean(gemm, offs, activation, recompute), w_in, w_out, batches, hooks=False)
    plain = _accumulate(_lean(gemm, offs, activation, recompute), w_in, w_out, batches, hooks=True)
    ref_offs = None if offs is None else offs
    ref = _accumulate(lambda x, a, b: ffn_reference(x.to(torch.float64), a.to(torch.float64), b.to(torch.float64),
                                                    ref_offs, activation=activation).to(dtype),
                      w_in, w_out, batches, hooks=True)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-4)
    for got, want in ((fused[0], plain[0]), (fused[1], plain[1]), (fused[0], ref[0]), (fused[1], ref[1])):
        torch.testing.assert_close(got, want, **tol)
    for got, want in zip(fused[2], ref[2]):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute"])
@pytest.mark.parametrize("gemm,dtype", LAYOUTS, ids=[g for g, _ in LAYOUTS])
def test_a_second_micro_batch_allocates_no_weight_gradient(gemm, dtype, recompute):
    """With ``.grad`` present the backward allocates less than one weight's bytes; with autograd's
    accumulation (a hook on the weights) it allocates at least the larger weight's gradient. (Weights
    much larger than the activations, as at the benchmark's configurations.)"""
    x, w_in, w_out, offs, gen = _operands(gemm, dtype, 1, E=8, C=3, D=64, H=64)
    fn = _lean(gemm, offs, "swiglu", recompute)
    for hooks in (False, True):
        a, b = w_in.detach().clone().requires_grad_(), w_out.detach().clone().requires_grad_()
        if hooks:
            a.register_hook(lambda g: g)
            b.register_hook(lambda g: g)
        fn(x.detach().requires_grad_(), a, b).sum().backward()  # the first micro-batch makes .grad
        with LiveTensorBytes() as mem:
            fn(x.detach().requires_grad_(), a, b).sum().backward()
        if hooks:
            assert mem.peak >= a.numel() * a.element_size()
        else:
            assert mem.peak < b.numel() * b.element_size(), mem.peak


def test_autograd_grad_returns_the_gradient_and_leaves_dot_grad_alone():
    x, w_in, w_out, offs, _ = _operands("bmm", torch.float64, 2)
    fn = _lean("bmm", offs, "swiglu", False)
    fn(x, w_in, w_out).sum().backward()
    before = (w_in.grad.clone(), w_out.grad.clone())
    got = torch.autograd.grad(fn(x, w_in, w_out).sum(), [w_in, w_out])
    want = torch.autograd.grad(ffn_reference(x, w_in, w_out, None, activation="swiglu").sum(), [w_in, w_out])
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
        assert not g._is_zerotensor()
    assert torch.equal(w_in.grad, before[0]) and torch.equal(w_out.grad, before[1])


@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute"])
def test_backward_with_inputs_leaves_the_weights_grad_alone(recompute):
    x, w_in, w_out, offs, _ = _operands("bmm", torch.float64, 3)
    fn = _lean("bmm", offs, "swiglu", recompute)
    fn(x, w_in, w_out).sum().backward()
    before = (w_in.grad.clone(), w_out.grad.clone())
    fn(x, w_in, w_out).sum().backward(inputs=[x])
    assert torch.equal(w_in.grad, before[0]) and torch.equal(w_out.grad, before[1])
    fn(x, w_in, w_out).sum().backward(inputs=[w_in])  # w_in only: w_out untouched, w_in added
    assert torch.equal(w_out.grad, before[1])
    torch.testing.assert_close(w_in.grad, 2 * before[0], rtol=1e-12, atol=1e-12)


def test_a_tensor_hook_sees_the_micro_batch_gradient_and_may_change_it():
    x, w_in, w_out, offs, _ = _operands("bmm", torch.float64, 4)
    fn = _lean("bmm", offs, "swiglu", False)
    want = torch.autograd.grad(ffn_reference(x, w_in, w_out, None, activation="swiglu").sum(), w_in)[0]
    seen = []
    w_in.register_hook(lambda g: (seen.append(g), 2 * g)[1])
    fn(x, w_in, w_out).sum().backward()
    fn(x, w_in, w_out).sum().backward()
    assert len(seen) == 2 and not any(g._is_zerotensor() for g in seen)
    torch.testing.assert_close(seen[1], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w_in.grad, 4 * want, rtol=1e-12, atol=1e-12)


def test_post_accumulate_grad_hooks_see_the_summed_gradient():
    x, w_in, w_out, offs, _ = _operands("bmm", torch.float64, 5)
    fn = _lean("bmm", offs, "swiglu", True)
    sums = []
    w_out.register_post_accumulate_grad_hook(lambda p: sums.append(p.grad.clone()))
    for _ in range(3):
        fn(x, w_in, w_out).sum().backward()
    want = torch.autograd.grad(ffn_reference(x, w_in, w_out, None, activation="swiglu").sum(), w_out)[0]
    assert len(sums) == 3
    for n, got in enumerate(sums, start=1):
        torch.testing.assert_close(got, n * want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute"])
def test_a_pre_hook_on_the_weights_accumulate_grad_node_gets_a_zero_tensor(recompute):
    """Where the gradient was added into ``.grad``, the weight's ``AccumulateGrad`` node still
    gets a gradient, a zero tensor that allocates nothing (module docstring), not None."""
    x, w_in, w_out, offs, _ = _operands("bmm", torch.float64, 13)
    fn = _lean("bmm", offs, "swiglu", recompute)
    fn(x, w_in, w_out).sum().backward()
    seen = []
    nodes = [w.view_as(w).grad_fn.next_functions[0][0] for w in (w_in, w_out)]
    for node in nodes:
        node.register_prehook(lambda grads: seen.append(grads[0]))
    fn(x, w_in, w_out).sum().backward()
    assert len(seen) == 2 and all(g is not None and g._is_zerotensor() for g in seen)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_create_graph_keeps_autograds_accumulation():
    x, w_in, w_out, offs, _ = _operands("bmm", torch.float64, 6)
    fn = _lean("bmm", offs, "swiglu", False)
    fn(x, w_in, w_out).sum().backward()
    old, first = w_in.grad, w_in.grad.clone()
    fn(x, w_in, w_out).sum().backward(create_graph=True)
    torch.testing.assert_close(w_in.grad, 2 * first, rtol=1e-12, atol=1e-12)
    assert not w_in.grad._is_zerotensor()
    assert torch.equal(old, first)  # autograd makes a new .grad here: the old tensor is left as it was


@pytest.mark.parametrize("layout", ["bmm", "grouped"])
def test_the_layer_accumulates_micro_batches_like_one_batch(layout):
    """Two half micro-batches through the layer (fused accumulation on the second) equal the
    same two halves with autograd's accumulation, and their summed losses' gradients."""
    torch.manual_seed(7)
    cfg = MoEConfig(dim=16, hidden=16, num_experts=4, top_k=2, capacity_factor=2.0 if layout == "bmm" else 0.0)
    fused, plain = MoE(config=cfg).double(), MoE(config=cfg).double()
    plain.load_state_dict(fused.state_dict())
    for p in (plain.experts.w_in, plain.experts.w_out):
        p.register_hook(lambda g: g)
    halves = torch.randn(2, 24, 16, dtype=torch.float64).unbind(0)
    summed = torch.autograd.grad(sum(plain(xb).square().sum() for xb in halves), list(plain.parameters()))
    for layer in (fused, plain):
        for xb in halves:
            layer(xb).square().sum().backward()
    for (name, a), b, ref in zip(fused.named_parameters(), plain.parameters(), summed):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(a.grad, ref, rtol=1e-10, atol=1e-12, msg=name)



def test_weights_used_twice_and_by_plain_autograd_in_one_graph():
    """Two lean calls and one plain-autograd call share the weights in one backward: the fused
    adds, the zero tensors and autograd's own gradient sum to the reference."""
    x, w_in, w_out, offs, _ = _operands("bmm", torch.float64, 8)
    x = x.detach()

    def loss(lean: bool) -> torch.Tensor:
        ffn = (lambda xx: lean_ffn(xx, w_in, w_out, None, activation="swiglu", gemm="bmm")) if lean else \
            (lambda xx: ffn_reference(xx, w_in, w_out, None, activation="swiglu"))
        return ffn(x).sum() + ffn_reference(x, w_in, w_out, None, activation="swiglu").square().sum() + ffn(2 * x).sum()

    want = torch.autograd.grad(loss(False), [w_in, w_out])
    loss(True).backward()
    loss(True).backward()  # .grad exists: the lean calls add into it
    for got, ref in zip((w_in.grad, w_out.grad), want):
        torch.testing.assert_close(got, 2 * ref, rtol=1e-10, atol=1e-10)


def test_without_the_engine_query_autograd_accumulates(monkeypatch):
    """The fused way rests on a private engine query; a torch without it gets autograd's own
    accumulation (a new gradient, the same sums), never a guess."""
    x, w_in, w_out, offs, gen = _operands("bmm", torch.float64, 9, E=8, C=3, D=64, H=64)
    batches = _micro_batches(x, gen, 2)
    want = _accumulate(_lean("bmm", offs, "swiglu", False), w_in, w_out, batches, hooks=True)
    monkeypatch.delattr(torch._C, "_will_engine_execute_node")
    a, b = w_in.detach().clone().requires_grad_(), w_out.detach().clone().requires_grad_()
    fn = _lean("bmm", offs, "swiglu", False)
    fn(batches[0][0], a, b).backward(batches[0][1])
    with LiveTensorBytes() as mem:
        fn(batches[1][0], a, b).backward(batches[1][1])
    assert mem.peak >= a.numel() * a.element_size()
    torch.testing.assert_close(a.grad, want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.grad, want[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wrap", ["checkpoint", "save_on_cpu"])
@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute"])
def test_the_parameter_is_found_when_the_saved_weight_is_a_copy(wrap, recompute, monkeypatch):
    """Non-reentrant checkpoint and saved-tensor hooks hand backward a detached copy of the
    weight; the parameter's .grad is still added into (found through its AccumulateGrad node)."""
    from torch.utils.checkpoint import checkpoint

    import moeflow.experts.lean as lean_mod

    adds = []
    real_add = lean_mod.add_weight_grad_
    monkeypatch.setattr(lean_mod, "add_weight_grad_", lambda *a: (adds.append(1), real_add(*a))[1])
    x, w_in, w_out, offs, gen = _operands("bmm", torch.float64, 10)
    batches = _micro_batches(x, gen, 2)
    fn = _lean("bmm", offs, "swiglu", recompute)
    if wrap == "checkpoint":
        wrapped = lambda xx, a, b: checkpoint(fn, xx, a, b, use_reentrant=False)  # noqa: E731
    else:
        def wrapped(xx, a, b):
            with torch.autograd.graph.save_on_cpu():
                return fn(xx, a, b)
    got = _accumulate(wrapped, w_in, w_out, batches, hooks=False)
    want = _accumulate(fn, w_in, w_out, batches, hooks=True)
    assert len(adds) == 2  # both weights, on the second micro-batch
    for g, r in zip(got[:2], want[:2]):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("E", [4, 8, 16, 20])
def test_grouped_adds_take_about_an_eighth_of_the_experts_at_a_time(E, monkeypatch):
    """``add_grouped_chunks_`` (``add_weight_grad_("grouped_mm")`` off the CPU) adds
    ``ceil(E/8)`` experts per grouped GEMM (the temporary is about 1/8 of the gradient), skips a
    chunk whose experts have no rows (a 0-row grouped GEMM is not run), and sums what the
    per-expert loop sums."""
    import moeflow.experts.weight_grads as wg

    gen = torch.Generator().manual_seed(100 + E)
    step = -(-E // 8)
    counts = torch.randint(1, 6, (E,), generator=gen)
    counts[step:2 * step] = 0  # the second chunk has no rows
    offs = counts.cumsum(0)
    x = torch.randn(int(offs[-1]), 8, generator=gen)
    g = torch.randn(int(offs[-1]), 4, generator=gen)
    start = torch.randn(E, 8, 4, generator=gen)
    calls = []
    real = wg.F.grouped_mm
    monkeypatch.setattr(wg.F, "grouped_mm", lambda a, b, *, offs: (calls.append(len(offs)), real(a, b, offs=offs))[1])
    got = start.clone()
    wg.add_grouped_chunks_(x, g, offs.to(torch.int32), got)
    want = start.double().clone()
    ends = offs.tolist()
    for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
        want[e] += x[s:t].double().t() @ g[s:t].double()
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    chunks = [(e0, min(E, e0 + step)) for e0 in range(0, E, step)]
    assert calls == [e1 - e0 for e0, e1 in chunks if int(counts[e0:e1].sum()) > 0]


@pytest.mark.parametrize("gemm", ["bmm", "loop"])
def test_weight_grads_into_a_slice_allocate_nothing(gemm):
    """``weight_grad_into`` writes ``x_e^T g_e`` straight into its slice of the gradient (the
    recompute backward's chunks): with bmm and the per-expert loop, no temporary of the slice's
    size; an expert without rows gets zeros over whatever the slice held."""
    from moeflow.experts.weight_grads import weight_grad_into

    gen = torch.Generator().manual_seed(12)
    E, C, D, F_ = 4, 3, 32, 48
    if gemm == "bmm":
        x, g, offs = torch.randn(E, C, D, generator=gen), torch.randn(E, C, F_, generator=gen), None
        want = torch.bmm(x.double().transpose(1, 2), g.double())
    else:
        offs = torch.tensor([3, 3, 7, 9])  # expert 1 has no rows
        x, g = torch.randn(9, D, generator=gen), torch.randn(9, F_, generator=gen)
        want = torch.stack([x[s:t].double().t() @ g[s:t].double() for s, t in ((0, 3), (3, 3), (3, 7), (7, 9))])
    whole = torch.randn(E + 2, D, F_, generator=gen)
    out = whole[1:E + 1]
    with LiveTensorBytes() as mem:
        weight_grad_into(gemm, x, g, offs, out)
    assert mem.peak < out[0].numel() * out.element_size(), mem.peak
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-5)


def test_grouped_weight_gradient_comes_in_the_weights_layout():
    """``mm_weight_grad("grouped_mm")`` returns ``dW`` in the layout of a transposed weight view
    (the Hugging Face ``[E, F, D]`` parameter seen as ``[E, D, F]``), so adding it into that
    parameter's ``.grad`` needs no transposing copy; for any other weight, contiguous. Same
    values either way."""
    from moeflow.experts.weight_grads import mm_weight_grad

    gen = torch.Generator().manual_seed(14)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    x, g = torch.randn(7, 8, generator=gen), torch.randn(7, 12, generator=gen)
    want = torch.stack([x[s:t].double().t() @ g[s:t].double() for s, t in ((0, 3), (3, 3), (3, 7))]).float()
    transposed = torch.randn(3, 12, 8, generator=gen).transpose(1, 2)
    sliced = torch.randn(3, 8, 16, generator=gen)[..., :12]
    for like, layout in ((transposed, "transposed"), (sliced, "contiguous"), (sliced.contiguous(), "contiguous")):
        dw = mm_weight_grad("grouped_mm", x, g, offs, like)
        torch.testing.assert_close(dw, want, rtol=1e-5, atol=1e-5)
        assert (dw.stride() == like.stride()) if layout == "transposed" else dw.is_contiguous(), layout


def test_a_sparse_grad_keeps_autograds_accumulation():
    """A sparse ``.grad`` is not added into in place: autograd accumulates as usual (a new
    ``.grad``, the same sum) and the old tensor stays as it was."""
    x, w_in, w_out, offs, _ = _operands("bmm", torch.float64, 15)
    fn = _lean("bmm", offs, "swiglu", False)
    want = torch.autograd.grad(ffn_reference(x, w_in, w_out, None, activation="swiglu").sum(), w_in)[0]
    start = torch.randn(w_in.shape, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    old = start.to_sparse()
    w_in.grad = old
    fn(x, w_in, w_out).sum().backward()
    assert w_in.grad is not old
    torch.testing.assert_close(w_in.grad.to_dense(), start + want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(old.to_dense(), start, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_grouped_adds_on_the_cpu_go_into_the_gradient_itself(layout, monkeypatch):
    """On the CPU ``add_weight_grad_("grouped_mm")`` adds each expert's ``x_e^T g_e`` inside its
    GEMM: no grouped GEMM, no temporary as large as an expert's slice (contiguous or the
    transposed view of an ``[E, F, D]`` weight), the sum of what was there and the product, an
    expert without rows left as it was."""
    import moeflow.experts.weight_grads as wg

    gen = torch.Generator().manual_seed(21)
    offs = torch.tensor([5, 5, 12, 16], dtype=torch.int32)  # expert 1 has no rows
    D, F_ = 48, 40
    x, g = torch.randn(16, D, generator=gen), torch.randn(16, F_, generator=gen)
    start = torch.randn(4, D, F_, generator=gen) if layout == "contiguous" else \
        torch.randn(4, F_, D, generator=gen).transpose(1, 2)
    monkeypatch.setattr(wg.F, "grouped_mm", lambda *a, **k: pytest.fail("a grouped GEMM ran"))
    got = start.clone() if layout == "contiguous" else start.transpose(1, 2).clone().transpose(1, 2)
    with LiveTensorBytes() as mem:
        wg.add_weight_grad_("grouped_mm", x, g, offs, got)
    assert mem.peak < D * F_ * got.element_size(), mem.peak
    want = start.double().clone()
    for e, (s, t) in enumerate(((0, 5), (5, 5), (5, 12), (12, 16))):
        want[e] += x[s:t].double().t() @ g[s:t].double()
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], start[1])


def _zero_grad_model(seed: int):
    torch.manual_seed(seed)
    cfg = MoEConfig(dim=16, hidden=24, num_experts=4, top_k=2, capacity_factor=0.0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), MoE(config=cfg)).double()


def test_zero_grad_keeps_the_added_expert_gradients_and_drops_the_rest():
    """``moeflow.zero_grad_`` after a step: the lean experts' weights (whose backward adds into
    ``.grad``) keep the same tensor, zeroed; every other gradient is ``None``. The next step's
    gradients equal those of a copy whose gradients were all dropped (``zero_grad()``), for
    every parameter, on fresh inputs, and the kept tensors are the ones the step added into."""
    import moeflow

    kept, dropped = _zero_grad_model(3), _zero_grad_model(3)
    experts = {id(p) for p in (kept[1].experts.w_in, kept[1].experts.w_out)}
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        x = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64)
        before = {id(p): p.grad for p in kept.parameters() if p.grad is not None}
        for model in (kept, dropped):
            model(x).square().sum().backward()
        for (name, a), b in zip(kept.named_parameters(), dropped.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=f"step {step}: {name}")
            if step > 0 and id(a) in experts:
                assert a.grad is before[id(a)], name  # added into the kept tensor, not a new one
        moeflow.zero_grad_(kept)
        dropped.zero_grad()
        for name, p in kept.named_parameters():
            if id(p) in experts:
                assert p.grad is not None and not p.grad.any(), name
            else:
                assert p.grad is None, name
        assert all(p.grad is None for p in dropped.parameters())


def test_zero_grad_drops_gradients_it_could_not_add_into():
    """A marked weight whose ``.grad`` is not a plain dense tensor on the CPU (sparse, a zero
    tensor, off the CPU: a ``meta`` one stands for a GPU's here) has it dropped, as ``zero_grad()`` would; a gradient that is part
    of a graph is detached before it is zeroed (``zero_grad``'s own rule)."""
    import moeflow

    model = _zero_grad_model(5)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    model(x).sum().backward()
    w_in, w_out = model[1].experts.w_in, model[1].experts.w_out
    assert w_in.moeflow_adds_grad and w_out.moeflow_adds_grad
    assert not getattr(model[0].weight, "moeflow_adds_grad", False)
    w_in.grad = torch.zeros(w_in.shape, dtype=w_in.dtype).to_sparse()
    w_out.grad = torch._efficientzerotensor(w_out.shape, dtype=w_out.dtype)
    moeflow.zero_grad_(model)
    assert w_in.grad is None and w_out.grad is None
    model(x).sum().backward()
    g = torch.ones_like(w_out).requires_grad_() * 2  # a gradient with a graph
    w_out.grad = g
    moeflow.zero_grad_(model)
    assert w_out.grad is g and g.grad_fn is None and not g.requires_grad and not g.any()
    on_meta = torch.nn.Parameter(torch.empty(3, 4, device="meta"))
    on_meta.moeflow_adds_grad = True
    on_meta.grad = torch.empty(3, 4, device="meta")
    holder = torch.nn.Module()
    holder.w = on_meta
    moeflow.zero_grad_(holder)
    assert on_meta.grad is None

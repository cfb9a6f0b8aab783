"""Tutel's own examples, run on ``moeflow.compat.tutel`` in place of ``tutel``.

Each ``_helloworld*`` below follows the flow of the Tutel example of that name
(``tutel/examples/helloworld.py``, ``helloworld_from_scratch.py``,
``helloworld_custom_gate_expert.py``, ``helloworld_custom_expert_sharded.py``): the same calls into
``system``, ``moe`` and ``net`` with the same arguments, with sizes reduced and the argparse
flags turned into parameters. ``from moeflow.compat.tutel import system, moe, net`` stands where
the examples say ``from tutel import ...``. Beyond running, each test checks what the example
computes against a plain token-by-token reference (outputs and gradients), and the training
loops check that the loss falls.
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from moeflow.compat.tutel import moe
from moeflow.compat.tutel import moe as tutel_moe
from moeflow.compat.tutel import net, system

from helpers import spawn_ranks

pytestmark = pytest.mark.integration


def _args(**kw) -> argparse.Namespace:
    """helloworld's flags with reduced sizes (batch 4 x 8 tokens, model_dim 16)."""
    base = dict(local_rank=-1, batch_size=4, num_tokens=8, model_dim=16, hidden_size=12, num_local_experts=2,
                dtype="float32", fp32_gate=False, top=2, l_aux_wt=0.0, a2a_ffn_overlap_degree=1, allreduce_degree=1,
                num_steps=6, parallel_type="adaptive:1", checkpoint_path="", device="cpu", use_2dh=False, eval=False,
                capacity_factor=1.0, megablocks_size=0, use_tensorcore=False, expert_type="ffn", lr=1e-5)
    base.update(kw)
    return argparse.Namespace(**base)


def _by_token(layer, x_TD, expert_fn, *, cf):
    """Tutel's routing written out (GShard priority, Tutel's capacity incl. its alignment to
    ``a2a_ffn_overlap_degree``): ``sum_k g_k * expert_fn(e_k, x_t)`` over kept assignments."""
    E, k = layer.num_global_experts, layer.top_k
    scores = torch.softmax(layer.gates[0].logits(x_TD), dim=1)
    top = torch.topk(scores, k, dim=1)
    gates = top.values / top.values.sum(1, keepdim=True) if k > 1 else top.values
    T = x_TD.shape[0]
    n = -(-T // E)
    C = max(1, k * int(cf * n)) if cf > 0 else T * k if cf == 0 else max(1, k * int(-cf * n))
    a = layer.a2a_ffn_overlap_degree  # Tutel rounds C up to a multiple of it (for cf < 0, the cap)
    C = -(-C // a) * a
    used, rows = [0] * E, [x_TD.new_zeros(x_TD.shape[1]) for _ in range(T)]
    for kk in range(k):
        for t in range(T):
            e = int(top.indices[t, kk])
            if used[e] < C:
                used[e] += 1
                rows[t] = rows[t] + gates[t, kk] * expert_fn(e, x_TD[t])
    return torch.stack(rows)


def _check_against_reference(layer, x, expert_fn, cf):
    """The layer's output and gradients (input, every parameter) against ``_by_token``."""
    x = x.detach().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    y = layer(x)
    g = torch.randn_like(y)
    got = torch.autograd.grad((y * g).sum(), [x, *params], allow_unused=True)
    want_y = _by_token(layer, x.reshape(-1, x.shape[-1]), expert_fn, cf=cf).view(y.shape)
    want = torch.autograd.grad((want_y * g).sum(), [x, *params], allow_unused=True)
    tol = dict(rtol=1e-4, atol=1e-5) if x.dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(y, want_y, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.zeros(()) if a is None else a, torch.zeros(()) if b is None else b, **tol)


# -- helloworld.py ------------------------------------------------------------------------------


def _helloworld(args: argparse.Namespace, tmp_path=None) -> dict:
    parallel_env = system.init_data_model_parallel(backend="nccl" if args.device == "cuda" else "gloo")
    dist_rank, dist_world_size, dist_print = parallel_env.global_rank, parallel_env.global_size, parallel_env.dist_print
    device = parallel_env.local_device
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        class ExampleModel(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self._moe_layer = tutel_moe.moe_layer(
                    gate_type={"type": "top", "k": args.top, "fp32_gate": args.fp32_gate, "capacity_factor": args.capacity_factor},
                    experts={"type": args.expert_type, "num_experts_per_device": args.num_local_experts,
                             "hidden_size_per_expert": args.hidden_size, "activation_fn": lambda x: F.relu(x)},
                    model_dim=args.model_dim,
                    scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
                    seeds=(1, dist_rank + 1, 1),
                    a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
                    parallel_type=args.parallel_type,
                    use_2dh=args.use_2dh,
                )
                local_count = sum(torch.numel(p) for _, p in self._moe_layer.get_parameter_iterator(param_type="local_experts"))
                shared_count = sum(torch.numel(p) for _, p in self._moe_layer.get_parameter_iterator(param_type="gate"))
                dist_print("[Statistics] param count for MoE local_experts = %s, param count for MoE gate = %s.\n" % (local_count, shared_count))
                self.counts = (local_count, shared_count)

            def forward(self, input):
                if args.megablocks_size > 0:
                    result = self._moe_layer(input, megablocks_size=args.megablocks_size)
                else:
                    result = self._moe_layer(input)
                return F.log_softmax(torch.sum(result, dim=2), dim=1)

        model = ExampleModel().to(device)
        if args.checkpoint_path:
            checkpoint_path = system.apply_rank_size_from_pattern(args.checkpoint_path, rank=parallel_env.global_rank,
                                                                  size=parallel_env.global_size)
            model.load_state_dict(torch.load(checkpoint_path))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        torch.manual_seed(0)
        x = torch.tensor(torch.randn([args.batch_size, args.num_tokens, args.model_dim], dtype=torch.float32).numpy(),
                         dtype=torch.get_default_dtype(), requires_grad=False, device=device)
        y = torch.LongTensor(args.batch_size).random_(1).to(device)
        params_for_all_reduce = [p for p in model.parameters() if not hasattr(p, "skip_allreduce") and p.requires_grad]
        losses = []
        for _ in range(args.num_steps):
            t_start = system.record_time()
            if not args.eval:
                optimizer.zero_grad()
                output = model(x)
                loss = F.nll_loss(output, y)
                if args.l_aux_wt:
                    loss += args.l_aux_wt * model._moe_layer.l_aux
                loss.backward()
                if dist_world_size > 1:
                    for p in params_for_all_reduce:
                        p.grad /= dist_world_size
                        p.grad = net.simple_all_reduce(p.grad)
                optimizer.step()
            else:
                with torch.no_grad():
                    output = model(x)
                    loss = F.nll_loss(output, y)
            assert system.record_time() >= t_start
            losses.append(float(loss.data))
        num_global_experts = tutel_moe.moe_layer.global_expert_count(args.num_local_experts,
                                                                      group=system.get_local_session().model_group)
        return dict(model=model, x=x, losses=losses, num_global_experts=num_global_experts,
                    params_for_all_reduce=params_for_all_reduce)
    finally:
        torch.set_default_dtype(previous_dtype)


def _ffn_expert(ex):
    return lambda e, v: F.relu(v @ ex.batched_fc1_w[e].t() + ex.batched_fc1_bias[e]) @ ex.batched_fc2_w[e] + ex.batched_fc2_bias[e]


def _llama_expert(ex):
    Hh = ex.hidden
    return lambda e, v: (F.relu(v @ ex.w_in[e, :, :Hh]) * (v @ ex.w_in[e, :, Hh:])) @ ex.w_out[e]


HELLOWORLD = [  # the flags people run helloworld with (README / examples/README)
    dict(),
    dict(top=1, capacity_factor=0.5, l_aux_wt=0.01),
    dict(num_local_experts=4, capacity_factor=0.5, a2a_ffn_overlap_degree=3),  # drops; C rounded up to 3s
    dict(capacity_factor=0.0, dtype="float64"),  # dMoE (dropless)
    dict(num_local_experts=4, capacity_factor=-0.5, a2a_ffn_overlap_degree=2),
    dict(expert_type="llama_ffn", fp32_gate=True),
    dict(eval=True, megablocks_size=2, capacity_factor=0.5),
]


@pytest.mark.parametrize("flags", HELLOWORLD)
def test_helloworld(flags):
    args = _args(**flags)
    out = _helloworld(args)
    model, layer = out["model"], out["model"]._moe_layer
    E = args.num_local_experts
    assert out["num_global_experts"] == layer.num_global_experts == E
    local_count, shared_count = model.counts
    D, H = args.model_dim, args.hidden_size
    assert shared_count == D * E
    assert local_count == (E * (D * H * 2 + H + D) if args.expert_type == "ffn" else E * D * H * 3)
    assert all(getattr(p, "skip_allreduce", False) for p in layer.experts.parameters())
    assert [id(p) for p in out["params_for_all_reduce"]] == [id(p) for p in layer.gates[0].parameters()]
    if args.eval:
        assert len(set(out["losses"])) == 1  # no training: the same loss every step
    expert = _ffn_expert(layer.experts) if args.expert_type == "ffn" else _llama_expert(layer.experts)
    layer.train(False)
    _check_against_reference(layer, out["x"], expert, args.capacity_factor)


def test_helloworld_learns_and_restores_its_checkpoint(tmp_path):
    args = _args(num_steps=12, lr=0.5, l_aux_wt=0.01)
    out = _helloworld(args)
    assert out["losses"][-1] < out["losses"][0] * 0.9, out["losses"]
    path = str(tmp_path / "ckpt" / "moe-{rank}-of-{size}.pt")
    saved = system.apply_rank_size_from_pattern(path, rank=0, size=1)
    assert saved.endswith("moe-0-of-1.pt")
    torch.save(out["model"].state_dict(), saved)
    again = _helloworld(_args(num_steps=1, eval=True, checkpoint_path=path))
    with torch.no_grad():
        torch.testing.assert_close(again["model"](out["x"]), out["model"](out["x"]))


# -- helloworld_from_scratch.py -----------------------------------------------------------------


def _helloworld_from_scratch(num_samples=64, model_dim=16, hidden_size=12, steps=10, lr=1e-3):
    dist = system.init_data_model_parallel(backend="gloo")
    num_local_experts = 2
    num_global_experts = num_local_experts * dist.global_size

    class CustomGate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.register_parameter(name="wg", param=torch.nn.Parameter(torch.randn([model_dim, num_global_experts]) * 1e-3))

        def forward(self, x):
            return torch.matmul(x, self.wg)

    class CustomExpert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(dist.global_rank + 1)
            self.register_parameter(name="batched_fc1_w", param=torch.nn.Parameter(torch.randn([num_local_experts, model_dim, hidden_size]) * 1e-3))
            self.register_parameter(name="batched_fc2_w", param=torch.nn.Parameter(torch.randn([num_local_experts, hidden_size, model_dim]) * 1e-3))
            self.register_parameter(name="batched_fc1_bias", param=torch.nn.Parameter(torch.zeros([num_local_experts, 1, hidden_size])))
            self.register_parameter(name="batched_fc2_bias", param=torch.nn.Parameter(torch.zeros([num_local_experts, 1, model_dim])))
            for x in self.parameters():
                setattr(x, "skip_allreduce", True)

        def forward(self, x):
            y = torch.add(torch.matmul(x, self.batched_fc1_w), self.batched_fc1_bias)
            y = F.relu(y)
            return torch.add(torch.matmul(y, self.batched_fc2_w), self.batched_fc2_bias)

    class CustomMoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = CustomGate()
            self.expert = CustomExpert()

        def forward(self, x, k=2):
            logits = self.gate(x)
            scores = F.softmax(logits, dim=-1)
            crit, l_aux = moe.top_k_routing(scores, top_k=k)
            y = moe.fast_encode(x, crit)
            y = net.all_to_all(y, 1, 0)
            y = self.expert(y)
            y = net.all_to_all(y, 0, 1)
            output = moe.fast_decode(y, crit)
            return output, l_aux

    model = CustomMoE().to(dist.local_device)
    torch.manual_seed(dist.global_rank + 1)
    data = torch.randn([num_samples, model_dim], device=dist.local_device)
    label = torch.LongTensor(num_samples).random_(1).to(dist.local_device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    first = [t.detach().clone() for t in model(data)]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        result, l_aux = model(data)
        result = F.log_softmax(result, dim=1)
        loss = F.nll_loss(result, label) + 0.0001 * l_aux
        loss.backward()
        for p in model.parameters():
            if not hasattr(p, "skip_allreduce"):
                p.grad = net.simple_all_reduce(p.grad)
        optimizer.step()
        losses.append(float(loss.detach()))
    return dict(model=model, data=data, first=first, losses=losses, world=dist.global_size)


def test_helloworld_from_scratch():
    out = _helloworld_from_scratch(lr=20.0)
    assert out["losses"][-1] < out["losses"][0], out["losses"]
    # step 0 against the routing written out (C = 2 * int(1.0 * 32) = 64: nothing dropped)
    torch.manual_seed(1)
    wg = torch.randn([16, 2]) * 1e-3
    torch.manual_seed(1)
    w1, w2 = torch.randn([2, 16, 12]) * 1e-3, torch.randn([2, 12, 16]) * 1e-3
    x = out["data"]
    scores = torch.softmax(x @ wg, dim=-1)
    top = torch.topk(scores, 2, dim=1)
    g = top.values / top.values.sum(1, keepdim=True)
    want = sum(g[:, j : j + 1] * torch.stack([F.relu(x[t] @ w1[top.indices[t, j]]) @ w2[top.indices[t, j]]
                                              for t in range(x.shape[0])]) for j in range(2))
    y0, l_aux0 = out["first"]
    torch.testing.assert_close(y0, want, rtol=1e-4, atol=1e-9)
    top1 = F.one_hot(top.indices[:, 0], 2).float()
    torch.testing.assert_close(l_aux0, 2 * (scores.mean(0) * top1.mean(0)).sum())


def _case_from_scratch(rank: int, world: int) -> None:
    """helloworld_from_scratch on W ranks: each rank routes its own samples to all W*2 experts
    through net.all_to_all; the result must equal one process holding all experts."""
    out = _helloworld_from_scratch(num_samples=24, steps=2)
    model = out["model"]
    x = out["data"].detach().requires_grad_(True)
    y, _ = model(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank))
    (y * g).sum().backward()
    # the whole expert set, gathered from every rank (zero_gather: differentiable all-gather)
    w1 = net.zero_gather(model.expert.batched_fc1_w.detach())
    w2 = net.zero_gather(model.expert.batched_fc2_w.detach())
    b1 = net.zero_gather(model.expert.batched_fc1_bias.detach())
    b2 = net.zero_gather(model.expert.batched_fc2_bias.detach())
    assert w1.shape[0] == 2 * world
    xr = x.detach().clone().requires_grad_(True)
    crit, _ = moe.top_k_routing(F.softmax(model.gate(xr), dim=-1), top_k=2)
    rows = moe.fast_encode(xr, crit)
    rows = torch.add(torch.matmul(F.relu(torch.add(torch.matmul(rows, w1), b1)), w2), b2)
    want = moe.fast_decode(rows, crit)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-7)
    (want * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-7)


CASES = {"from_scratch": _case_from_scratch}


def test_helloworld_from_scratch_on_two_ranks():
    spawn_ranks(2, __name__, "from_scratch")


# -- helloworld_custom_gate_expert.py -----------------------------------------------------------


def _helloworld_custom_gate_expert(model_dim=16, top_value=2, num_local_experts=2, steps=6, lr=1e-5):
    parallel_env = system.init_data_model_parallel(backend="gloo")
    dist_rank = parallel_env.global_rank
    seen = []

    class CustomGate(torch.nn.Module):
        def __init__(self, **custom_options):
            super().__init__()
            for key in custom_options:
                seen.append(("gate", key))
                if key == "top_k":
                    self.top_k = custom_options[key]
                elif key in ("model_dim", "num_global_experts"):
                    setattr(self, key, custom_options[key])
                else:
                    raise Exception(f"Receive an option key `{key}` for CustomGate, but it is not handled")
            self.my_wg = torch.nn.Linear(self.model_dim, self.num_global_experts, bias=False)

        def forward(self, x):
            return self.my_wg(x)

    class CustomExpert(torch.nn.Module):
        def __init__(self, **custom_options):
            super().__init__()
            for key in custom_options:
                seen.append(("expert", key))
                if key in ("model_dim", "num_experts_per_device", "sharded_count"):
                    setattr(self, key, custom_options[key])
                elif key == "my_activ_type":
                    self.activ_type = custom_options[key]
                else:
                    raise Exception(f"Receive an option key `{key}` for CustomExpert, but it is not handled")
            self.W = torch.nn.Parameter(torch.empty(self.num_experts_per_device, model_dim, model_dim))
            self.my_activation = torch.nn.functional.relu if self.activ_type == "relu" else None
            with torch.no_grad():
                self.W.normal_(0, 0.001)

        def forward(self, x, ctx):
            if ctx.sharded_count > 1:
                raise Exception("`sharded_count > 1` is not implemented within this expert, Model parallel is disabled.")
            y = torch.matmul(x, self.W)
            if self.my_activation is not None:
                y = self.my_activation(y)
            return y

    class FullyCustomExampleModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._moe_layer = tutel_moe.moe_layer(
                gate_type={"type": "custom", "module": CustomGate, "top_k": top_value},
                experts={"type": "custom", "module": CustomExpert, "num_experts_per_device": num_local_experts, "my_activ_type": "relu"},
                model_dim=model_dim,
                scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
                seeds=(1, dist_rank + 1, 1),
                a2a_ffn_overlap_degree=1,
            )

        def forward(self, input):
            result = self._moe_layer(input)
            return F.log_softmax(torch.sum(result, dim=2), dim=1)

    model = FullyCustomExampleModel().to(parallel_env.local_device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(0)
    x = torch.randn([4, 8, model_dim])
    y = torch.LongTensor(4).random_(1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return dict(model=model, x=x, losses=losses, seen=seen)


def test_helloworld_custom_gate_expert():
    out = _helloworld_custom_gate_expert()
    assert sorted(out["seen"]) == sorted([("gate", "model_dim"), ("gate", "num_global_experts"), ("gate", "top_k"),
                                          ("expert", "model_dim"), ("expert", "num_experts_per_device"),
                                          ("expert", "sharded_count"), ("expert", "my_activ_type")])
    layer = out["model"]._moe_layer
    assert layer.top_k == 2 and layer.gate_specs[0].capacity_factor == 1.0
    assert all(getattr(p, "skip_allreduce", False) for p in layer.experts.parameters())
    assert not any(hasattr(p, "skip_allreduce") for p in layer.gates[0].parameters())
    W = layer.experts.module.W
    with torch.no_grad():
        W.mul_(1000.0)  # away from 0, so the relu and the routing both matter
    _check_against_reference(layer, out["x"], lambda e, v: F.relu(v @ W[e]), 1.0)
    learner = _helloworld_custom_gate_expert(lr=5.0, steps=10)
    assert learner["losses"][-1] < learner["losses"][0], learner["losses"]


# -- helloworld_custom_expert_sharded.py ---------------------------------------------------------


class CustomExpertDemo(torch.nn.Module):
    def _create_sharded_param(self, *full_shape, **kwargs):
        full_shape = torch.Size(full_shape)
        sharded_shape = (full_shape.numel() + self.sharded_count - 1) // self.sharded_count
        return torch.nn.Parameter(torch.empty(sharded_shape, **kwargs)), full_shape

    def _get_gathered_param(self, param, full_shape, parent_group):
        sharded_group = net.create_groups_from_world(group_count=-self.sharded_count, parent_group=parent_group).model_group
        return net.zero_gather(param, group=sharded_group).view(-1).narrow(0, 0, full_shape.numel()).view(full_shape)

    def __init__(self, model_dim, local_experts, sharded_count, my_config):
        super().__init__()
        self.sharded_count = sharded_count
        self.W, self.W_full_shape = self._create_sharded_param(local_experts, model_dim, model_dim)
        self.my_activation = torch.nn.functional.relu if my_config == "relu" else None
        with torch.no_grad():
            self.W.normal_(0, 0.001)

    def forward(self, x, ctx):
        W_full = self._get_gathered_param(self.W, self.W_full_shape, ctx.group)
        y = torch.matmul(x, W_full)
        if self.my_activation is not None:
            y = self.my_activation(y)
        return y


@pytest.mark.parametrize("my_config,cf", [(None, 1.0), ("relu", 0.5)])
def test_helloworld_custom_expert_sharded(my_config, cf):
    system.init_data_model_parallel(backend="gloo")
    layer = tutel_moe.moe_layer(
        gate_type={"type": "top", "k": 2, "fp32_gate": True, "capacity_factor": cf},
        experts={"type": "custom", "module": CustomExpertDemo, "num_experts_per_device": 2, "my_config": my_config},
        model_dim=16,
        scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
        seeds=(1, 1, 1),
        a2a_ffn_overlap_degree=1,
        use_2dh=False,
    )
    local = sum(p.numel() for _, p in layer.get_parameter_iterator(param_type="local_experts"))
    assert local == 2 * 16 * 16 and layer.experts.module.W.dim() == 1  # one flat (sharded) parameter
    with torch.no_grad():
        layer.experts.module.W.mul_(1000.0)
        layer.router.linear.weight.mul_(4.0)
    W = layer.experts.module.W.view(2, 16, 16)
    act = F.relu if my_config == "relu" else (lambda h: h)
    x = torch.randn(3, 10, 16)
    _check_against_reference(layer, x, lambda e, v: act(v @ W[e]), cf)

"""Before/after check for restructurings: run every layer path on fixed seeds, save the results.

    python tests/tools/path_snapshot.py save OUT.pt        # on the old code
    python tests/tools/path_snapshot.py save NEW.pt        # on the new code
    python tests/tools/path_snapshot.py compare OUT.pt NEW.pt

``save`` runs the single-process layer (every capacity mode and drop policy), the Tutel entry
point, and on 2 and 4 gloo ranks the expert-parallel paths: plain, pipelined (degrees 2, 3),
data, sharded, hybrid:2, a load-aware placement with replicas, hidden-sharded experts, and the
two-level exchange. For each it records the output, the input gradient and every parameter
gradient (fp32, uneven token counts, one empty rank). ``compare`` demands bit equality
(``torch.equal``) for every entry and names the ones that differ. Only the public API is used,
so the script runs unchanged on both sides of a restructuring.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moeflow

D, H = 16, 24
DT = torch.float32


def _layer(E: int, k: int, cf: float, policy: str, weight_at: str, seed: int, **fields) -> moeflow.MoE:  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    layer = moeflow.MoE(
        dim=D, hidden=H, num_experts=E, top_k=k, capacity_factor=cf,
        router=moeflow.RouterConfig(load_balance_coef=0.01),
        dispatch=moeflow.DispatchConfig(drop_policy=policy, weight_at=weight_at),  # type: ignore[arg-type]
        dtype=DT, **fields,
    ).train()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.5)
    return layer


def _record(out: dict, name: str, layer: torch.nn.Module, x: torch.Tensor, call) -> None:  # type: ignore[no-untyped-def]
    x = x.clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    y = call(layer, x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(y.numel() + 3), dtype=torch.float64).to(y.dtype)
    loss = (y * g).sum()
    if isinstance(layer, moeflow.MoE) and layer.aux_losses:
        loss = loss + layer.aux_loss()
    loss.backward()
    out[f"{name}/y"] = y.detach().clone()
    out[f"{name}/x.grad"] = x.grad.clone()
    for pname, p in layer.named_parameters():
        out[f"{name}/{pname}.grad"] = torch.zeros_like(p) if p.grad is None else p.grad.clone()


def _inputs(tokens: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t, D, generator=gen, dtype=torch.float64).to(DT) for t in tokens]


CONFIGS = [(2, 1.0, "position", "combine"), (1, 0.5, "bpr", "dispatch"), (2, 0.0, "position", "combine"),
           (2, -0.8, "score", "combine"), (2, 1.25, "score", "dispatch")]


def single(out: dict) -> None:
    for i, (k, cf, policy, weight_at) in enumerate(CONFIGS):
        layer = _layer(8, k, cf, policy, weight_at, seed=10 + i, num_shared_experts=1)
        (x,) = _inputs([37], seed=20 + i)
        _record(out, f"local/{i}", layer, x, lambda m, v: m(v))
        _record(out, f"local/{i}/cf0", layer, x, lambda m, v: m(v, capacity_factor=0.0))
    from moeflow.compat.tutel import moe as tutel_moe

    for i, (bpr, post, k) in enumerate([(False, True, 2), (True, True, 2), (True, False, 2), (False, False, 1)]):
        torch.manual_seed(30 + i)
        layer = tutel_moe.moe_layer(
            gate_type={"type": "top", "k": k, "capacity_factor": 1.0, "gate_noise": 0.0},
            model_dim=D, experts={"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": H},
            batch_prioritized_routing=bpr, is_postscore=post,
        )
        (x,) = _inputs([29], seed=40 + i)
        _record(out, f"tutel/{i}", layer, x, lambda m, v: m(v))


def _worker(rank: int, world: int, store: str, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    from moeflow.parallel import apply_placement, expert_parallel, make_groups, plan_placement

    out: dict[str, torch.Tensor] = {}
    try:
        for i, (k, cf, policy, weight_at) in enumerate(CONFIGS):
            tokens = [9 + 4 * r for r in range(world)]
            tokens[-1] = 0 if i == 1 else tokens[-1]
            x = _inputs(tokens, seed=50 + i)[rank]
            layer = _layer(8, k, cf, policy, weight_at, seed=60 + i, num_shared_experts=1)
            ep = expert_parallel(layer)
            runs = [("expert", 1), ("expert", 2), ("expert", 3), ("data", 1), ("sharded", 1), ("hybrid:2", 1)]
            for mode, degree in runs:
                _record(out, f"ep/{i}/{mode}/{degree}", ep, x,
                        lambda m, v, mode=mode, degree=degree: m(v, parallel=mode, overlap_degree=degree))
            # load-aware placement with replicas (3 slots per rank: 8 experts + replicas)
            placed = expert_parallel(_layer(8, k, cf, policy, weight_at, seed=60 + i, num_shared_experts=1))
            load_E = [50.0, 3.0, 9.0, 1.0, 30.0, 2.0, 7.0, 4.0]  # skewed: hot experts get replicas
            plan = plan_placement(load_E, world=world, slots_per_rank=8 // world + 1)
            assert max(plan.num_replicas) > 1
            apply_placement(placed, [plan])
            for degree in (1, 2):
                _record(out, f"placed/{i}/{degree}", placed, x,
                        lambda m, v, degree=degree: m(v, overlap_degree=degree))
            _record(out, f"placed/{i}/data", placed, x, lambda m, v: m(v, parallel="data"))
            # hidden-sharded experts: E = W experts, each split into 2 hidden slices on 2 ranks
            hs = expert_parallel(_layer(world, k if k <= world else 1, cf, policy, weight_at, seed=70 + i),
                                 hidden_shards=2)
            for degree in (1, 2):
                _record(out, f"hidden/{i}/{degree}", hs, x, lambda m, v, degree=degree: m(v, overlap_degree=degree))
            if world == 4:
                hier = make_groups(world, node_size=2).hierarchy
                two = expert_parallel(_layer(8, k, cf, policy, weight_at, seed=80 + i), hierarchy=hier)
                for degree in (1, 2):
                    _record(out, f"2level/{i}/{degree}", two, x,
                            lambda m, v, degree=degree: m(v, overlap_degree=degree))
        torch.save(out, f"{path}.rank{rank}")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def save(path: str) -> None:
    out: dict[str, torch.Tensor] = {}
    single(out)
    for world in (2, 4):
        store = os.path.join(tempfile.mkdtemp(prefix="snap-"), "store")
        mp.start_processes(_worker, args=(world, store, f"{path}.w{world}"), nprocs=world, start_method="spawn")
        for r in range(world):
            part = torch.load(f"{path}.w{world}.rank{r}")
            out.update({f"w{world}/rank{r}/{k}": v for k, v in part.items()})
            os.remove(f"{path}.w{world}.rank{r}")
    torch.save(out, path)
    print(f"saved {len(out)} tensors to {path}")


def compare(a: str, b: str) -> int:
    old, new = torch.load(a), torch.load(b)
    missing = sorted(set(old) ^ set(new))
    differ = [k for k in sorted(set(old) & set(new)) if old[k].shape != new[k].shape or not torch.equal(old[k], new[k])]
    print(f"{len(set(old) & set(new))} tensors in both, {len(differ)} differ, {len(missing)} in one only")
    for k in missing[:20]:
        print("  only in one:", k)
    for k in differ[:40]:
        d = (old[k].double() - new[k].double()).abs().max().item() if old[k].shape == new[k].shape else "shape"
        print("  differs:", k, d)
    return 1 if differ or missing else 0


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        sys.exit(compare(sys.argv[2], sys.argv[3]))

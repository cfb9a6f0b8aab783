"""Vocabulary-parallel embedding, output projection and cross-entropy on 2 and 4 gloo
ranks against the unsplit modules on the concatenated batch (fp64), alone and inside MoEGPT."""

from __future__ import annotations

import copy
import shutil
import tempfile

import pytest
import torch
import torch.nn.functional as F

import moeflow
from moeflow.checkpoint import load_checkpoint, save_checkpoint
from moeflow.models import GPTConfig, MoEGPT, VocabParallelEmbedding, VocabParallelHead, vocab_parallel
from moeflow.parallel import (
    all_reduce_gradients,
    clip_grad_norm_,
    dense_parameters,
    expert_parallel,
    gather_vocab_weight,
    vocab_range,
)
from moeflow.parallel.vocab import mark_vocab_shard

from helpers import spawn_ranks

pytestmark = pytest.mark.distributed

TOL = dict(rtol=1e-12, atol=1e-12)


def test_vocab_range_covers_the_vocabulary():
    for V in (4, 5, 37, 50):
        for W in (1, 2, 3, 4):
            parts = [vocab_range(V, r, W) for r in range(W)]
            assert parts[0][0] == 0 and sum(c for _, c in parts) == V
            assert all(a + c == b for (a, c), (b, _) in zip(parts, parts[1:]))
            assert max(c for _, c in parts) - min(c for _, c in parts) <= 1


def test_mark_vocab_shard_tags_where_the_rows_start_and_the_whole_tables_rows():
    """The tags the gradients, checkpoints and DCP read (``moeflow_vocab_start`` places the
    slice in the whole table, ``moeflow_vocab_size`` is that table's rows: DCP's shard spec and
    its guard read it), on the parameter itself, which is returned."""
    gen = torch.Generator().manual_seed(5)
    V = int(torch.randint(8, 100, (1,), generator=gen))
    start, count = vocab_range(V, 1, 3)
    p = torch.nn.Parameter(torch.randn(count, 4, generator=gen))
    assert mark_vocab_shard(p, start, V) is p
    assert (p.moeflow_vocab_shard, p.moeflow_vocab_start, p.moeflow_vocab_size) == (True, start, V)


def _case_modules(rank: int, world: int) -> None:
    V, D = 37, 6  # V not a multiple of the world size
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64)
    tokens = [5 + 3 * r for r in range(world)]
    tokens[-1] = 0  # a rank without tokens
    ids = [torch.randint(0, V, (t,), generator=gen) for t in tokens]
    targets = [torch.randint(0, V, (t,), generator=gen) for t in tokens]
    hs = [torch.randn(t, D, generator=gen, dtype=torch.float64) for t in tokens]
    gs = [torch.randn(t, D, generator=gen, dtype=torch.float64) for t in tokens]
    first = sum(tokens[:rank])
    sl = slice(first, first + tokens[rank])
    start, count = vocab_range(V, rank, world)

    # embedding: values and the shard's gradient
    ref = torch.nn.Embedding(V, D, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(weight)
    (ref(torch.cat(ids)) * torch.cat(gs)).sum().backward()
    emb = VocabParallelEmbedding(weight, None)
    out = emb(ids[rank])
    (out * gs[rank]).sum().backward()
    torch.testing.assert_close(out, ref(torch.cat(ids))[sl].detach(), **TOL)
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad[start : start + count], **TOL)
    torch.testing.assert_close(gather_vocab_weight(emb.weight.detach()), weight, rtol=0, atol=0)

    # tied head: per-token losses, input and weight gradients
    w_ref = weight.clone().requires_grad_(True)
    h_all = torch.cat(hs).requires_grad_(True)
    loss_ref = F.cross_entropy(h_all @ w_ref.t(), torch.cat(targets), reduction="none")
    loss_ref.sum().backward()
    head = VocabParallelHead(torch.nn.Parameter(weight[start : start + count].clone()), vocab_size=V)
    h = hs[rank].clone().requires_grad_(True)
    loss = head.cross_entropy(h, targets[rank])
    loss.sum().backward()
    torch.testing.assert_close(loss, loss_ref[sl].detach(), **TOL)
    torch.testing.assert_close(h.grad, h_all.grad[sl], **TOL)
    torch.testing.assert_close(head.weight.grad, w_ref.grad[start : start + count], **TOL)
    # full logits for sampling
    torch.testing.assert_close(head(hs[rank]), hs[rank] @ weight.t(), **TOL)

    with pytest.raises(ValueError, match=r"ids must lie in \[0, 37\)"):
        emb(torch.tensor([0, 37]))


def _gpt(tied: bool) -> MoEGPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=41, dim=16, n_layers=2, n_heads=2, max_seq_len=8, num_experts=4, top_k=2,
                    expert_hidden=12, tie_embeddings=tied, router=moeflow.RouterConfig(load_balance_coef=0.0))
    return MoEGPT(cfg, dtype=torch.float64)


def _case_gpt(rank: int, world: int) -> None:
    """MoEGPT with experts and vocabulary split over the group equals the unsplit model."""
    for tied in (True, False):
        model = _gpt(tied)
        gen = torch.Generator().manual_seed(10)
        B, S = 2, 8
        idx = [torch.randint(0, 41, (B, S), generator=gen) for _ in range(world)]
        tgt = [torch.randint(0, 41, (B, S), generator=gen) for _ in range(world)]
        ref = copy.deepcopy(model)
        # (no balance loss: it depends on each rank's batch statistics, not on the vocabulary split)
        loss_ref = ref.loss(torch.cat(idx), torch.cat(tgt))
        loss_ref.backward()
        ref_norm = torch.sqrt(sum(p.grad.double().square().sum() for p in ref.parameters()))

        par = vocab_parallel(expert_parallel(copy.deepcopy(model)))
        assert (par.lm_head.weight is par.embed.weight) == tied
        loss = par.loss(idx[rank], tgt[rank])
        (loss / world).backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        torch.testing.assert_close(total / world, ref.loss(torch.cat(idx), torch.cat(tgt)).detach(), **TOL)
        all_reduce_gradients(dense_parameters(par), None, average=False)
        ref_params = dict(ref.named_parameters())
        start, count = vocab_range(41, rank, world)
        for name, p in par.named_parameters():
            expected = ref_params[name].grad
            if name in ("embed.weight", "lm_head.weight"):
                expected = expected[start : start + count]
            elif getattr(p, "moeflow_expert", False):
                e = 4 // world
                expected = expected[rank * e : (rank + 1) * e]
            torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"tied={tied} {name}: {m}")
        norm = clip_grad_norm_(par, 1e9)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-12, atol=0)
        # checkpoints hold the unsplit table and optimizer state; they load into split models
        opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
        opt.step()
        root = [tempfile.mkdtemp(prefix="moeflow-vocab-") if rank == 0 else None]
        torch.distributed.broadcast_object_list(root)
        save_checkpoint(root[0], 1, par, opt)
        again = vocab_parallel(expert_parallel(_gpt(tied)))
        opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
        load_checkpoint(root[0], again, opt2)
        for (name, p), q in zip(par.named_parameters(), again.parameters()):
            assert torch.equal(p, q), name
            assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"]), name
        plain = _gpt(tied)
        load_checkpoint(root[0], plain)  # the unsplit model reads the same files
        torch.testing.assert_close(plain.embed.weight[start : start + count], par.embed.weight, rtol=0, atol=0)
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(root[0])


def _case_collectives(rank: int, world: int) -> None:
    """The collectives alone against the unsplit computation, on 2 ranks over the world and on
    4 over two groups of 2 ranks with different data per group (a collective over the world
    instead of the group shows): token counts, ``gather_tokens`` of ``[T, 2, 3]`` rows and its
    gradient under a different upstream gradient on each rank, ``sum_to_owners``, a rank without
    tokens; the per-token cross-entropy from split logits and its gradient (a different upstream
    gradient on each rank) at vocabularies with more columns than ranks, one column a rank (targets past it on both
    sides) and fewer (a rank without columns), every vocabulary id a target (so every shard's first and last column),
    logits offset far past where ``exp`` overflows, fp64 and fp32."""
    from moeflow.parallel import make_groups
    from moeflow.parallel.vocab import gather_tokens, group_tokens, sum_to_owners, vocab_cross_entropy

    group, size = (make_groups(2).expert, 2) if world == 4 else (None, world)
    g, me = rank // size, rank % size  # make_groups: groups of consecutive ranks
    gen = torch.Generator().manual_seed(50 + g)  # the same draws on the ranks of a group
    tokens_W = [3 + 2 * r + g for r in range(size)]
    tokens_W[(1 + g) % size] = 0
    N, first = sum(tokens_W), sum(tokens_W[:me])
    mine = slice(first, first + tokens_W[me])
    assert group_tokens(tokens_W[me], group, torch.device("cpu")) == tokens_W
    xs = [torch.randn(t, 2, 3, generator=gen, dtype=torch.float64) for t in tokens_W]
    x = xs[me].clone().requires_grad_(True)
    all_x = gather_tokens(x, tokens_W, group)
    assert torch.equal(all_x, torch.cat(xs))
    ups = [torch.randn(N, 2, 3, generator=gen, dtype=torch.float64) for _ in range(size)]
    all_x.backward(ups[me])
    torch.testing.assert_close(x.grad, sum(ups)[mine], **TOL)
    rows = [torch.randn(N, 2, 3, generator=gen, dtype=torch.float64) for _ in range(size)]
    torch.testing.assert_close(sum_to_owners(rows[me], tokens_W, me, group), sum(rows)[mine], **TOL)

    for V, dtype in [(11, torch.float64), (size + 1, torch.float32), (size, torch.float64), (size - 1, torch.float64)]:
        tol = TOL if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-4)
        n = 2 * V + 3
        targets = torch.cat([torch.arange(V), torch.randint(0, V, (n - V,), generator=gen)])
        offset = 1000.0 if dtype == torch.float64 else 100.0  # exp overflows past 709 (fp64), 88 (fp32)
        logits = torch.randn(n, V, generator=gen, dtype=dtype) * 3 + offset * torch.rand(n, 1, generator=gen, dtype=dtype)
        start, v = vocab_range(V, me, size)
        z = logits[:, start : start + v].clone().requires_grad_(True)
        loss = vocab_cross_entropy(z, targets, start, group)
        z_ref = logits.clone().requires_grad_(True)
        loss_ref = F.cross_entropy(z_ref, targets, reduction="none")
        torch.testing.assert_close(loss, loss_ref.detach(), **tol, msg=lambda m: f"V={V} {dtype}: {m}")
        up = [torch.randn(n, generator=gen, dtype=dtype) for _ in range(size)]
        loss.backward(up[me])
        loss_ref.backward(sum(up))
        assert z.grad.shape == (n, v)
        torch.testing.assert_close(z.grad, z_ref.grad[:, start : start + v], **tol, msg=lambda m: f"V={V} {dtype}: {m}")


CASES = {"modules": _case_modules, "gpt": _case_gpt, "collectives": _case_collectives}


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_modules_match_unsplit(world):
    spawn_ranks(world, __name__, "modules")


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_gpt_matches_unsplit(world):
    spawn_ranks(world, __name__, "gpt")


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_collectives_match_the_unsplit_computation(world):
    spawn_ranks(world, __name__, "collectives")

"""Tiered expert storage (moeflow.storage): same numbers as the in-memory model, in budget.

Every tier combination (host / disk, ring / cache, synchronous / prefetched, page cache kept /
dropped) must give outputs and gradients ``torch.equal`` to the in-memory model in fp32 (the
store runs the very same expert math), keep the fast tier within its byte budget (counted by
the store), and offloaded AdamW training must end with the same parameters, bit for bit.
"""

from __future__ import annotations

import copy
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch

import moeflow
from moeflow.config import ExpertsConfig, RouterConfig
from moeflow.models import MoEGPT, gpt_config
from moeflow.storage import (
    ExpertStore,
    OffloadedAdamW,
    RingStreamer,
    StorageConfig,
    StoredExperts,
    format_bytes,
    offload_experts,
    parse_bytes,
    slot_bytes,
)
from moeflow.storage.disk import DiskFile

from helpers import assert_offloaded_grads_equal, needs_cuda

pytestmark = pytest.mark.reference

VOCAB = 61


def tiny_gpt(n_layers: int = 4, **overrides: object) -> MoEGPT:
    cfg = gpt_config("tiny", vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=2, num_experts=6, top_k=2,
                     expert_hidden=48, max_seq_len=32, **overrides)
    return MoEGPT(cfg)


def layer_bytes(model: MoEGPT) -> int:
    """Ring-slot bytes of one layer's experts (each tensor padded to a 4096-byte page)."""
    return slot_bytes(moeflow.moe_layers(model)[0].experts)


def expert_bytes(model: MoEGPT) -> int:
    """Unpadded bytes of all expert weights of ``model``."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def tokens(gen: torch.Generator, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("text, expected", [
    ("512MB", 512_000_000), ("512 MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("64k", 64_000),
    ("4096", 4096), (4096, 4096), ("2gb", 2_000_000_000), ("10B", 10),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad, err", [
    ("512XB", ValueError), ("", ValueError), ("MB", ValueError), ("-5MB", ValueError), ("0", ValueError),
    (0.5, TypeError), (True, TypeError), (None, TypeError), ("1e3MB", ValueError),
])
def test_parse_bytes_rejects(bad, err):
    with pytest.raises(err, match="fast_memory"):
        parse_bytes(bad, "fast_memory")


def test_config_validation():
    assert StorageConfig(fast_memory="1MiB").fast_memory == 2**20
    with pytest.raises(ValueError, match="offload"):
        StorageConfig(offload="tape")
    with pytest.raises(ValueError, match="mode"):
        StorageConfig(mode="lru")
    with pytest.raises(ValueError, match="prefetch=2"):
        StorageConfig(ring_slots=2, prefetch=2)
    with pytest.raises(ValueError, match="prefetch"):
        StorageConfig(prefetch=-1)
    with pytest.raises(TypeError, match="ring_slots"):
        StorageConfig(ring_slots=1.0)
    with pytest.raises(ValueError, match="trainable"):
        StorageConfig(mode="cache", trainable=True)
    with pytest.raises(ValueError, match="evict_page_cache"):
        StorageConfig(offload="host", evict_page_cache=True)
    with pytest.raises(ValueError, match="disk_reads='cached' only applies to offload='disk'"):
        StorageConfig(offload="host", disk_reads="cached")
    with pytest.raises(ValueError, match="disk_reads='cached' reads through the page cache .* choose one"):
        StorageConfig(offload="disk", disk_reads="cached", evict_page_cache=True)
    with pytest.raises(ValueError, match="disk_reads"):
        StorageConfig(offload="disk", disk_reads="mmap")
    with pytest.raises(ValueError, match="device"):
        StorageConfig(device="tpu")
    with pytest.raises(ValueError, match="fast_memory"):
        StorageConfig(fast_memory="lots")
    assert format_bytes(3 * 2**20) == "3.0 MiB"


def test_budget_too_small_names_the_numbers():
    model = tiny_gpt()
    lb = layer_bytes(model)
    with pytest.raises(ValueError, match="holds 0 ring slot"):
        offload_experts(copy.deepcopy(model), StorageConfig(fast_memory=lb - 1))
    with pytest.raises(ValueError, match="prefetch=1 needs 2 ring slots"):
        offload_experts(copy.deepcopy(model), StorageConfig(fast_memory=lb, prefetch=1))
    with pytest.raises(ValueError, match="holds no expert"):
        offload_experts(copy.deepcopy(model), StorageConfig(mode="cache", fast_memory=100))
    with pytest.raises(ValueError, match="no MoE layer"):
        offload_experts(torch.nn.Linear(3, 3), StorageConfig())


def test_disk_file_is_safetensors_and_reads_back(tmp_path, gen):
    from safetensors import safe_open

    tensors = {"w": torch.randn(3, 1500, generator=gen), "b": torch.randn(7, generator=gen).bfloat16(),
               "i": torch.randint(0, 9, (5,), generator=gen)}
    f = DiskFile(tmp_path / "t.safetensors", tensors)
    try:
        with safe_open(str(tmp_path / "t.safetensors"), "pt") as g:
            assert all(torch.equal(g.get_tensor(k), v) for k, v in tensors.items())
        for key, t in tensors.items():
            assert torch.equal(f.tensor(key), t)
            assert f.spec(key).is_meta and f.spec(key).shape == t.shape and f.spec(key).dtype == t.dtype
            start, _ = f.byte_range(key)
            assert start % 4096 == 0
        # a block read: aligned start, unaligned length (O_DIRECT for whole pages, then buffered)
        row = torch.empty(1500)
        f.read(row, "w", 1)
        assert torch.equal(row, tensors["w"][1])
        # a block rewritten: read back, checksum renewed (the other blocks keep theirs)
        new = torch.randn(1500, generator=gen)
        f.write(new, "w", 2)
        f.read(row, "w", 2)
        assert torch.equal(row, new) and torch.equal(f.tensor("w")[:2], tensors["w"][:2])
        with pytest.raises(ValueError, match="dst must be"):
            f.read(torch.empty(3), "w", 1)
        with pytest.raises(IndexError, match="block 3"):
            f.byte_range("w", 3)
    finally:
        f.close()


def _random_tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors of every dtype the disk tier stores, in random order and shapes: a 0-d one, a
    first dimension of 0 and of 1, blocks smaller and larger than a page (random bytes)."""
    from moeflow.storage.disk import _DTYPES

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    out = {}
    dtypes = list(_DTYPES.values())
    for i in torch.randperm(len(dtypes), generator=gen).tolist():
        dtype = dtypes[i]
        shape = [(), (0, 3), (1, 5)][i] if i < 3 else (randint(2, 6), *(randint(1, 700) for _ in range(randint(1, 3))))
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        t = (raw & 1).bool().reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape)
        out[f"t{i}.{dtype}".replace("torch.", "")] = t
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (random bytes make NaNs, which ``torch.equal`` calls unequal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_disk_file_layout_blocks_and_checks_on_random_tensors(tmp_path, gen):
    """The disk tier's file, on random tensors of every dtype it stores: any safetensors reader
    gets each tensor back (and the page padding as zero bytes), each tensor starts on a page of
    the file, ``byte_range`` of block ``i`` is row ``i``'s bytes, and ``read``/``write`` move
    exactly those bytes, checked (bytes counted) when ``verify`` and not otherwise."""
    import json
    import struct

    from safetensors import safe_open

    from moeflow.storage import checksum
    from moeflow.storage.disk import DiskTierError
    from moeflow.storage.tiers import aligned_empty

    tensors = _random_tensors(gen)
    for verify in (True, False):
        path = tmp_path / f"v{verify}.safetensors"
        t0 = time.perf_counter()
        f = DiskFile(path, tensors, verify=verify)
        try:
            assert f.checksum == (checksum.ALGORITHM if verify else None) and f.verify is verify
            assert f.keys() == list(tensors)
            blob = path.read_bytes()
            (n,) = struct.unpack("<Q", blob[:8])
            header = json.loads(blob[8 : 8 + n])
            text = blob[8 : 8 + n].decode()
            assert (8 + n) % 4096 == 0 and len(text) - len(text.rstrip(" ")) < 4096  # spaces up to a page
            with safe_open(str(path), "pt") as g:
                assert sorted(g.keys()) == sorted(header)
                for key in g.keys():
                    if key.startswith("__pad__."):
                        assert g.get_tensor(key).dtype == torch.uint8 and not g.get_tensor(key).any()
                    else:
                        assert _same(g.get_tensor(key), tensors[key])
            end = 8 + n
            for key, t in tensors.items():
                a, b = header[key]["data_offsets"]
                assert f.byte_range(key) == (8 + n + a, 8 + n + b) and (8 + n + a) % 4096 == 0
                assert 8 + n + a - end < 4096  # padded to the next page, no further
                end = 8 + n + b
                assert f.spec(key).is_meta and f.spec(key).shape == t.shape and f.spec(key).dtype == t.dtype
                assert _same(f.tensor(key), t)
                rows = t.shape[0] if t.dim() and t.shape[0] else 1
                rb = (b - a) // rows
                for i in range(rows):
                    assert f.byte_range(key, i) == (8 + n + a + i * rb, 8 + n + a + (i + 1) * rb)
                for bad in (-1, rows):
                    with pytest.raises(IndexError, match=rf"block {bad} of '{key}' out of range \[0, {rows}\)"):
                        f.byte_range(key, bad)
                if t.dim() == 0 or t.numel() == 0:
                    continue
                # a block: read into an owned buffer (page-aligned: O_DIRECT for its whole pages)
                for i in (0, int(torch.randint(0, rows, (1,), generator=gen))):  # block 0 starts on a page
                    before = f.verified_bytes
                    buf = aligned_empty(rb, device=torch.device("cpu")).view(t.dtype).view(t.shape[1:])
                    direct = f.read(buf, key, i)
                    assert _same(buf, t[i])
                    aligned = f.direct_io and f.byte_range(key, i)[0] % 4096 == 0
                    assert direct == (rb // 4096 * 4096 if aligned else 0)  # whole pages, where they start on one
                    assert f.verified_bytes - before == (rb if verify else 0)
                    es = t.element_size()
                    unaligned = aligned_empty(rb + es, device=torch.device("cpu"))[es:].view(t.dtype).view(t.shape[1:])
                    assert f.read(unaligned, key, i) == 0 and _same(unaligned, t[i])  # buffered
                # a block rewritten (fresh bytes): read back, alone changed; its checksum renewed
                new = t[(i + 1) % rows].clone() if rows > 1 else t[i].clone()
                f.write(new, key, i)
                expect = t.clone()
                expect[i] = new
                assert _same(f.tensor(key), expect)
                f.write(t.clone(), key)  # the whole tensor rewritten: every checksum renewed
                assert _same(f.tensor(key), t)
            assert 0 <= f.verify_s <= time.perf_counter() - t0 and (f.verify_s > 0) is verify  # seconds spent checking
            assert f.verified_bytes == 0 or verify
            # a bit flipped on disk in the last block of the largest tensor: named when verified
            key = max((k for k in tensors if tensors[k].dim() and tensors[k].numel()), key=lambda k: f.byte_range(k)[1] - f.byte_range(k)[0])
            rows = tensors[key].shape[0]
            a, b = f.byte_range(key, rows - 1)
            with open(path, "r+b") as raw:
                raw.seek(b - 1)
                byte = raw.read(1)[0]
                raw.seek(b - 1)
                raw.write(bytes([byte ^ 0x80]))
            if verify:
                with pytest.raises(DiskTierError, match=rf"block {re.escape(key)}\[{rows - 1}\] .*checksum mismatch") as info:
                    f.tensor(key)
                assert info.value.index == rows - 1 and info.value.key == key
            else:
                got = f.tensor(key)
                assert not _same(got, tensors[key])
        finally:
            f.close()
            f.close()  # idempotent
        with pytest.raises(RuntimeError, match="is closed"):
            f.tensor(next(iter(tensors)))


def test_disk_file_continues_short_reads_and_writes_and_names_what_is_wrong(tmp_path, monkeypatch, gen):
    """The system may move fewer bytes than asked (``preadv``/``pwritev`` return a count): the
    tier continues from where each call stopped, down to a byte a call, and moves the same bytes;
    a call that moves nothing is a short read or write (``OSError``). Wrong buffers are refused
    naming the argument; a whole tensor cut short by a truncation names the tensor."""
    from moeflow.storage.disk import DiskTierError
    from moeflow.storage.tiers import aligned_empty

    tensors = {"w": torch.randn(3, 2500, generator=gen), "b": torch.randn(3, 5, generator=gen)}
    f = DiskFile(tmp_path / "t.safetensors", tensors)
    real_read, real_write = os.preadv, os.pwritev
    def short(real):  # type: ignore[no-untyped-def]
        sizes = iter([1] + torch.randint(1, 9000, (10_000,), generator=gen).tolist())  # a byte first

        def call(fd, buffers, offset):  # type: ignore[no-untyped-def]
            (view,) = buffers
            n = next(sizes)
            if fd == f._direct_fd:
                n = -(-n // 4096) * 4096  # O_DIRECT moves whole pages
            return real(fd, [view[: min(len(view), n)]], offset)
        return call

    try:
        monkeypatch.setattr(os, "preadv", short(real_read))
        monkeypatch.setattr(os, "pwritev", short(real_write))
        new = torch.randn(3, 2500, generator=gen)
        f.write(new[1].clone(), "w", 1)
        f.write(new[2].clone(), "w", 2)
        page = aligned_empty(30004, device=torch.device("cpu"))
        for buf in (page[4:], page[:-4]):  # buffered (a byte first), then O_DIRECT for the whole pages
            monkeypatch.setattr(os, "preadv", short(real_read))
            f.read(buf.view(torch.float32).view(3, 2500), "w")
            assert torch.equal(buf.view(torch.float32).view(3, 2500), torch.cat([tensors["w"][:1], new[1:]]))
        calls = [0]

        def nothing(fd, buffers, offset):  # type: ignore[no-untyped-def]
            calls[0] += 1
            assert calls[0] < 100, "a read that moves nothing is retried forever"
            return 0

        monkeypatch.setattr(os, "preadv", nothing)
        for buf, where in ((torch.empty(5), f.byte_range("b", 1)), (page[:-4], f.byte_range("w"))):  # buffered, direct
            calls[0] = 0
            with pytest.raises(OSError, match=f"short read at byte {where[0]} "):
                f.read_into(buf, *where)
        monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset: 0)
        with pytest.raises(OSError, match="short write at byte"):
            f.write(torch.randn(5, generator=gen), "b", 1)
        monkeypatch.setattr(os, "preadv", real_read)
        monkeypatch.setattr(os, "pwritev", real_write)
        with pytest.raises(ValueError, match="src must be a contiguous host tensor of 20 bytes, got 16 bytes"):
            f.write(torch.randn(4, generator=gen), "b", 1)
        with pytest.raises(ValueError, match="dst must be a contiguous host tensor of 20 bytes, got 40 bytes"):
            f.read(torch.empty(10), "b", 1)
        with pytest.raises(ValueError, match="dst must be"):  # right size, not contiguous
            f.read(torch.empty(10)[::2], "b", 1)
        # a read that fails: a DiskTierError naming the block if the file shrank under it, the
        # system's own error otherwise
        def failing(fd, buffers, offset):  # type: ignore[no-untyped-def]
            raise OSError("injected")

        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(OSError, match="^injected$") as info:
            f.read(torch.empty(2500), "w", 1)
        assert not isinstance(info.value, DiskTierError)

        def shrinking(fd, buffers, offset):  # type: ignore[no-untyped-def]
            os.truncate(f.path, f.byte_range("w", 1)[0])
            return real_read(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", shrinking)
        with pytest.raises(DiskTierError, match=r"block w\[1\] \(expert 1\): short read: the file is now \d+ bytes, "
                                                r"the block ends at byte \d+") as info:
            f.read(torch.empty(2500), "w", 1)
        assert info.value.index == 1 and info.value.__cause__ is not None
        monkeypatch.setattr(os, "preadv", real_read)
        os.truncate(f.path, f.byte_range("b")[0] + 4)
        with pytest.raises(DiskTierError, match=r"block b \(all experts\): the file is \d+ bytes") as info:
            f.tensor("b")
        assert info.value.index is None and info.value.key == "b"
    finally:
        f.close()


def test_disk_file_removes_only_its_own_file(tmp_path, gen):
    """``remove`` deletes the file this ``DiskFile`` wrote, and leaves a file moved over its
    path since (someone else's); ``owns_path`` says which is the case, False once the path is
    gone. ``create`` leaves no file behind when writing fails."""
    tensors = {"w": torch.randn(2, 3, generator=gen)}
    mine = DiskFile.create(tmp_path, "mine-", tensors)
    assert mine.path.parent == tmp_path and mine.path.name.startswith("mine-") and mine.owns_path()
    mine.remove()
    assert not mine.path.exists() and not mine.owns_path()
    replaced = DiskFile.create(tmp_path, "replaced-", tensors)
    other = tmp_path / "other"
    other.write_bytes(b"someone else's")
    os.replace(other, replaced.path)
    assert not replaced.owns_path()
    assert torch.equal(replaced.tensor("w"), tensors["w"])  # the store reads the inode it wrote
    replaced.remove()
    assert replaced.path.read_bytes() == b"someone else's"
    gone = DiskFile.create(tmp_path, "gone-", tensors)
    gone.path.unlink()
    assert not gone.owns_path()
    gone.remove()
    with pytest.raises(TypeError, match="does not store"):
        DiskFile.create(tmp_path, "bad-", {"ok": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex64)})
    for flag in ("verify", "direct"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            DiskFile.create(tmp_path, "bad-", tensors, **{flag: 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [replaced.path.name]


# ------------------------------------------------------------------------------------------ inference

COMBOS = [
    dict(offload="host", mode="ring", prefetch=0),
    dict(offload="host", mode="ring", prefetch=1),
    dict(offload="disk", mode="ring", prefetch=1),
    dict(offload="disk", mode="ring", prefetch=2, evict_page_cache=True),
    dict(offload="host", mode="cache", prefetch=0),
    dict(offload="disk", mode="cache", prefetch=1),
    dict(offload="disk", mode="cache", prefetch=1, evict_page_cache=True),
    dict(offload="disk", mode="cache", prefetch=1, disk_reads="cached"),
    dict(offload="disk", mode="ring", prefetch=1, disk_reads="cached"),
]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("capacity_factor", [0.0, 1.25])
def test_inference_equals_in_memory(combo, capacity_factor, gen):
    """Outputs identical to the in-memory model over several calls (ring wraps around, cache
    hits and evicts), expert weights 4x the fast budget, the budget never exceeded."""
    ring = combo["mode"] == "ring"
    slots = combo["prefetch"] + 1
    model = tiny_gpt(n_layers=4 * slots if ring else 5, capacity_factor=capacity_factor).eval()
    lb = layer_bytes(model)
    budget = slots * lb if ring else 6 * slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(fast_memory=budget, **combo))
    try:
        assert sum(p.numel() for p in offloaded.parameters()) < sum(p.numel() for p in model.parameters())
        assert expert_bytes(model) >= 4 * budget
        with torch.no_grad():
            for _ in range(3):
                idx = tokens(gen, batch=1 if not ring else 2, seq=4 if not ring else 12)
                assert torch.equal(offloaded(idx), model(idx))
        s = store.stats
        assert s.peak_fast_bytes <= budget  # cache mode computes on views of its slots: no workspace
        assert s.fast_bytes <= budget
        assert s.bytes_loaded > 0 and s.hits + s.misses > 0
        if store.disk is not None:
            assert s.bytes_from_disk == s.bytes_loaded
            if combo.get("disk_reads") == "cached":
                assert not store.disk.direct_io  # every read buffered (through the page cache)
        if ring and combo["prefetch"]:
            assert s.prefetch_loads > 0 and s.hits > s.misses
    finally:
        store.close()


@pytest.mark.parametrize("activation, bias", [("relu", True), ("geglu", False)])
def test_inference_other_expert_kinds(activation, bias, gen):
    model = tiny_gpt(n_layers=3, experts=ExpertsConfig(activation=activation, bias=bias)).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-zero biases
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(offload="disk", fast_memory=2 * layer_bytes(model)))
    with store, torch.no_grad():
        idx = tokens(gen)
        assert torch.equal(offloaded(idx), model(idx))


def test_layer_alone_and_stored_experts_protocol(gen):
    layer = moeflow.MoE(dim=16, hidden=24, num_experts=4, top_k=2, capacity_factor=0.0)
    offloaded = copy.deepcopy(layer)
    store = offload_experts(offloaded, StorageConfig(fast_memory="1MB"))
    with store:
        assert isinstance(offloaded.experts, StoredExperts) and offloaded.experts.num_experts == 4
        assert isinstance(offloaded.experts, moeflow.experts.Experts)
        x = torch.randn(9, 16, generator=gen)
        with torch.no_grad():
            assert torch.equal(offloaded(x), layer(x))
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.deepcopy(offloaded)
    with pytest.raises(RuntimeError, match="closed"):
        with torch.no_grad():
            offloaded(x)
    with pytest.raises(TypeError, match="GroupedExperts"):
        ExpertStore([torch.nn.Linear(2, 2)], StorageConfig())
    with pytest.raises(ValueError, match="layer must be"):
        StoredExperts(ExpertStore([copy.deepcopy(layer.experts)], StorageConfig()), 3)


def test_ring_holds_whole_model_when_it_fits(gen):
    """With as many slots as layers, the second call loads nothing (all hits)."""
    model = tiny_gpt(n_layers=3).eval()
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(fast_memory=3 * layer_bytes(model), prefetch=1))
    with store, torch.no_grad():
        assert store.num_slots == 3
        offloaded(tokens(gen))
        loaded = store.stats.bytes_loaded
        idx = tokens(gen)
        assert torch.equal(offloaded(idx), model(idx))
        assert store.stats.bytes_loaded == loaded


def test_cache_fetches_only_selected_experts(gen):
    """Decoding one token: only the K selected experts of each layer are loaded; the same token
    again finds them in the LRU cache."""
    model = tiny_gpt(n_layers=4).eval()
    K = 2
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(mode="cache", offload="disk", fast_memory=10 * per_expert))
    with store, torch.no_grad():
        assert store.cache_slots == 10
        idx = tokens(gen, batch=1, seq=1)
        assert torch.equal(offloaded(idx), model(idx))
        assert store.stats.misses == 4 * K and store.stats.hits == 0
        assert store.stats.bytes_loaded == 4 * K * store.layers[0].expert_nbytes
        store.reset_stats()
        assert torch.equal(offloaded(idx), model(idx))
        assert store.stats.misses == 0 and store.stats.hit_rate == 1.0 and store.stats.bytes_loaded == 0


def test_cache_routing_aware_prefetch_beats_lru_thrashing(gen):
    """4 layers x 2 experts cycle through a cache of 6: plain LRU evicts each expert just
    before it is needed again (every request misses); prefetching layer l+1's last choice
    while layer l computes turns every request after the first call into a hit."""
    model = tiny_gpt(n_layers=4).eval()
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    idx = tokens(gen, batch=1, seq=1)
    rates = {}
    for prefetch in (0, 1):
        offloaded = copy.deepcopy(model)
        store = offload_experts(offloaded, StorageConfig(mode="cache", fast_memory=6 * per_expert, prefetch=prefetch))
        with store, torch.no_grad():
            offloaded(idx)
            store.reset_stats()
            for _ in range(3):
                assert torch.equal(offloaded(idx), model(idx))
            rates[prefetch] = store.stats.hit_rate
            if prefetch:
                assert store.prefetch_hits == store.stats.hits > 0
            assert store.stats.peak_fast_bytes <= 6 * per_expert  # the budget: no gather workspace
    assert rates == {0: 0.0, 1: 1.0}


@pytest.mark.parametrize("capacity_factor", [0.0, 2.0])
def test_cache_prefill_selecting_more_experts_than_slots(capacity_factor, gen):
    """A prefill routes to all 6 experts of a layer; a cache of 4 runs them in chunks."""
    model = tiny_gpt(n_layers=3, capacity_factor=capacity_factor).eval()
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(mode="cache", offload="disk", fast_memory=4 * per_expert))
    with store, torch.no_grad():
        idx = tokens(gen, batch=2, seq=16)
        assert torch.equal(offloaded(idx), model(idx))
        assert store.stats.peak_fast_bytes <= 4 * per_expert  # chunks run on views of the slots
        with pytest.raises(RuntimeError, match="selected 5 experts but the cache holds 4"):
            store.acquire_experts(0, [0, 1, 2, 3, 4])


def test_cache_mode_is_inference_only(gen):
    model = tiny_gpt(n_layers=2)
    store = offload_experts(model, StorageConfig(mode="cache", fast_memory="1MB"))
    with store, pytest.raises(RuntimeError, match="inference-only"):
        model.loss(tokens(gen), tokens(gen))


# ------------------------------------------------------------------------------------------ training


@pytest.mark.parametrize("offload, evict", [("host", False), ("disk", False), ("disk", True)])
def test_gradients_equal_in_memory(offload, evict, gen):
    model = tiny_gpt(n_layers=4)
    offloaded = copy.deepcopy(model)
    lb = layer_bytes(model)
    budget = 3 * lb  # 2 ring slots + one layer of gradients
    store = offload_experts(offloaded, StorageConfig(offload=offload, fast_memory=budget, prefetch=1, trainable=True,
                                                     evict_page_cache=evict))
    with store:
        assert_offloaded_grads_equal(model, offloaded, store, tokens(gen), tokens(gen))
        assert store.stats.peak_fast_bytes <= budget
        assert store.num_slots == 2


def test_gradient_accumulation_equals_in_memory(gen):
    """Two micro-batches per step: the host accumulators sum like ``p.grad`` does."""
    model = tiny_gpt(n_layers=3)
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(offload="disk", fast_memory=3 * layer_bytes(model), trainable=True))
    with store:
        for _ in range(2):
            idx, tgt = tokens(gen), tokens(gen)
            for m in (model, offloaded):
                ((m.loss(idx, tgt) + moeflow.aux_loss(m)) / 2).backward()
        store.wait_grads()
        for i, layer in enumerate(moeflow.moe_layers(model)):
            for name, p in layer.experts.named_parameters():
                assert torch.equal(store.grads[i][name], p.grad), (i, name)


@pytest.mark.parametrize("offload, evict", [("host", False), ("disk", True)])
def test_offloaded_adamw_training_equals_in_memory(offload, evict, gen):
    model = tiny_gpt(n_layers=3, router=RouterConfig(scoring="topk_softmax", load_balance_coef=0.01))
    offloaded = copy.deepcopy(model)
    lb = layer_bytes(model)
    store = offload_experts(offloaded, StorageConfig(offload=offload, fast_memory=3 * lb, prefetch=1, trainable=True,
                                                     evict_page_cache=evict))
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(model.parameters(), **hyper)
    opt_dense = torch.optim.AdamW(offloaded.parameters(), **hyper)
    opt_experts = OffloadedAdamW(store, **hyper)
    with store:
        for _ in range(3):
            idx, tgt = tokens(gen), tokens(gen)
            for m, opts in ((model, [opt_ref]), (offloaded, [opt_dense, opt_experts])):
                (m.loss(idx, tgt) + moeflow.aux_loss(m)).backward()
                if m is offloaded and offload == "disk":
                    # prefetch across kinds: the backward's first finished layer (the last one)
                    # already streams its weights and moments in for the update
                    assert list(opt_experts._loads) == [2]
                for o in opts:
                    o.step()
                    o.zero_grad()
        dense_ref = dict(model.named_parameters())
        for name, p in offloaded.named_parameters():
            assert torch.equal(p, dense_ref[name]), name
        for i, layer in enumerate(moeflow.moe_layers(model)):
            weights = store.layer_weights(i)
            for name, p in layer.experts.named_parameters():
                assert torch.equal(weights[name], p), (i, name)
        # the trained weights are what the next forward uses
        with torch.no_grad():
            idx = tokens(gen)
            assert torch.equal(offloaded(idx), model(idx))
        if offload == "disk":
            assert store.stats.bytes_written_back > 0
        assert store.stats.peak_fast_bytes <= 3 * lb
        opt_experts.close()


@pytest.mark.parametrize("prefetch", [1, 2])
def test_offloaded_adamw_steps_twice_on_one_gradient_and_counts_its_bytes(prefetch, gen):
    """Two steps without ``zero_grad`` between them step twice on the same gradients, as
    ``torch.optim.AdamW`` does (bit for bit, random hyper-parameters; on the disk tier the
    second step finds nothing streaming in and reads every layer's state itself, ``prefetch``
    layers ahead); each step reads (``bytes_from_disk``) and writes back
    (``bytes_written_back``) every layer's weights and both moments, once. A backward undone by
    ``zero_grad`` steps nothing (the state it started streaming in is dropped)."""
    lr, b1, b2, eps, wd = (float(v) for v in torch.rand(5, generator=gen))
    hyper = dict(lr=1e-3 + 1e-2 * lr, betas=(0.8 + 0.1 * b1, 0.9 + 0.09 * b2), eps=1e-8 + 1e-6 * eps,
                 weight_decay=0.2 * wd)
    model = tiny_gpt(n_layers=3)
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(offload="disk", fast_memory=(prefetch + 2) * layer_bytes(model),
                                                     trainable=True, prefetch=prefetch))
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    opt_ref = torch.optim.AdamW(experts.values(), **hyper)
    opt = OffloadedAdamW(store, **hyper)
    with store:
        idx, tgt = tokens(gen), tokens(gen)
        (offloaded.loss(idx, tgt) + moeflow.aux_loss(offloaded)).backward()
        assert len(opt._loads) == prefetch  # (the state streaming in, which the step drops)
        opt.zero_grad()
        offloaded.zero_grad()
        opt.step()
        store.reset_stats()
        idx, tgt = tokens(gen), tokens(gen)
        for m in (model, offloaded):
            (m.loss(idx, tgt) + moeflow.aux_loss(m)).backward()  # (the state starts streaming in here)
        for step in range(2):
            opt_ref.step()
            opt.step()
            s = store.stats  # the ring's loads and gradients, then the optimizer's state
            assert s.bytes_from_disk - s.bytes_loaded == 3 * expert_bytes(model)
            assert s.bytes_written_back == (3 if step else 4) * expert_bytes(model)
            store.reset_stats()
        for i, layer in enumerate(moeflow.moe_layers(model)):
            weights = store.layer_weights(i)
            for name, p in layer.experts.named_parameters():
                assert torch.equal(weights[name], p), (i, name)
        opt.close()


def test_offloaded_adamw_validation():
    model = tiny_gpt(n_layers=2)
    store = offload_experts(model, StorageConfig(fast_memory="1MB"))
    with store:
        with pytest.raises(ValueError, match="trainable=True"):
            OffloadedAdamW(store)
    store = offload_experts(tiny_gpt(n_layers=2), StorageConfig(fast_memory="1MB", trainable=True))
    with store:
        with pytest.raises(ValueError, match="lr"):
            OffloadedAdamW(store, lr=-1.0)
        with pytest.raises(ValueError, match="betas"):
            OffloadedAdamW(store, betas=(0.9, 1.5))
    with pytest.raises(TypeError, match="store"):
        OffloadedAdamW(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ CLI, bench


def test_cli_infer_runs_and_matches(tmp_path, capsys):
    import json

    from moeflow.cli.main import main

    for mode, memory in (("ring", "6.5MiB"), ("cache", "2MiB")):
        path = tmp_path / f"{mode}.json"
        rc = main(["infer", "--preset", "tiny", "--vocab-size", "64", "--layers", "4", "--offload", "disk",
                   "--mode", mode, "--fast-memory", memory, "--batch-size", "1", "--seq-len", "6", "--new-tokens", "2",
                   "--compare", "--threads", "1", "--json", str(path)])
        assert rc == 0
        report = json.loads(path.read_text())
        assert report["identical"] is True
        assert report["stats"]["bytes_loaded"] > 0
        assert report["stats"]["peak_fast_bytes"] <= parse_bytes(memory)
    capsys.readouterr()
    assert main(["infer", "--preset", "tiny", "--fast-memory", "1kB"]) == 2
    assert "fast_memory=1000 B holds 0 ring slot" in capsys.readouterr().err
    assert main(["infer", "--fast-memory", "12XB"]) == 2
    assert "unknown unit 'XB'" in capsys.readouterr().err


def _exit_status(argv: list[str]) -> int:
    """``moeflow`` run in-process; argparse's refusals exit (SystemExit), the handlers return."""
    from moeflow.cli.main import main

    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code)


@pytest.mark.parametrize("argv, says", [
    (["--seq-len", "100000"], "--seq-len 100000 is longer than the model's context (max_seq_len="),
    (["--seed", "-1"], "argument --seed: must be >= 0"),
    (["--threads", "0"], "argument --threads: must be >= 1"),
    (["--new-tokens", "-1"], "argument --new-tokens: must be >= 0"),
])
def test_cli_infer_refuses_before_work(argv, says, private_tmp, capsys):
    """Refused with one line and status 2, before any store is built (no experts file)."""
    rc = _exit_status(["infer", "--preset", "tiny", "--vocab-size", "64", "--layers", "2", "--new-tokens", "1", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0], (rc, err)
    assert _leftovers(private_tmp) == []


def test_cli_infer_from_checkpoint(tmp_path):
    """A `moeflow train`-style checkpoint is rebuilt, offloaded and run; same output as loaded."""
    import json

    from moeflow.checkpoint import save_checkpoint
    from moeflow.cli.main import main
    from moeflow.train.lm import MODEL_FAMILY

    model = tiny_gpt(n_layers=4)
    extra = {"family": MODEL_FAMILY, "model": model.config.to_dict(), "dtype": "float32", "tokenizer": None}
    path = save_checkpoint(tmp_path / "ck", 0, model, extra=extra)
    budget = 2 * layer_bytes(model)
    rc = main(["infer", str(path), "--offload", "disk", "--fast-memory", str(budget), "--seq-len", "5",
               "--new-tokens", "2", "--compare", "--threads", "1", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["identical"] is True and report["model"].startswith("checkpoint")
    assert report["stats"]["peak_fast_bytes"] <= budget


def test_storage_bench_main(tmp_path, monkeypatch, capsys):
    """``python -m bench.storage`` runs the benchmark (shrunk here to test sizes) and refuses a bad
    configuration with one line and status 2."""
    import dataclasses
    import json

    import bench.storage as storage_bench

    real = storage_bench.run_storage_bench
    small = dict(dim=32, hidden=64, experts=4, heads=2, seq_len=16, repeats=1, balanced_tokens=16, compute_factor=2.0)
    monkeypatch.setattr(storage_bench, "run_storage_bench",
                        lambda cfg, progress: real(dataclasses.replace(cfg, **small), progress))
    assert storage_bench.main(["--layers", "8", "--json", str(tmp_path / "b.json")]) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["config"]["n_layers"] == 8 and report["config"]["threads"] == 1
    assert all(r["identical"] for r in report["regimes"])
    capsys.readouterr()
    assert storage_bench.main(["--layers", "3"]) == 2
    assert "n_layers must be >= 4" in capsys.readouterr().err


def test_storage_bench_small():
    from bench.storage import StorageBenchConfig, format_storage_report, run_storage_bench

    cfg = StorageBenchConfig(n_layers=8, dim=32, hidden=64, experts=4, heads=2, seq_len=16, repeats=1,
                             threads=1, balanced_tokens=16, compute_factor=2.0)
    report = run_storage_bench(cfg)
    assert report["expert_bytes"] >= 4 * report["fast_budget"]
    assert [r["regime"] for r in report["regimes"]] == ["balanced", "compute-bound"]
    assert all(r["identical"] for r in report["regimes"])
    # checked and unchecked rings side by side; the checks' own time per forward is counted
    assert report["checksum"] in report["checksum_gb_per_s"]
    for r in report["regimes"]:
        assert r["sync_unchecked_s"] > 0 and r["prefetch_unchecked_s"] > 0 and r["verify_s"] > 0
        assert r["sync_bytes_loaded"] == r["sync_unchecked_bytes_loaded"]
    text = format_storage_report(report)
    assert "sync/pref" in text and "checksum cost" in text
    with pytest.raises(ValueError, match="n_layers"):
        StorageBenchConfig(n_layers=3)


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("offload, mode", [("host", "ring"), ("disk", "ring"), ("disk", "cache")])
def test_gpu_inference_equals_in_memory(offload, mode):
    gen = torch.Generator().manual_seed(0)
    model = tiny_gpt(n_layers=4).cuda().eval()
    offloaded = copy.deepcopy(model)
    lb = layer_bytes(model)
    store = offload_experts(offloaded, StorageConfig(offload=offload, mode=mode, device="cuda",
                                                     fast_memory=2 * lb if mode == "ring" else lb))
    with store, torch.no_grad():
        assert store.layers[0].home["w_in"].is_pinned() or offload == "disk"
        for _ in range(3):
            idx = tokens(gen, batch=1, seq=4).cuda()
            if mode == "ring":  # same shapes, same kernels: same bits
                assert torch.equal(offloaded(idx), model(idx))
            else:  # the cache runs a subset of experts: cuBLAS may pick another kernel for it
                torch.testing.assert_close(offloaded(idx), model(idx), rtol=1e-5, atol=1e-6)
        assert store.stats.peak_fast_bytes <= 2 * lb


@pytest.mark.gpu
@needs_cuda
def test_gpu_offloaded_training_equals_in_memory():
    gen = torch.Generator().manual_seed(0)
    model = tiny_gpt(n_layers=3).cuda()
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(offload="host", device="cuda", trainable=True,
                                                     fast_memory=3 * layer_bytes(model)))
    hyper = dict(lr=3e-3, weight_decay=0.1)
    opt_ref, opt_dense = torch.optim.AdamW(model.parameters(), **hyper), torch.optim.AdamW(offloaded.parameters(), **hyper)
    opt_experts = OffloadedAdamW(store, **hyper)
    with store:
        for _ in range(2):
            idx, tgt = tokens(gen).cuda(), tokens(gen).cuda()
            for m, opts in ((model, [opt_ref]), (offloaded, [opt_dense, opt_experts])):
                (m.loss(idx, tgt) + moeflow.aux_loss(m)).backward()
                for o in opts:
                    o.step()
                    o.zero_grad()
        for i, layer in enumerate(moeflow.moe_layers(model)):
            weights = store.layer_weights(i)
            for name, p in layer.experts.named_parameters():
                # host AdamW vs CUDA AdamW: same formula, different hardware rounding, which Adam's
                # g / sqrt(v) amplifies where a gradient is near eps (an H100: 1.2e-6 on one of 18432
                # weights); atol 1e-5 is 0.3% of one step (lr 3e-3), far below a missed update
                torch.testing.assert_close(weights[name], p.cpu(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ failures, lifetime


def _fail_reads(monkeypatch, at: set[int]) -> list[int]:
    """Make the disk tier's ``read_into`` calls numbered ``at`` (0-based) raise ``OSError``;
    returns the running call counter."""
    real = DiskFile.read_into
    calls = [0]

    def read_into(self, dst, start, end):  # type: ignore[no-untyped-def]
        n = calls[0]
        calls[0] += 1
        if n in at:
            raise OSError(f"injected read failure #{n}")
        return real(self, dst, start, end)

    monkeypatch.setattr(DiskFile, "read_into", read_into)
    return calls


@pytest.mark.parametrize("fail_at", [0, 3, 7])
@pytest.mark.parametrize("mode", ["ring", "cache"])
def test_failed_load_is_not_used_later(mode, fail_at, monkeypatch, gen):
    """One failed disk read (on demand, or of a prefetch): that forward raises, the store is not
    left holding the garbage slot (cache) or a busy, failed slot (ring), the next forwards equal
    the in-memory model."""
    model = tiny_gpt(n_layers=4).eval()
    offloaded = copy.deepcopy(model)
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    budget = 2 * layer_bytes(model) if mode == "ring" else 6 * per_expert
    store = offload_experts(offloaded, StorageConfig(offload="disk", mode=mode, fast_memory=budget, prefetch=1))
    with store, torch.no_grad():
        idx = tokens(gen, batch=1, seq=1 if mode == "cache" else 6)
        if mode == "cache":  # warm the routing-aware prefetch, so a later read can be a prefetch's
            assert torch.equal(offloaded(idx), model(idx))
        _fail_reads(monkeypatch, {fail_at})
        failed = False
        for _ in range(3):  # the failure surfaces in one of these (a prefetch's: when needed)
            try:
                out = offloaded(idx)
            except OSError as err:
                assert "injected" in str(err)
                failed = True
                continue
            assert torch.equal(out, model(idx))
        assert failed
        for _ in range(2):
            idx = tokens(gen, batch=1, seq=1 if mode == "cache" else 6)
            assert torch.equal(offloaded(idx), model(idx))
        if mode == "ring":
            assert not any(store._slot_busy)
        else:  # the failed load's slot was given back: the whole cache still takes one call's experts
            assert store._prefetched <= set(store._cache)  # (a prefetch hit is a hit on a prefetch's load)
            store.release_workspace(store.acquire_experts(0, list(range(store.cache_slots)), prefetch=False))
            store.reset_stats()
            store.release_workspace(store.acquire_experts(0, list(range(store.cache_slots)), prefetch=False))
            assert store.stats.hits == store.cache_slots and store.stats.misses == 0


def test_cache_a_failed_prefetch_is_no_prefetch_hit_later(monkeypatch, gen):
    """A prefetch that failed while another load's failure was being raised is forgotten with
    its slot: the expert loaded on demand afterwards is a plain hit, not a hit on a prefetch
    (``prefetch_hits`` counts only hits on loads the prefetch made); the prefetch that did not
    fail is one."""
    model = tiny_gpt(n_layers=2).eval()
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    store = offload_experts(copy.deepcopy(model), StorageConfig(offload="disk", mode="cache", fast_memory=6 * per_expert,
                                                                prefetch=1))
    reads = len(store.layers[0].names)  # one read per tensor of an expert
    try:
        store.release_workspace(store.acquire_experts(1, [0, 1]))  # layer 1's choice, to be prefetched
        store.invalidate()
        # layer 0 loads experts 2, 3 (reads 0 .. 2r-1), then prefetches layer 1's 0 and 1: 0's
        # first read fails; then expert 4 on demand fails, and raises both
        _fail_reads(monkeypatch, {2 * reads, 4 * reads})
        store.release_workspace(store.acquire_experts(0, [2, 3]))
        with pytest.raises(OSError, match=f"injected read failure #{4 * reads}") as info:
            store.acquire_experts(0, [4], prefetch=False)
        assert any(f"injected read failure #{2 * reads}" in n for n in info.value.__notes__)
        store.reset_stats()
        for _ in range(2):
            store.release_workspace(store.acquire_experts(1, [0], prefetch=False))
        assert store.stats.misses == 1 and store.stats.hits == 1 and store.prefetch_hits == 0
        store.release_workspace(store.acquire_experts(1, [1], prefetch=False))
        assert store.prefetch_hits == 1
    finally:
        store.close()


def test_failed_prefetch_nobody_waits_for_is_raised_by_close(monkeypatch, gen):
    model = tiny_gpt(n_layers=4).eval()
    store = offload_experts(copy.deepcopy(model), StorageConfig(offload="disk", fast_memory=2 * layer_bytes(model)))
    _fail_reads(monkeypatch, {3})  # 2 reads per layer: layer 1's (prefetched) second tensor
    store.acquire(0)
    store.release(0)
    with pytest.raises(RuntimeError, match="nobody waited") as info:
        store.close()
    assert "injected" in str(info.value.__cause__)
    assert store._closed


def test_close_after_a_reported_load_failure_does_not_raise_it_again(monkeypatch, gen):
    """Ring, prefetch 1: layer 1's load fails and ``acquire(1)`` raises it; layer 2's prefetch,
    queued behind it in the same call, fails too. The caller was told (the second failure is a
    note on the first), so ``close`` raises nothing; the slot of the failed prefetch is
    forgotten (read again, and fails again, when asked for)."""
    model = tiny_gpt(n_layers=4).eval()
    store = offload_experts(copy.deepcopy(model), StorageConfig(offload="disk", fast_memory=2 * layer_bytes(model)))
    # 2 reads per layer: acquire(0) reads layer 0 (0, 1) and prefetches layer 1 (2, 3); acquire(1)
    # prefetches layer 2 (4, 5) into the slot layer 0 left, then waits for layer 1
    calls = _fail_reads(monkeypatch, {3, 5})
    try:
        store.acquire(0)
        store.release(0)
        with pytest.raises(OSError, match="injected read failure #3") as info:
            store.acquire(1)
        assert any("injected read failure #5" in note for note in info.value.__notes__)
        assert calls[0] == 6 and store._loading == {} and store._orphans == []
        assert 2 not in store._layer_slot and not any(store._slot_busy)
    finally:
        store.close()  # raises nothing: both failures were reported
    assert store._closed


def test_cache_failures_of_one_call_are_reported_once(monkeypatch, gen):
    """Cache: three experts of one call, the first and the third fail; the call raises the first
    with the third as a note, keeps the second (loaded fine), and ``close`` raises nothing."""
    model = tiny_gpt(n_layers=2).eval()
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    store = offload_experts(copy.deepcopy(model), StorageConfig(offload="disk", mode="cache", fast_memory=4 * per_expert,
                                                                prefetch=0))
    _fail_reads(monkeypatch, {0, 4})  # 2 reads per expert: experts 0 (0, 1), 1 (2, 3), 2 (4, 5)
    try:
        with pytest.raises(OSError, match="injected read failure #0") as info:
            store.acquire_experts(0, [0, 1, 2], prefetch=False)
        assert [n for n in info.value.__notes__ if "injected" in n] == [
            "another load of this store failed too: OSError('injected read failure #4')"]
        assert list(store._cache) == [(0, 1)]  # the good load stays; the failed ones are forgotten
        store.release_workspace(store.acquire_experts(0, [1], prefetch=False))
        assert store.stats.hits == 1
    finally:
        store.close()
    assert store._closed


def test_leaving_with_on_an_error_keeps_an_unseen_failure_as_a_note(monkeypatch, gen):
    """A failed prefetch nobody waited for, then another error leaves ``with store:``: that error
    propagates (not the prefetch's), carrying the prefetch's failure as a note, not losing it."""
    model = tiny_gpt(n_layers=4).eval()
    store = offload_experts(copy.deepcopy(model), StorageConfig(offload="disk", fast_memory=2 * layer_bytes(model)))
    _fail_reads(monkeypatch, {3})  # layer 1's (prefetched) second tensor
    with pytest.raises(KeyError, match="elsewhere") as info:
        with store:
            store.acquire(0)
            store.release(0)
            raise KeyError("elsewhere")
    assert any("nobody waited" in n and "injected read failure #3" in n for n in info.value.__notes__)
    assert store._closed


def test_training_with_frozen_dense_part_still_trains_experts(gen):
    """Only experts and routers trainable (frozen embeddings/attention): the experts' input
    does not require grad, yet every expert gradient equals the in-memory one."""
    model = tiny_gpt(n_layers=3)
    for name, p in model.named_parameters():
        p.requires_grad_(".experts." in name or ".router." in name)
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(offload="disk", fast_memory=3 * layer_bytes(model),
                                                     trainable=True))
    with store:
        idx, tgt = tokens(gen), tokens(gen)
        for m in (model, offloaded):
            (m.loss(idx, tgt) + moeflow.aux_loss(m)).backward()
        store.wait_grads()
        assert all(store.has_grad)
        for i, layer in enumerate(moeflow.moe_layers(model)):
            for name, p in layer.experts.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0
                assert torch.equal(store.grads[i][name], p.grad), (i, name)
        ref = dict(model.named_parameters())
        for name, p in offloaded.named_parameters():
            if p.requires_grad:
                assert torch.equal(p.grad, ref[name].grad), name


def test_stores_sharing_a_directory_keep_their_own_files(tmp_path, gen):
    models = [tiny_gpt(n_layers=2).eval() for _ in range(2)]
    offloaded = [copy.deepcopy(m) for m in models]
    cfg = StorageConfig(offload="disk", fast_memory="1MB", directory=tmp_path, trainable=True)
    stores = [offload_experts(m, cfg) for m in offloaded]
    opts = [OffloadedAdamW(s) for s in stores]
    try:
        files = {s.disk.path for s in stores} | {o.state_file.path for o in opts}
        assert len(files) == 4 and all(Path(f).parent == tmp_path for f in files)
        with torch.no_grad():
            idx = tokens(gen)
            for m, o in zip(models, offloaded):
                assert torch.equal(o(idx), m(idx))
        for i, (m, s) in enumerate(zip(models, stores)):
            ref = moeflow.moe_layers(m)[0].experts
            assert all(torch.equal(s.layer_weights(0)[n], p) for n, p in ref.named_parameters()), i
    finally:
        for o, s in zip(opts, stores):
            o.close()
            s.close()
    assert list(tmp_path.iterdir()) == []  # the stores' files are removed, the directory is the user's


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """``tempfile``'s default directory redirected to an empty one, to see what is left there."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _leftovers(directory) -> list:
    return sorted(p.name for p in directory.glob("moeflow-experts-*"))


def test_failed_construction_leaves_no_temp_dir(private_tmp, monkeypatch, capsys, gen):
    from moeflow.cli.main import main

    model = tiny_gpt(n_layers=2)
    with pytest.raises(ValueError, match="holds 0 ring slot"):
        offload_experts(copy.deepcopy(model), StorageConfig(offload="disk", fast_memory="1kB"))
    with pytest.raises(ValueError, match="holds no expert"):
        offload_experts(copy.deepcopy(model), StorageConfig(offload="disk", mode="cache", fast_memory=100))
    assert _leftovers(private_tmp) == []

    def boom(self):  # type: ignore[no-untyped-def]
        raise MemoryError("injected")

    with monkeypatch.context() as m:  # failure after the file was written
        m.setattr(RingStreamer, "_allocate_slots", boom)
        with pytest.raises(MemoryError):
            offload_experts(copy.deepcopy(model), StorageConfig(offload="disk", fast_memory="1MB"))
    assert _leftovers(private_tmp) == []
    assert main(["infer", "--preset", "tiny", "--layers", "2", "--fast-memory", "1kB"]) == 2
    assert main(["infer", "--preset", "tiny", "--layers", "2", "--prompt", "hi"]) == 2
    assert "--prompt needs a checkpoint" in capsys.readouterr().err
    assert _leftovers(private_tmp) == []
    # a store that is never closed: its temporary directory goes with it
    import gc

    store = offload_experts(copy.deepcopy(model), StorageConfig(offload="disk", fast_memory="1MB"))
    assert len(_leftovers(private_tmp)) == 1
    store.engine.close()
    del store
    gc.collect()
    assert _leftovers(private_tmp) == []


def test_closed_store_raises_instead_of_reading_unmapped_memory(gen):
    model = tiny_gpt(n_layers=2)
    store = offload_experts(model, StorageConfig(offload="disk", fast_memory="1MB", trainable=True))
    opt = OffloadedAdamW(store)
    store.layer_weights(0)
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.layer_weights(0)
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    with pytest.raises(RuntimeError, match="closed"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="closed"):
        model(tokens(gen))
    opt.close()


def test_state_dict_of_offloaded_model_has_the_expert_weights(gen):
    """``state_dict()`` exports the experts under their in-memory names; loading a state dict
    writes them into the store (and the next forward uses them)."""
    model = tiny_gpt(n_layers=3).eval()
    other = tiny_gpt(n_layers=3).eval()
    for offload in ("host", "disk"):
        offloaded = copy.deepcopy(model)
        store = offload_experts(offloaded, StorageConfig(offload=offload, fast_memory=2 * layer_bytes(model)))
        with store, torch.no_grad():
            ref, got = model.state_dict(), offloaded.state_dict()
            assert list(got) == list(ref)
            assert all(torch.equal(got[k], ref[k]) for k in ref)
            offloaded(tokens(gen))  # slots hold the old weights: loading must invalidate them
            offloaded.load_state_dict(other.state_dict())
            idx = tokens(gen)
            assert torch.equal(offloaded(idx), other(idx))
            with pytest.raises(RuntimeError, match="Missing key"):
                offloaded.load_state_dict({k: v for k, v in ref.items() if not k.endswith("experts.w_in")})


def test_overlap_prefetch_hides_load_time(monkeypatch, gen):
    """Loads (30 ms each, slowed here) overlap compute (40 ms per layer, slowed here) only with
    prefetch: a copy engine that ran jobs synchronously would fail this."""
    import time

    from moeflow.storage import base as store_mod

    real_job, real_compute = store_mod.ExpertStore._copy_job, store_mod.ExpertStore.compute

    def slow_job(self, *args):  # type: ignore[no-untyped-def]
        job = real_job(self, *args)

        def run(stream):  # type: ignore[no-untyped-def]
            time.sleep(0.03)
            return job(stream)

        return run

    def slow_compute(self, *args):  # type: ignore[no-untyped-def]
        time.sleep(0.04)
        return real_compute(self, *args)

    monkeypatch.setattr(store_mod.ExpertStore, "_copy_job", slow_job)
    monkeypatch.setattr(store_mod.ExpertStore, "compute", slow_compute)
    n = 8
    model = tiny_gpt(n_layers=n).eval()
    idx = tokens(gen)
    wall, stall = {}, {}
    for prefetch in (0, 1):
        offloaded = copy.deepcopy(model)
        store = offload_experts(offloaded, StorageConfig(fast_memory=2 * layer_bytes(model), prefetch=prefetch))
        with store, torch.no_grad():
            walls, stalls = [], []
            for _ in range(2):  # the faster of two calls: robust to a busy machine
                store.reset_stats()
                t0 = time.perf_counter()
                out = offloaded(idx)
                walls.append(time.perf_counter() - t0)
                stalls.append(store.stats.stall_s)
                assert torch.equal(out, model(idx))
            wall[prefetch], stall[prefetch] = min(walls), min(stalls)
    # margins: the sleeps are lower bounds, so load only makes stall[0] and the walls longer;
    # with prefetch the expected stall is the first load's, 1/n = 0.125 of stall[0] (asserted
    # 0.35: 2.8x), and the expected saving (n - 1) loads' time (asserted half of it)
    assert stall[0] >= 0.9 * n * 0.03  # every load waited for (a synchronous engine: no stall, fails)
    assert stall[1] <= 0.35 * stall[0]  # at most the first one (the others arrive during compute)
    assert wall[1] <= wall[0] - 0.5 * (n - 1) * 0.03


def test_ignored_options_are_refused():
    with pytest.raises(ValueError, match="ring_slots"):
        StorageConfig(mode="cache", ring_slots=2)
    with pytest.raises(ValueError, match="directory"):
        StorageConfig(offload="host", directory="/tmp/x")
    store = offload_experts(tiny_gpt(n_layers=2), StorageConfig(fast_memory="1MB", trainable=True))
    with store, pytest.raises(TypeError, match="betas"):
        OffloadedAdamW(store, betas=[0.9, 0.99])  # type: ignore[arg-type]


def test_cli_infer_restores_torch_threads(tmp_path):
    from moeflow.cli.main import main

    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    assert main(["infer", "--preset", "tiny", "--vocab-size", "64", "--layers", "2", "--seq-len", "4",
                 "--new-tokens", "1", "--threads", str(want), "--fast-memory", "8MiB"]) == 0
    assert torch.get_num_threads() == before


def test_moeflow_checkpoint_of_offloaded_model_raises(tmp_path):
    """save_checkpoint would silently lack the stored experts: it refuses, naming the way out."""
    from moeflow.checkpoint import save_checkpoint
    from moeflow.models import MoEGPT, gpt_config
    from moeflow.storage import StorageConfig, offload_experts

    torch.manual_seed(0)
    model = MoEGPT(gpt_config("tiny", vocab_size=32, dim=16, n_heads=2, n_layers=2, expert_hidden=16))
    store = offload_experts(model, StorageConfig(offload="host", fast_memory=10**8))
    try:
        with pytest.raises(ValueError, match="ExpertStore"):
            save_checkpoint(tmp_path / "ck", 1, model)
    finally:
        store.close()


_RSS_PROBE = r"""
import ctypes, gc, json, sys, threading, time, os
import torch
torch.set_num_threads(1)
import moeflow
from moeflow.models import MoEGPT, gpt_config
from moeflow.storage import StorageConfig, offload_experts, slot_bytes

PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
libc = ctypes.CDLL("libc.so.6")
def settle():
    gc.collect(); libc.malloc_trim(0)

directory, result = sys.argv[1], sys.argv[2]
settle(); rss0 = rss()
torch.manual_seed(0)
model = MoEGPT(gpt_config("tiny", vocab_size=64, dim=256, n_heads=4, n_layers=16, expert_hidden=512)).eval()
one = slot_bytes(moeflow.moe_layers(model)[0].experts)
expert_bytes = one * len(moeflow.moe_layers(model))
dense_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
settle(); rss_full = rss()
store = offload_experts(model, StorageConfig(offload="disk", fast_memory=2 * one, prefetch=1, directory=directory))
settle(); rss_offloaded = rss()
peak = [rss_offloaded]; stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], rss()); time.sleep(0.0005)
t = threading.Thread(target=sample); t.start()
idx = torch.randint(0, 64, (1, 32))
with torch.no_grad():
    for _ in range(3):
        model(idx)
stop = True; t.join()
with open(result, "w") as f:
    json.dump({"one": one, "expert_bytes": expert_bytes, "dense_bytes": dense_bytes, "rss_full": rss_full - rss0,
               "rss_offloaded": rss_offloaded - rss0, "peak_run": peak[0] - rss0,
               "store_peak": store.stats.peak_fast_bytes, "budget": 2 * one}, f)
store.close()
"""


def test_resident_memory_stays_near_the_budget(tmp_path):
    """Independent of the store's own byte counter: the process's peak resident memory (from
    /proc/self/statm, sampled every 0.5 ms in a fresh process) while a model whose experts are
    8x the fast budget runs from disk stays near dense + budget, far below the whole model."""
    import json
    import subprocess
    import sys

    if not Path("/proc/self/statm").exists():
        pytest.skip("needs /proc/self/statm (Linux)")
    script = tmp_path / "probe.py"
    script.write_text(_RSS_PROBE)
    result = tmp_path / "measured.json"
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(result)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads(result.read_text())
    assert m["expert_bytes"] >= 8 * m["budget"] and m["store_peak"] <= m["budget"]
    assert m["rss_full"] > m["dense_bytes"] + 0.9 * m["expert_bytes"]  # the measurement sees the experts
    slack = 32 * 2**20  # activations, thread stacks, allocator rounding
    assert m["peak_run"] < m["dense_bytes"] + m["budget"] + slack, m
    assert m["peak_run"] < 0.5 * (m["dense_bytes"] + m["expert_bytes"]), m


def test_cache_runs_of_consecutive_slots() -> None:
    """The cache computes each run of consecutive slots as one view of its slabs."""
    from moeflow.storage.cache import _runs

    assert _runs([4, 5, 6, 1, 2]) == [(0, 3), (3, 5)]
    assert _runs([3]) == [(0, 1)]
    assert _runs([2, 1, 0]) == [(0, 1), (1, 2), (2, 3)]
    assert _runs([]) == []


def test_cache_prefetch_backs_off_when_its_guesses_miss(gen) -> None:
    """Routing that changes every call makes every prefetched expert useless: after a warm-up
    of 16 prefetched experts the cache stops prefetching (one call in 8 still probes), so the
    wrong guesses stop costing reads; the cycling case above keeps its full prefetch."""
    model = tiny_gpt(n_layers=2).eval()
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    store = offload_experts(copy.deepcopy(model), StorageConfig(mode="cache", fast_memory=6 * per_expert, prefetch=1))
    with store:
        for call in range(60):
            layer, turn = call % 2, call // 2
            ws = store.acquire_experts(layer, [(2 * turn) % 6, (2 * turn + 1) % 6])  # never last call's choice
            store.release_workspace(ws)
        assert store.prefetch_hits == 0
        assert store.stats.prefetch_loads < 16 + 2 * (60 // 8 + 1)  # not 2 a call: the warm-up, then the probes


def test_cache_prefetch_backs_off_after_16_useless_loads_and_probes_every_8th_call(gen) -> None:
    """Three layers in a cache of two calls' experts: each call prefetches the next layer's last
    choice, which is no longer cached, and the routing never repeats, so no prefetch is used.
    The prefetch loads 16 experts (8 calls of 2), then skips all but every 8th call, for good
    (the counts, halved past 64 loads, still say useless)."""
    model = tiny_gpt(n_layers=3).eval()
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    store = offload_experts(copy.deepcopy(model), StorageConfig(mode="cache", fast_memory=4 * per_expert, prefetch=1))
    shift = int(torch.randint(0, 6, (1,), generator=gen))
    with store:
        loads = []
        for call in range(300):
            layer, turn = call % 3, call // 3
            chosen = [(2 * turn + shift) % 6, (2 * turn + 1 + shift) % 6]  # never the layer's last choice
            store.release_workspace(store.acquire_experts(layer, chosen))
            loads.append(store.stats.prefetch_loads)
        assert store.prefetch_hits == 0
        w = loads.index(16)  # the warm-up: 2 a call from the third call (the first with a last choice)
        assert loads[: w + 1] == [0, 0] + list(range(2, 17, 2))
        probes = [c for c in range(w + 1, 300) if loads[c] > loads[c - 1]]
        assert all(loads[c] - loads[c - 1] == 2 for c in probes)
        assert probes[0] == w + 8 and all(b - a == 8 for a, b in zip(probes, probes[1:])) and probes[-1] > 300 - 9


@pytest.mark.parametrize("group, spell, resume, loads, hits", [(2, 300, 117, 282, 192), (3, 180, 83, 462, 378)])
def test_cache_prefetch_resumes_when_the_routing_settles_as_soon_as_the_halved_counts_allow(
        gen, group, spell, resume, loads, hits) -> None:
    """A useless spell (``spell`` calls, three layers each choosing ``group`` new experts every
    call, in a cache of two calls' experts), then the routing settles (each layer keeps one choice,
    which the next call's prefetch finds evicted and loads again). The probes (every 8th call)
    are now all used, and the prefetch resumes on every call once used loads reach half of the
    issued ones in the counts, which forget the spell by halving both past 64 loads: here on call
    ``resume`` after the routing settled, with ``loads`` prefetch loads and ``hits`` used ones by 200
    calls after it. The figures are the halving rule's (integer halves of both counts, from the
    65th load): halving at 64 or 66, by 3, into fractions, or resetting the used count resume 8
    to 100+ calls earlier or later, or never (the two cases tell every one of them apart)."""
    model = MoEGPT(gpt_config("tiny", vocab_size=VOCAB, dim=32, n_layers=3, n_heads=2, num_experts=3 * group, top_k=2,
                              expert_hidden=48, max_seq_len=32)).eval()  # tiny_gpt's, with 3 groups of experts
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    store = offload_experts(model, StorageConfig(mode="cache", fast_memory=2 * group * per_expert, prefetch=1))
    E, shift = 3 * group, int(torch.randint(0, 3 * group, (1,), generator=gen))
    with store:
        issued = []
        for call in range(spell + 200):
            layer = call % 3
            first = group * (call // 3) if call < spell else group * layer  # settled: each layer its own experts
            store.release_workspace(store.acquire_experts(layer, [(first + i + shift) % E for i in range(group)]))
            issued.append(store.stats.prefetch_loads)
        settled = [issued[c] - issued[c - 1] for c in range(spell, spell + 200)]
        assert all(d in (0, group) for d in settled)
        assert [c for c, d in enumerate(settled) if d][:3] != [0, 1, 2]  # backed off when the routing settled
        on = max(c for c, d in enumerate(settled) if not d) + 1  # from here on every call prefetches
        assert (on, store.stats.prefetch_loads, store.prefetch_hits) == (resume, loads, hits)
        probes = [c for c, d in enumerate(settled[:on]) if d]
        assert all(b - a == 8 for a, b in zip(probes, probes[1:]))  # until then only the probes


@pytest.mark.parametrize("reads", ["direct", "cached"])
def test_the_optimizer_state_file_reads_like_the_store(tmp_path, reads) -> None:
    """``disk_reads`` is how the disk tier reads, the AdamW state's file included."""
    model = tiny_gpt(n_layers=2)
    store = offload_experts(model, StorageConfig(offload="disk", fast_memory=3 * layer_bytes(model), trainable=True,
                                                 directory=tmp_path, disk_reads=reads))
    opt = OffloadedAdamW(store)
    try:
        assert opt.state_file.direct_requested is store.disk.direct_requested is (reads == "direct")
        if reads == "cached":
            assert not opt.state_file.direct_io and not store.disk.direct_io
    finally:
        opt.close()
        store.close()

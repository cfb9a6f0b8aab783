"""A damaged disk tier gives a clear error, never a crash (SIGBUS) or a silent wrong result.

The store's experts file is damaged under a live model, after a first forward:

- ``truncate``: cut inside the first expert tensor;
- ``truncate-regrow``: cut there, then grown back to its size (the tail reads as zeros);
- ``bit-flip``: one bit flipped in the middle of every expert block;
- ``rewrite``: the data overwritten in place with random bytes (same size);
- ``replace``: another file (same layout, other bytes) moved over the path;
- ``delete``: the file unlinked.

The first four are damage: the next forward (where it reads the file), ``state_dict()`` and
``moeflow infer`` raise ``DiskTierError`` (an ``OSError``) naming the file, the expert block and
what is wrong. The last two are not: the store keeps the inode it wrote open and reads its own
weights, so outputs and the state dict stay equal to the in-memory model (and ``close`` leaves
the replacement file alone). Each scenario runs in a child process (this file run as a script):
a SIGBUS, as memory-mapped tiers gave, shows as a negative return code, not a dead pytest.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import moeflow
from moeflow.models import MoEGPT, gpt_config
from moeflow.storage import OffloadedAdamW, StorageConfig, offload_experts, slot_bytes
from moeflow.storage import checksum
from moeflow.storage.disk import DiskFile, DiskTierError

from helpers import assert_offloaded_grads_equal

VOCAB = 61
DAMAGE = ("truncate", "truncate-regrow", "bit-flip", "rewrite")  # must raise DiskTierError
HARMLESS = ("replace", "delete")  # the store reads the inode it wrote: right answers
# variant -> (StorageConfig fields, damages tried); without checksums a regrown file's zeros and
# flipped bits cannot be seen (that is the opt-out), a truncation still can
VARIANTS = {
    "ring": (dict(mode="ring", prefetch=1), DAMAGE + HARMLESS),
    "ring-sync": (dict(mode="ring", prefetch=0), DAMAGE + HARMLESS),
    "cache": (dict(mode="cache", prefetch=1), DAMAGE + HARMLESS),
    "ring-unverified": (dict(mode="ring", prefetch=1, verify_checksums=False), ("truncate",) + HARMLESS),
}


def tiny_gpt(n_layers: int = 4) -> MoEGPT:
    cfg = gpt_config("tiny", vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=2, num_experts=6, top_k=2,
                     expert_hidden=48, max_seq_len=32)
    return MoEGPT(cfg)


def budget(model: MoEGPT, fields: dict) -> int:
    experts = moeflow.moe_layers(model)[0].experts
    if fields["mode"] == "cache":
        return 4 * slot_bytes(experts, single=True)
    return (fields["prefetch"] + 1) * slot_bytes(experts)  # fewer slots than layers: every call reads


def damage(disk: DiskFile, kind: str) -> None:
    """Damage ``disk``'s file on disk (not through the ``DiskFile``) the way ``kind`` says."""
    path = disk.path
    size = path.stat().st_size
    first = min(disk.byte_range(k)[0] for k in disk.keys())
    if kind == "truncate":
        os.truncate(path, first + 100)
    elif kind == "truncate-regrow":
        os.truncate(path, first)
        os.truncate(path, size)
    elif kind == "bit-flip":
        with open(path, "r+b") as f:
            for key in disk.keys():
                for row in range(disk.spec(key).shape[0]):
                    a, b = disk.byte_range(key, row)
                    f.seek((a + b) // 2)
                    byte = f.read(1)[0]
                    f.seek((a + b) // 2)
                    f.write(bytes([byte ^ 0x10]))
    elif kind == "rewrite":
        with open(path, "r+b") as f:
            f.seek(first)
            f.write(os.urandom(size - first))
    elif kind == "replace":
        other = path.with_name(path.name + ".new")
        data = bytearray(path.read_bytes())
        for i in range(first, size):
            data[i] ^= 0x5A
        other.write_bytes(bytes(data))
        os.replace(other, path)
    elif kind == "delete":
        path.unlink()
    else:
        raise ValueError(f"unknown damage {kind!r}")


def _outcome(fn) -> dict:  # type: ignore[no-untyped-def]
    try:
        return {"equal": bool(fn())}
    except Exception as err:  # noqa: BLE001 - recorded, judged by the test
        return {"error": type(err).__name__, "oserror": isinstance(err, OSError), "message": str(err)}


def run_scenarios(variant: str, out: Path) -> None:
    """Child process: every damage of ``variant`` on a fresh store; outcomes of a forward, of
    ``state_dict()`` and of ``close()`` after the damage, written to ``out`` after each (a crash
    keeps the rest)."""
    fields, damages = VARIANTS[variant]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = tiny_gpt().eval()
    reference = model.state_dict()
    results: dict = {}
    for kind in damages:
        directory = tempfile.mkdtemp(prefix="moeflow-damage-")
        try:
            offloaded = copy.deepcopy(model)
            store = offload_experts(offloaded, StorageConfig(offload="disk", fast_memory=budget(model, fields),
                                                             directory=directory, **fields))
            path = store.disk.path
            with torch.no_grad():
                idx = torch.randint(0, VOCAB, (2, 8), generator=gen)
                assert torch.equal(offloaded(idx), model(idx))
                damage(store.disk, kind)
                idx = torch.randint(0, VOCAB, (2, 8), generator=gen)  # fresh tokens: other experts
                record = {
                    "forward": _outcome(lambda: torch.equal(offloaded(idx), model(idx))),
                    "state_dict": _outcome(lambda: all(torch.equal(v, reference[k])
                                                       for k, v in offloaded.state_dict().items())),
                }
            record["close"] = _outcome(lambda: store.close() is None)
            record["path"] = str(path)
            record["path_kept"] = path.exists()
            results[kind] = record
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        out.write_text(json.dumps(results))


def run_infer(mode: str, kind: str) -> int:
    """Child process: ``moeflow infer`` whose disk tier is damaged right after it is written."""
    import moeflow.storage as storage
    from moeflow.cli.main import main

    real = storage.offload_experts

    def offload_then_damage(model, config):  # type: ignore[no-untyped-def]
        store = real(model, config)
        damage(store.disk, kind)
        return store

    storage.offload_experts = offload_then_damage
    memory = "6.5MiB" if mode == "ring" else "2MiB"
    return main(["infer", "--preset", "tiny", "--vocab-size", "64", "--layers", "4", "--offload", "disk",
                 "--mode", mode, "--fast-memory", memory, "--batch-size", "1", "--seq-len", "6", "--new-tokens", "2",
                 "--threads", "1"])


def _child(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)


# ------------------------------------------------------------------------------------------ live model


@pytest.mark.reference
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_damaged_tier_under_a_live_model(variant, tmp_path):
    out = tmp_path / "outcomes.json"
    done = _child("scenarios", variant, str(out))
    results = json.loads(out.read_text()) if out.exists() else {}
    assert done.returncode == 0, (f"child died with status {done.returncode} (negative: a signal, e.g. SIGBUS "
                                  f"-7) after {sorted(results)}:\n{done.stderr[-3000:]}")
    fields, damages = VARIANTS[variant]
    assert sorted(results) == sorted(damages)
    for kind, record in results.items():
        for step in ("forward", "state_dict"):
            got = record[step]
            if kind in HARMLESS:
                assert got == {"equal": True}, (kind, step, got)
                continue
            if step == "forward" and got.get("equal") is True and fields["mode"] == "cache":
                continue  # every expert it needed was cached before the damage: right answer, no read
            assert got.get("error") == "DiskTierError" and got["oserror"], (kind, step, got)
            message = got["message"]
            assert record["path"] in message and "block layers." in message, message
            expected = {"checksum mismatch"} if kind in ("bit-flip", "rewrite") else {"truncated"}
            if kind == "truncate-regrow":  # a read (the cache's prefetch) may land between the two
                expected = {"checksum mismatch", "truncated"}
            assert any(e in message for e in expected) or "short read" in message, message
        if kind in HARMLESS or "error" in record["forward"]:
            # nothing failed, or the forward reported it (with the failures of the loads behind
            # it as notes): close has nothing left to raise
            assert record["close"] == {"equal": True}, (kind, record["close"])
        else:  # a forward that read nothing damaged may have left a failed prefetch nobody saw
            assert record["close"] == {"equal": True} or "nobody waited" in record["close"]["message"], record
        if kind == "replace":
            assert record["path_kept"]  # close removed its own (unlinked) file, not the new one


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["truncate", "bit-flip"])
@pytest.mark.parametrize("mode", ["ring", "cache"])
def test_cli_infer_on_a_damaged_tier_is_one_line(mode, kind):
    done = _child("infer", mode, kind)
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith("moeflow infer: error: the disk tier file ") and "is damaged: block layers." in lines[0]


# ------------------------------------------------------------------------------------------ in process


@pytest.mark.reference
def test_disk_file_names_the_damaged_block(tmp_path, gen):
    tensors = {"w": torch.randn(4, 1500, generator=gen), "b": torch.randn(4, 3, generator=gen)}
    f = DiskFile(tmp_path / "t.safetensors", tensors)
    try:
        a, b = f.byte_range("w", 2)
        with open(f.path, "r+b") as raw:
            raw.seek(a + 7)
            byte = raw.read(1)[0]
            raw.seek(a + 7)
            raw.write(bytes([byte ^ 1]))  # one bit of expert 2
        row = torch.empty(1500)
        for i in (0, 1, 3):  # the other blocks still read, checked
            f.read(row, "w", i)
            assert torch.equal(row, tensors["w"][i])
        with pytest.raises(DiskTierError, match=r"block w\[2\] \(expert 2\): .*checksum mismatch") as info:
            f.read(row, "w", 2)
        assert info.value.path == f.path and info.value.key == "w" and info.value.index == 2
        with pytest.raises(DiskTierError, match=r"block w\[2\]"):  # the whole tensor: the bad row named
            f.tensor("w")
        f.write(tensors["w"][2].clone(), "w", 2)  # rewritten through the tier: checksum renewed
        assert torch.equal(f.tensor("w"), tensors["w"])
        os.truncate(f.path, f.byte_range("b")[0] + 4)
        with pytest.raises(DiskTierError, match=r"block b\[1\] .*the file is \d+ bytes but the block ends"):
            f.read(torch.empty(3), "b", 1)
        assert isinstance(DiskTierError(f.path, "b", 1, "x"), OSError)
    finally:
        f.close()


@pytest.mark.reference
@pytest.mark.parametrize("mode", ["ring", "cache"])
def test_checksummed_fast_path_equals_in_memory(mode, monkeypatch, gen):
    """With checksums on (the default), outputs and gradients equal the in-memory model's on
    fresh random inputs, and every block that was read was checked."""
    model = tiny_gpt(n_layers=4)
    fields = dict(mode=mode, prefetch=1)
    calls = [0]
    real = checksum.digest

    def counting(buf):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(buf)

    offloaded = copy.deepcopy(model)
    grads = slot_bytes(moeflow.moe_layers(model)[0].experts) if mode == "ring" else 0  # one layer's gradients
    store = offload_experts(offloaded, StorageConfig(offload="disk", fast_memory=budget(model, fields) + grads,
                                                     trainable=mode == "ring", **fields))
    monkeypatch.setattr(checksum, "digest", counting)
    with store:
        idx, tgt = (torch.randint(0, VOCAB, (2, 8), generator=gen) for _ in range(2))
        if mode == "ring":
            assert_offloaded_grads_equal(model, offloaded, store, idx, tgt)
        else:
            with torch.no_grad():
                assert torch.equal(offloaded(idx), model.eval()(idx))
        store.invalidate()  # a prefetch still in flight is counted in the stats: let it finish its checks
        rows = store.layers[0].num_experts
        per_expert = store.layers[0].expert_nbytes
        tensors = len(store.layers[0].names)
        # ring: a load checks every row of every tensor; cache: one row per tensor per expert
        blocks = store.stats.bytes_from_disk // per_expert * tensors
        assert calls[0] == blocks and blocks >= (rows if mode == "ring" else 1) * tensors


@pytest.mark.reference
def test_load_state_dict_repairs_and_with_keeps_the_first_error(tmp_path, gen):
    """A bit-flipped tier raises from ``with store:`` the damage itself (not the failed prefetch
    behind it); loading a good state dict rewrites the blocks and their checksums."""
    model = tiny_gpt().eval()
    offloaded = copy.deepcopy(model)
    fields = dict(mode="ring", prefetch=1)
    store = offload_experts(offloaded, StorageConfig(offload="disk", fast_memory=budget(model, fields),
                                                     directory=tmp_path, **fields))
    idx = torch.randint(0, VOCAB, (2, 8), generator=gen)
    with torch.no_grad():
        offloaded(idx)
        damage(store.disk, "bit-flip")
        with pytest.raises(DiskTierError, match="checksum mismatch"):
            offloaded(idx)
        offloaded.load_state_dict(model.state_dict())  # (a prefetch of damaged bytes may still be pending)
        assert torch.equal(offloaded(idx), model(idx))
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in offloaded.state_dict().items())
        damage(store.disk, "rewrite")
        with pytest.raises(DiskTierError):
            with store:
                offloaded(idx)
    assert store._closed and list(tmp_path.iterdir()) == []


@pytest.mark.reference
def test_offloaded_adamw_step_on_a_damaged_state_file(gen):
    model = tiny_gpt(n_layers=2)
    store = offload_experts(model, StorageConfig(offload="disk", fast_memory="1MB", trainable=True))
    opt = OffloadedAdamW(store)
    try:
        idx, tgt = (torch.randint(0, VOCAB, (2, 8), generator=gen) for _ in range(2))
        (model.loss(idx, tgt) + moeflow.aux_loss(model)).backward()
        opt.step()  # moments written through the tier: checksums renewed, the next step reads them
        opt.zero_grad()
        (model.loss(idx, tgt) + moeflow.aux_loss(model)).backward()
        damage(opt.state_file, "bit-flip")
        with pytest.raises(DiskTierError, match=r"adamw-state-.*block exp_avg(_sq)?\.\d\.\w+\[\d\]"):
            opt.step()
    finally:
        for close in (opt.close, store.close):
            try:
                close()
            except (OSError, RuntimeError):
                pass


@pytest.mark.unit
def test_verify_checksums_config():
    assert StorageConfig(offload="disk").verify_checksums is True
    with pytest.raises(ValueError, match="verify_checksums=False only applies to offload='disk'"):
        StorageConfig(offload="host", verify_checksums=False)
    with pytest.raises(TypeError, match="verify_checksums"):
        StorageConfig(offload="disk", verify_checksums=1)
    assert checksum.ALGORITHM in checksum.algorithms()


@pytest.mark.unit
def test_checksum_algorithms_are_the_documented_ones(gen):
    """``algorithms()`` holds ``crc32`` (zlib's) always and ``xxh3_64`` (xxhash's) when xxhash
    imports; ``ALGORITHM`` is xxh3_64 then, crc32 otherwise, and ``digest`` computes it. Each
    tells a block from the same block with one bit flipped."""
    import zlib

    data = torch.randint(0, 256, (int(torch.randint(1, 5000, (1,), generator=gen)),), dtype=torch.uint8,
                         generator=gen).numpy().tobytes()
    flipped = bytearray(data)
    flipped[int(torch.randint(0, len(data), (1,), generator=gen))] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
    found = checksum.algorithms()
    try:
        import xxhash
    except ImportError:
        xxhash = None
    assert sorted(found) == (["crc32", "xxh3_64"] if xxhash else ["crc32"])
    assert found["crc32"](data) == zlib.crc32(data)
    if xxhash:
        assert found["xxh3_64"](data) == xxhash.xxh3_64_intdigest(data)
    assert checksum.ALGORITHM == ("xxh3_64" if xxhash else "crc32")
    assert checksum.digest(data) == found[checksum.ALGORITHM](data)
    for f in found.values():
        assert f(data) != f(bytes(flipped))


if __name__ == "__main__":
    if sys.argv[1] == "scenarios":
        run_scenarios(sys.argv[2], Path(sys.argv[3]))
    elif sys.argv[1] == "infer":
        raise SystemExit(run_infer(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} scenarios VARIANT OUT.json | infer MODE DAMAGE")

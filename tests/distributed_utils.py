"""Spawn gloo ranks on 127.0.0.1 for the tier-3 tests; a rank's failure or a hang fails the test."""

from __future__ import annotations

import datetime
import importlib
import os
import shutil
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 240


def _entry(rank: int, world: int, store_file: str, module: str, case: str, errors, args: tuple, done=None) -> None:
    torch.set_num_threads(1)
    # a file rendezvous: no port to pick, so no race with other processes for it
    dist.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=90),
    )
    passed = False
    try:
        getattr(importlib.import_module(module), "CASES")[case](rank, world, *args)
        passed = True
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        try:
            dist.barrier()
            if passed and done is not None:  # the case and the barrier after it passed here
                done.put(rank)
        finally:
            dist.destroy_process_group()


def spawn_ranks(world: int, module: str, case: str, *args: object) -> None:
    """Run ``module.CASES[case](rank, world, *args)`` on ``world`` gloo ranks; fail (never hang) after TIMEOUT_S."""
    ctx = mp.get_context("spawn")
    errors, done = ctx.SimpleQueue(), ctx.SimpleQueue()
    store_dir = tempfile.mkdtemp(prefix="moeflow-rdzv-")
    store_file = os.path.join(store_dir, "store")
    proc = mp.start_processes(
        _entry, args=(world, store_file, module, case, errors, args, done), nprocs=world, join=False, start_method="spawn"
    )
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
    try:
        while not proc.join(timeout=2):
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"{case} on {world} ranks did not finish in {TIMEOUT_S}s")
    except Exception as err:
        for p in proc.processes:
            if p.is_alive():
                p.kill()
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        finished = set()
        while not done.empty():
            finished.add(done.get())
        if not msgs and finished == set(range(world)) and not isinstance(err, TimeoutError):
            # every rank ran the case, its assertions and the closing barrier; a rank then died
            # tearing down (seen rarely on this 2-core VM under load: gloo's "terminate called
            # without an active exception" while the process group is destroyed or at exit).
            # That is not a result of the code under test: report it and pass.
            warnings.warn(f"{case} on {world} ranks: every rank passed, then one died at exit: {err}", stacklevel=2)
            return
        raise AssertionError(f"{case} failed on {world} ranks: {err}\n" + "\n".join(msgs)) from None
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)



"""Launch a module on N local ranks through torchrun (used by the CLI's parallel commands)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

__all__ = ["free_port", "run_torchrun"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    module: str, args: list[str], *, nproc: int, threads: int, stream: bool = False
) -> subprocess.CompletedProcess:
    """Run ``python -m module *args`` on ``nproc`` local ranks (torchrun, rendezvous on
    127.0.0.1) with ``threads`` OpenMP threads each; returns the finished process (output
    captured, or passed through to this process's stdout/stderr with ``stream=True``).
    Raises ``RuntimeError`` (with the tail of the captured output) if it fails."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", module, *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, env=env, capture_output=not stream, text=True)
    if done.returncode != 0 and stream:
        raise RuntimeError(f"torchrun {module} failed (exit {done.returncode}); its output is above")
    if done.returncode != 0:
        raise RuntimeError(f"torchrun {module} failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done

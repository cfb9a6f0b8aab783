"""What the benchmarks share: where the repository and the results are, and the environment a
benchmark's child process needs to import both ``moeflow`` and ``bench`` from this checkout."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REPO", "RESULTS", "child_env"]

REPO = Path(__file__).resolve().parent.parent  # the checkout: ``moeflow/`` and ``bench/`` side by side
RESULTS = REPO / "bench" / "results"


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the checkout first on ``PYTHONPATH``, so that a
    child started with ``sys.executable -m bench.X`` (or ``-c`` code importing ``bench``) finds
    this checkout's ``bench`` and ``moeflow`` whatever its working directory."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env

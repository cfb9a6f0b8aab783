"""``[torchrun ...] python bench/gpu_overlap.py [...]``: the exchange/GEMM overlap benchmark,
``moeflow.bench.gpu_overlap`` (``kernel_overlap`` re-exported for the tests that load this file)."""
from moeflow.bench.gpu_overlap import kernel_overlap, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())

"""``python bench/gpu_kernels.py [...]``: the GPU kernel benchmark, ``moeflow.bench.gpu_kernels``."""
from moeflow.bench.gpu_kernels import main

if __name__ == "__main__":
    main()

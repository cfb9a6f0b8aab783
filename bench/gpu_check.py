"""``python bench/gpu_check.py [...]``: the GPU acceptance run, ``moeflow.bench.gpu_check``
(``--smoke``: the same stages at tiny shapes on CPU). Runs from a checkout where moeflow is not
installed (a GPU machine's own python3): the checkout goes first on ``sys.path``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeflow.bench.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

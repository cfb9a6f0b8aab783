"""``python -m moeflow.train ARGS`` is ``moeflow train ARGS`` (so ``torchrun ... -m moeflow.train ARGS``
works as well as ``torchrun ... -m moeflow train ARGS``)."""

import sys

from moeflow.cli.main import main

raise SystemExit(main(["train", *sys.argv[1:]]))

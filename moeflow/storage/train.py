"""Deprecated alias of ``moeflow.storage.optimizer`` (renamed: "train" also names the training
loop, ``moeflow.train``). Kept for one release; import ``OffloadedAdamW`` from
``moeflow.storage`` instead."""

import warnings

from moeflow.storage.optimizer import OffloadedAdamW

__all__ = ["OffloadedAdamW"]

warnings.warn("moeflow.storage.train is deprecated and will be removed in the next release: import "
              "OffloadedAdamW from moeflow.storage (or moeflow.storage.optimizer)", DeprecationWarning, stacklevel=2)

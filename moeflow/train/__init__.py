"""Training and sampling for moeflow's models (what ``moeflow train`` / ``generate`` run)."""

from moeflow.train.data import ByteTokenizer, BPETokenizer, CorpusError, load_corpus
from moeflow.train.tokens import TokenStream
from moeflow.train.lm import LMTrainConfig, build_from_checkpoint, train_lm

__all__ = ["LMTrainConfig", "train_lm", "build_from_checkpoint", "load_corpus", "CorpusError",
           "ByteTokenizer", "BPETokenizer", "TokenStream"]

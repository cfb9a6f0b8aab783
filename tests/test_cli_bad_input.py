"""Bad input on the command line, table-driven: every subcommand x missing and garbage files,
nonsense numbers, nan/inf, wrong types, unwritable paths, impossible devices and rank counts.

Each case runs ``moeflow.cli.main.main(argv)`` in this process (argparse's ``SystemExit``
caught) and must end with a non-zero status and exactly one line on stderr that names the
argument (its option, or the field of the config it sets) or the file at fault: no traceback, no ``unexpected error`` (the one line main prints
for a bug), and nothing on stdout, since every argument is checked before any work. The counts
(cases tried / clear errors) are in docs/reliability.md ("Command line").

Placeholders in an argv, filled per case: ``{new}`` a fresh path under the case's own directory
(an ``--out`` that does not exist yet), ``{file}`` an existing regular file, ``{dir}`` an existing
empty directory, ``{missing}`` a path that does not exist, ``{ckpt}`` a complete ``moeflow train``
checkpoint of a tiny model, ``{garbage_ckpt}`` a directory whose index.json is not JSON, ``{hf_*}``
damaged Mixtral directories, ``{tuned_*}`` bad ``--tuned`` files, ``{run}`` a ``moeflow train`` run
at step 2 of the ``_TRAIN`` settings (``{run_no_history}``: without its history.json,
``{run_bad_history}``: with a history.json that is not JSON) for ``--resume``. A refusal of a
setting the user gave must name that flag (``argument --experts:``), not another flag its message
happens to mention (``--config`` for "model config", ``--overwrite`` for a remedy). Every case is small enough that
a check which fails to refuse it still finishes quickly (tiny models, one step).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moeflow.cli.main import main
from moeflow.train.metrics import tensorboard_missing

pytestmark = pytest.mark.e2e

# cheap settings, so that a case a check lets through still ends quickly
# (--device cpu: the same checks on any machine; the --device cases give their own, which wins)
_TRAIN = ["--device", "cpu", "--steps", "1", "--batch-size", "2", "--seq-len", "8", "--eval-batches", "1",
          "--no-progress", "--no-plot", "--sample-tokens", "0"]
_INFER = ["--layers", "1", "--vocab-size", "64", "--seq-len", "4", "--new-tokens", "1"]
_BENCH = ["--tokens", "16", "--dim", "8", "--hidden", "8", "--experts", "2", "--top-k", "1", "--repeats", "1",
          "--warmup", "0", "--no-memory"]
_UNWRITABLE = ("/proc/moeflow-no/x", "/sys/moeflow-no")


def _train(*flags: str) -> list[str]:
    return ["train", "--out", "{new}", *_TRAIN, *flags]


def _resume(*flags: str, out: str = "{run}") -> list[str]:
    """``moeflow train --resume`` of the run in ``out`` (at step 2) with ``flags``."""
    return ["train", "--out", out, *_TRAIN, "--steps", "2", "--resume", *flags]


# a machine without CUDA refuses --device cuda; one with it runs it (only impossible devices are refused there)
_NO_CUDA = not torch.cuda.is_available()


def _bad(flag: str, *values: str, label: str | None = None) -> list[tuple[str, list[str], str]]:
    """A case per value: ``moeflow train <flag> <value>``, whose one line must name ``flag``;
    its id is ``train-<flag>-<value>``, or ``train-<flag>-<label>`` (one value) where the value
    makes a poor id."""
    if label is not None and len(values) != 1:
        raise ValueError(f"label names one value, got {len(values)} values")
    return [(f"train-{flag[2:]}-{label or v}", _train(flag, v), flag) for v in values]


# (id, argv, what the one line must name)
CASES: list[tuple[str, list[str], str]] = [
    ("no-command", [], "command"),
    ("unknown-command", ["nonsense"], "nonsense"),
    ("debug-no-command", ["--debug"], "command"),
    # ---- train: numbers
    *_bad("--lr", "inf", "nan", "-inf", "abc", "0", "-1", "1e400"),
    ("train-lr-equals-minus-inf", _train("--lr=-inf"), "--lr"),
    *_bad("--min-lr", "nan"),
    ("train-min-lr-above-lr", _train("--min-lr", "1"), "lr"),
    *_bad("--grad-clip", "nan", "inf", "0", "-1"),
    *_bad("--weight-decay", "nan", "inf", "-0.1"),
    *_bad("--threads", "0", "-1", "two"),
    *_bad("--steps", "0", "-5", "1.5", "abc"),
    *_bad("--batch-size", "0", "-1", "x"),
    *_bad("--grad-accum", "0"),
    ("train-batch-not-divisible", _train("--batch-size", "3", "--grad-accum", "2"), "--batch-size"),
    *_bad("--seq-len", "0"),
    *_bad("--seq-len", "100000000", label="huge"),
    *_bad("--experts", "0"),
    *_bad("--top-k", "0"),
    *_bad("--top-k", "99", label="above-experts"),
    *_bad("--capacity-factor", "nan"),
    *_bad("--moe-every", "-1", label="negative"),
    *_bad("--load-balance-coef", "nan"),
    *_bad("--warmup", "-1", label="negative"),
    *_bad("--warmup", "5", label="above-steps"),
    *_bad("--log-every", "-1", "x", "1.5"),
    *[case for flag in ("--layers", "--dim", "--heads", "--experts-hidden") for case in _bad(flag, "0", "-1", "x")],
    *_bad("--heads", "5", label="not-dividing-dim"),
    *_bad("--init-from", "{missing}", label="missing"),
    *_bad("--init-from", "{file}", label="file"),
    *_bad("--init-from", "{dir}", label="empty-dir"),
    *_bad("--init-from", "{garbage_ckpt}", label="garbage"),
    ("train-init-from-and-experts", _train("--init-from", "{ckpt}", "--experts", "4"), "--init-from"),
    ("train-init-from-and-layers", _train("--init-from", "{ckpt}", "--layers", "2"), "--init-from"),
    ("train-init-from-seq-len-beyond-context", _train("--init-from", "{ckpt}", "--seq-len", "64"), "--seq-len"),
    # a Hugging Face directory (without a tokenizer: trained on bytes, which its 64 ids cannot hold)
    ("train-init-from-hf-no-tokenizer", _train("--init-from", "{hf_ok}"), "--init-from"),
    ("train-init-from-hf-no-hidden-size", _train("--init-from", "{hf_no_hidden_size}"), "hidden_size"),
    *_bad("--config", "{missing}", label="missing"),
    *_bad("--config", "{dir}", label="dir"),
    *_bad("--config", "{file}", label="not-toml"),
    ("train-config-unknown-key", _train("--config", "{config_unknown}"), "stepz"),
    ("train-config-flag-spelling", _train("--config", "{config_flag_spelling}"), "top-k"),
    ("train-config-bad-number", _train("--config", "{config_nan}"), "lr"),
    ("train-config-bad-type", _train("--config", "{config_steps_text}"), "steps"),
    ("train-config-bad-choice", _train("--config", "{config_bad_choice}"), "preset"),
    ("train-config-bad-switch", _train("--config", "{config_bad_switch}"), "plot"),
    ("train-config-below-range", _train("--config", "{config_eval_every_negative}"), "eval_every"),
    # --tensorboard without the tensorboard package (where it is installed, the flag is fine)
    *([("train-tensorboard-missing", _train("--tensorboard"), "--tensorboard")] if tensorboard_missing() else []),
    *_bad("--eval-every", "-1", label="negative"),
    *_bad("--eval-batches", "0"),
    *_bad("--checkpoint-every", "-1", label="negative"),
    *_bad("--seed", "-1", label="negative"),
    *_bad("--skip-nonfinite", "-1", label="negative"),
    *_bad("--sample-tokens", "-1", label="negative"),
    ("train-bpe-vocab-tiny", _train("--tokenizer", "bpe", "--bpe-vocab", "10"), "--bpe-vocab"),
    *_bad("--stall-timeout", "0", "nan"),
    *_bad("--collective-timeout", "inf"),
    *_bad("--collective-timeout", "-1", label="negative"),
    *_bad("--overlap-degree", "0"),
    *_bad("--overlap-degree", "many", label="word"),
    *_bad("--rebalance-every", "-1", label="negative"),
    # ---- train: choices and contradictions
    *[case for flag in ("--preset", "--tokenizer", "--dtype", "--amp", "--parallel", "--exchange")
      for case in _bad(flag, "nope", label="bad")],
    ("train-unknown-flag", _train("--learning-rate", "1"), "--learning-rate"),
    ("train-val-works-unknown", _train("--val-works", "nope"), "val_works"),
    ("train-val-works-empty", _train("--val-works", ","), "val_works"),
    ("train-resume-and-overwrite", _train("--resume", "--overwrite"), "--resume"),
    # ---- train --resume: the flag the user changed is the one named
    ("train-resume-experts-changed", _resume("--experts", "4"), "argument --experts:"),
    ("train-resume-top-k-changed", _resume("--top-k", "1"), "argument --top-k:"),
    ("train-resume-layers-changed", _resume("--layers", "2"), "argument --layers:"),
    ("train-resume-experts-hidden-changed", _resume("--experts-hidden", "64"), "argument --experts-hidden:"),
    ("train-resume-load-balance-coef-changed", _resume("--load-balance-coef", "0.5"), "argument --load-balance-coef:"),
    ("train-resume-preset-changed", _resume("--preset", "small"), "argument --preset:"),
    ("train-resume-batch-size-changed", _resume("--batch-size", "4"), "argument --batch-size:"),
    ("train-resume-seed-changed", _resume("--seed", "1"), "argument --seed:"),
    ("train-resume-steps-below", _resume("--steps", "1"), "argument --steps:"),
    ("train-resume-history-missing", _resume("--steps", "3", out="{run_no_history}"), "argument --resume:"),
    ("train-resume-history-not-json", _resume("--steps", "3", out="{run_bad_history}"), "history.json: not valid JSON"),
    ("train-deterministic-auto", _train("--deterministic", "--parallel", "auto"), "--deterministic"),
    ("train-two-level-one-rank", _train("--exchange", "two-level"), "--exchange"),
    ("train-vocab-parallel-one-rank", _train("--vocab-parallel"), "--vocab-parallel"),
    ("train-rebalance-one-rank", _train("--rebalance-every", "5"), "--rebalance-every"),
    *_bad("--tuned", "{file}", label="without-auto"),
    # ---- train: devices and paths
    *_bad("--device", *(["cuda"] if _NO_CUDA else []), "cuda:99", "nonsense", "meta"),
    ("train-nproc-device-index", _train("--nproc", "2", "--device", "cuda:0"), "--device"),
    ("train-out-is-file", ["train", "--out", "{file}", *_TRAIN], "--out"),
    ("train-out-under-file", ["train", "--out", "{file}/run", *_TRAIN], "--out"),
    *[(f"train-out-unwritable-{i}", ["train", "--out", p, *_TRAIN], "--out") for i, p in enumerate(_UNWRITABLE)],
    # ---- train: ranks, all refused before torchrun starts
    *_bad("--nproc", "0", "-2", "x"),
    ("train-nproc-experts-not-divisible", _train("--nproc", "2", "--experts", "3"), "--experts"),
    ("train-nproc-batch-not-divisible", _train("--nproc", "2", "--batch-size", "3"), "--batch-size"),
    ("train-nproc-3-of-8-experts", _train("--nproc", "3", "--batch-size", "3"), "--experts"),
    *_bad("--max-restarts", "1", label="alone"),
    ("train-max-restarts-negative", _train("--nproc", "2", "--max-restarts", "-1"), "--max-restarts"),
    ("train-expert-slots-alone", _train("--nproc", "2", "--expert-slots", "5"), "--expert-slots"),
    ("train-expert-slots-too-many", _train("--nproc", "2", "--rebalance-every", "5", "--expert-slots", "9"),
     "--expert-slots"),
    *[(f"train-nproc-tuned-{name}", _train("--nproc", "2", "--parallel", "auto", "--tuned", f"{{{name}}}"), "--tuned")
      for name in ("missing", "dir", "tuned_garbage", "tuned_dict", "tuned_layers", "tuned_record")],
    # ---- train-vision
    *[(f"vision-lr-{v}", ["train-vision", "--lr", v], "--lr") for v in ("nan", "inf", "0", "-1")],
    *[(f"vision-{flag[2:]}-0", ["train-vision", flag, "0"], flag)
      for flag in ("--epochs", "--batch-size", "--experts", "--top-k", "--threads")],
    ("vision-top-k-above-experts", ["train-vision", "--top-k", "9"], "top_k"),
    ("vision-capacity-factor-inf", ["train-vision", "--capacity-factor", "inf"], "--capacity-factor"),
    ("vision-seed-negative", ["train-vision", "--seed", "-1"], "--seed"),
    ("vision-router-bad", ["train-vision", "--router", "dot"], "--router"),
    ("vision-drop-policy-bad", ["train-vision", "--drop-policy", "x"], "--drop-policy"),
    ("vision-epochs-word", ["train-vision", "--epochs", "ten"], "--epochs"),
    ("vision-out-is-file", ["train-vision", "--out", "{file}"], "--out"),
    ("vision-out-unwritable", ["train-vision", "--out", "/proc/moeflow-no/run"], "--out"),
    ("vision-overwrite-without-out", ["train-vision", "--overwrite"], "--overwrite"),
    # ---- generate
    ("generate-missing", ["generate", "{missing}"], "{missing}"),
    ("generate-file", ["generate", "{file}"], "{file}"),
    ("generate-empty-dir", ["generate", "{dir}"], "{dir}"),
    ("generate-garbage", ["generate", "{garbage_ckpt}"], "index.json"),
    *[(f"generate-tokens-{v}", ["generate", "{ckpt}", "--tokens", v], "--tokens") for v in ("-1", "x")],
    *[(f"generate-temperature-{v}", ["generate", "{ckpt}", "--temperature", v], "--temperature")
      for v in ("nan", "inf", "-1")],
    ("generate-top-k-negative", ["generate", "{ckpt}", "--top-k", "-1"], "--top-k"),
    ("generate-seed-negative", ["generate", "{ckpt}", "--seed", "-1"], "--seed"),
    ("generate-chat-no-template", ["generate", "{ckpt}", "--chat"], "{ckpt}"),
    ("generate-chat-template-missing", ["generate", "{ckpt}", "--chat-template", "{missing}"], "--chat-template"),
    ("generate-chat-template-dir", ["generate", "{ckpt}", "--chat-template", "{dir}"], "--chat-template"),
    *[(f"generate-fast-memory-{v}", ["generate", "{ckpt}", "--offload", "disk", "--fast-memory", v], "--fast-memory")
      for v in ("12XB", "0", "nan", "-1", "lots")],
    ("generate-fast-memory-no-offload", ["generate", "{ckpt}", "--fast-memory", "1MB"], "--offload"),
    ("generate-mode-bad", ["generate", "{ckpt}", "--offload", "disk", "--mode", "x"], "--mode"),
    ("generate-offload-bad", ["generate", "{ckpt}", "--offload", "gpu"], "--offload"),
    ("generate-ring-slots-cache", ["generate", "{ckpt}", "--offload", "disk", "--ring-slots", "2"], "--ring-slots"),
    ("generate-prefetch-negative", ["generate", "{ckpt}", "--offload", "host", "--prefetch", "-1"], "--prefetch"),
    ("generate-dir-is-file", ["generate", "{ckpt}", "--offload", "disk", "--dir", "{file}"], "--dir"),
    ("generate-dir-host", ["generate", "{ckpt}", "--offload", "host", "--dir", "{dir}"], "--dir"),
    ("generate-disk-reads-no-offload", ["generate", "{ckpt}", "--disk-reads", "cached"], "--disk-reads"),
    ("generate-disk-reads-host", ["generate", "{ckpt}", "--offload", "host", "--disk-reads", "cached"], "--disk-reads"),
    ("generate-disk-reads-evict", ["generate", "{ckpt}", "--offload", "disk", "--disk-reads", "cached",
                                   "--evict-page-cache"], "--disk-reads"),
    ("generate-disk-reads-bad", ["generate", "{ckpt}", "--offload", "disk", "--disk-reads", "mmap"], "--disk-reads"),
    *[(f"generate-device-{v}", ["generate", "{ckpt}", "--device", v], "--device")
      for v in (*(["cuda"] if _NO_CUDA else []), "cuda:99", "nonsense")],
    ("generate-offload-device-nonsense", ["generate", "{ckpt}", "--offload", "host", "--device", "tpu"], "--device"),
    # ---- serve (--port 0: a case a check lets through fails on no busy port; none may reach serving)
    ("serve-missing", ["serve", "{missing}"], "{missing}"),
    ("serve-file", ["serve", "{file}", "--port", "0"], "{file}"),
    ("serve-empty-dir", ["serve", "{dir}", "--port", "0"], "{dir}"),
    ("serve-garbage", ["serve", "{garbage_ckpt}", "--port", "0"], "index.json"),
    *[(f"serve-port-{v}", ["serve", "{ckpt}", "--port", v], "--port") for v in ("70000", "-1", "x")],
    *[(f"serve-{flag[2:]}-{v}", ["serve", "{ckpt}", "--port", "0", flag, v], flag) for flag, v in (
        ("--max-concurrency", "0"), ("--max-queue", "-1"), ("--prefill-chunk", "0"), ("--context", "1"),
        ("--context", "100000"), ("--timeout", "0"), ("--timeout", "nan"), ("--shutdown-grace", "-1"),
        ("--threads", "0"), ("--host", ""), ("--model-name", ""))],
    ("serve-chat-template-missing", ["serve", "{ckpt}", "--port", "0", "--chat-template", "{missing}"],
     "--chat-template"),
    ("serve-fast-memory-no-offload", ["serve", "{ckpt}", "--port", "0", "--fast-memory", "1MB"], "--offload"),
    ("serve-compile-offload", ["serve", "{ckpt}", "--port", "0", "--offload", "host", "--compile"], "--compile"),
    ("serve-mode-bad", ["serve", "{ckpt}", "--port", "0", "--offload", "disk", "--mode", "x"], "--mode"),
    ("serve-device-nonsense", ["serve", "{ckpt}", "--port", "0", "--device", "tpu"], "--device"),
    # ---- infer
    *[(f"infer-fast-memory-{v}", ["infer", *_INFER, "--fast-memory", v], "--fast-memory")
      for v in ("abc", "-1", "0", "nan")],
    *[(f"infer-{flag[2:]}-0", ["infer", *_INFER, flag, "0"], flag) for flag in ("--batch-size", "--threads")],
    ("infer-seq-len-0", ["infer", "--layers", "1", "--vocab-size", "64", "--new-tokens", "1", "--seq-len", "0"],
     "--seq-len"),
    ("infer-new-tokens-negative", ["infer", "--layers", "1", "--vocab-size", "64", "--new-tokens", "-1"],
     "--new-tokens"),
    ("infer-layers-0", ["infer", "--vocab-size", "64", "--seq-len", "4", "--new-tokens", "1", "--layers", "0"],
     "--layers"),
    ("infer-vocab-size-0", ["infer", "--layers", "1", "--seq-len", "4", "--new-tokens", "1", "--vocab-size", "0"],
     "--vocab-size"),
    ("infer-ring-slots-0", ["infer", *_INFER, "--ring-slots", "0"], "--ring-slots"),
    ("infer-prefetch-negative", ["infer", *_INFER, "--prefetch", "-1"], "--prefetch"),
    *[(f"infer-device-{v}", ["infer", *_INFER, "--device", v], "--device")
      for v in (*(["cuda"] if _NO_CUDA else []), "cuda:99", "nonsense")],
    ("infer-dir-is-file", ["infer", *_INFER, "--dir", "{file}"], "--dir"),
    ("infer-dir-unwritable", ["infer", *_INFER, "--dir", _UNWRITABLE[0]], "--dir"),
    ("infer-json-unwritable", ["infer", *_INFER, "--json", _UNWRITABLE[0]], "--json"),
    ("infer-json-is-dir", ["infer", *_INFER, "--json", "{dir}"], "--json"),
    ("infer-checkpoint-missing", ["infer", "{missing}", "--seq-len", "4", "--new-tokens", "1"], "{missing}"),
    ("infer-checkpoint-garbage", ["infer", "{garbage_ckpt}", "--seq-len", "4", "--new-tokens", "1"], "index.json"),
    ("infer-mode-bad", ["infer", *_INFER, "--mode", "x"], "--mode"),
    ("infer-offload-bad", ["infer", *_INFER, "--offload", "gpu"], "--offload"),
    # ---- prepare-data
    ("prepare-data-nothing", ["prepare-data"], "SOURCE"),
    ("prepare-data-no-out", ["prepare-data", "{file}"], "--out"),
    ("prepare-data-source-missing", ["prepare-data", "{missing}", "--out", "{new}"], "{missing}"),
    ("prepare-data-folder-without-data", ["prepare-data", "{dir}", "--out", "{new}"], "{dir}"),
    ("prepare-data-out-is-file", ["prepare-data", "{file}", "--out", "{file}"], "--out"),
    ("prepare-data-tokenizer-missing", ["prepare-data", "{file}", "--out", "{new}", "--tokenizer", "{missing}"],
     "--tokenizer"),
    *[(f"prepare-data-{flag[2:]}-{v}", ["prepare-data", "{file}", "--out", "{new}", flag, v], flag)
      for flag, v in (("--val-fraction", "1.5"), ("--val-fraction", "nan"), ("--workers", "0"), ("--bpe-vocab", "10"),
                      ("--shard-tokens", "0"))],
    # ---- convert
    ("convert-nothing", ["convert"], "SRC"),
    ("convert-info-missing", ["convert", "{missing}", "--info"], "{missing}"),
    ("convert-info-file", ["convert", "{file}", "--info"], "{file}"),
    ("convert-info-garbage", ["convert", "{garbage_ckpt}", "--info"], "index.json"),
    *[(f"convert-world-size-{v}", ["convert", "{ckpt}", "{new}", "--world-size", v], "--world-size")
      for v in ("0", "-1", "x")],
    ("convert-dst-is-file", ["convert", "{ckpt}", "{file}", "--world-size", "1"], "{file}"),
    ("convert-dst-unwritable", ["convert", "{ckpt}", _UNWRITABLE[0], "--world-size", "1"], _UNWRITABLE[0]),
    ("convert-to-hf-file", ["convert", "{ckpt}", "--to-hf", "{file}"], "--to-hf"),
    ("convert-to-hf-unwritable", ["convert", "{ckpt}", "--to-hf", _UNWRITABLE[0]], "--to-hf"),
    ("convert-to-dcp-file", ["convert", "{ckpt}", "--to-dcp", "{file}"], "--to-dcp"),
    ("convert-from-hf-missing", ["convert", "--from-hf", "{missing}", "{new}"], "{missing}"),
    *[(f"convert-from-hf-{name[3:]}", ["convert", "--from-hf", f"{{{name}}}", "{new}"], what)
      for name, what in (("hf_truncated", "safetensors"), ("hf_garbage", "safetensors"),
                         ("hf_no_hidden_size", "hidden_size"), ("hf_no_weight_map", "weight_map"),
                         ("hf_outside", "weight_map"))],
    ("convert-from-hf-dst-is-file", ["convert", "--from-hf", "{hf_ok}", "{file}"], "{file}"),
    ("convert-from-dcp-missing", ["convert", "--from-dcp", "{missing}", "{new}"], "{missing}"),
    ("convert-step-without-from-dcp", ["convert", "{ckpt}", "--step", "3"], "--step"),
    ("convert-from-dcp-empty-dir", ["convert", "--from-dcp", "{dir}", "{new}"], "{dir}"),
    # ---- bench
    *[(f"bench-{flag[2:]}-0", ["bench", *_BENCH, flag, "0"], flag)
      for flag in ("--tokens", "--dim", "--hidden", "--experts", "--top-k", "--repeats", "--threads")],
    ("bench-top-k-above-experts", ["bench", *_BENCH, "--top-k", "9"], "--top-k"),
    ("bench-capacity-factor-nan", ["bench", *_BENCH, "--capacity-factor", "nan"], "--capacity-factor"),
    ("bench-warmup-negative", ["bench", *_BENCH, "--warmup", "-1"], "--warmup"),
    *[(f"bench-device-{v}", ["bench", *_BENCH, "--device", v], "--device")
      for v in (*(["cuda"] if _NO_CUDA else []), "cuda:99", "nonsense")],
    ("bench-impls-bad", ["bench", *_BENCH, "--impls", "nope"], "impls"),
    ("bench-dtype-bad", ["bench", *_BENCH, "--dtype", "int8"], "--dtype"),
    ("bench-activation-bad", ["bench", *_BENCH, "--activation", "tanhh"], "--activation"),
    ("bench-json-unwritable", ["bench", *_BENCH, "--json", _UNWRITABLE[0]], "--json"),
    ("bench-json-is-dir", ["bench", *_BENCH, "--json", "{dir}"], "--json"),
    ("bench-nproc-0", ["bench", "--nproc", "0", "--experts", "4"], "--nproc"),
    ("bench-nproc-experts-not-divisible", ["bench", "--nproc", "3", "--experts", "4"], "experts"),
    ("bench-skew-without-nproc", ["bench", *_BENCH, "--skew", "0.5"], "--skew"),
    ("bench-skew-nan", ["bench", "--nproc", "2", "--experts", "4", "--skew", "nan"], "--skew"),
    # ---- a2a-model
    ("a2a-node-size-0", ["a2a-model", "--node-size", "0"], "node_size"),
    ("a2a-node-size-word", ["a2a-model", "--node-size", "eight"], "--node-size"),
    *[(f"a2a-bytes-{v}", ["a2a-model", "--bytes-per-rank", v], "--bytes-per-rank") for v in ("nan", "-1", "0")],
]


def _tiny_checkpoint(root: Path) -> Path:
    """A complete ``moeflow train``-style checkpoint of a one-layer byte-level MoE GPT."""
    from moeflow.checkpoint import save_checkpoint
    from moeflow.models import MoEGPT, gpt_config
    from moeflow.train.data import ByteTokenizer
    from moeflow.train.lm import MODEL_FAMILY

    cfg = gpt_config("tiny", vocab_size=256, n_layers=1, max_seq_len=32)
    extra = {"family": MODEL_FAMILY, "model": cfg.to_dict(), "dtype": "float32",
             "tokenizer": ByteTokenizer().to_dict()}
    return save_checkpoint(root, 1, MoEGPT(cfg), extra=extra)


def _hf_dirs(base: Path, outside: Path) -> dict[str, Path]:
    """A Mixtral directory moeflow writes (``hf_ok``) and damaged copies of it."""
    from moeflow.convert.mixtral import gpt_config_from_hf, gpt_to_hf
    from moeflow.models import MoEGPT

    config = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 2,
              "num_experts_per_tok": 1, "max_position_embeddings": 32}
    ok = gpt_to_hf(MoEGPT(gpt_config_from_hf(config)), base / "hf_ok")
    dirs = {"hf_ok": ok}
    for name in ("hf_truncated", "hf_garbage", "hf_no_hidden_size", "hf_no_weight_map", "hf_outside"):
        dirs[name] = Path(shutil.copytree(ok, base / name))
    weights = next(dirs["hf_truncated"].glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    next(dirs["hf_garbage"].glob("*.safetensors")).write_bytes(bytes(range(256)) * 64)
    cfg = json.loads((dirs["hf_no_hidden_size"] / "config.json").read_text())
    del cfg["hidden_size"]
    (dirs["hf_no_hidden_size"] / "config.json").write_text(json.dumps(cfg))
    (dirs["hf_no_weight_map"] / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    (dirs["hf_outside"] / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": str(Path("..") / ".." / outside.name)}}))
    return dirs


def _runs(base: Path) -> dict[str, Path]:
    """A ``moeflow train`` run of the ``_TRAIN`` settings at step 2 (``--resume`` cases), and
    copies with its history.json missing or not JSON."""
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--out", str(base / "run"), *_TRAIN, "--steps", "2", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    runs = {"run": base / "run"}
    for name in ("run_no_history", "run_bad_history"):
        runs[name] = Path(shutil.copytree(base / "run", base / name))
    (runs["run_no_history"] / "history.json").unlink()
    (runs["run_bad_history"] / "history.json").write_text("{not json")
    return runs


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("bad-input")
    (base / "afile.txt").write_text("not what moeflow wants\n")
    (base / "empty").mkdir()
    garbage = base / "garbage_ckpt"
    garbage.mkdir()
    (garbage / "index.json").write_text("{not json")
    (garbage / "rank00000-of-00001.safetensors").write_bytes(b"\x00garbage" * 10)
    tuned = {"tuned_garbage": b"\xff\xfe{", "tuned_dict": b'{"layers": 4}', "tuned_layers": b"[[]]",
             "tuned_record": b'[[{"parallel": "auto", "overlap_degree": "auto"}], [], [], []]'}
    for name, content in tuned.items():
        (base / f"{name}.json").write_bytes(content)
    configs = {"config_unknown": "stepz = 3\n", "config_flag_spelling": "top-k = 1\n", "config_nan": "lr = nan\n",
               "config_steps_text": 'steps = "many"\n', "config_bad_choice": 'preset = "huge"\n',
               "config_bad_switch": 'plot = "no"\n', "config_eval_every_negative": "eval_every = -1\n"}
    for name, content in configs.items():
        (base / f"{name}.toml").write_text(content)
    found = {"file": base / "afile.txt", "dir": base / "empty", "missing": base / "does-not-exist",
             "garbage_ckpt": garbage, "ckpt": _tiny_checkpoint(base / "ckpt"),
             **{name: base / f"{name}.json" for name in tuned}, **{name: base / f"{name}.toml" for name in configs}, **_hf_dirs(base, base.parent / "outside.bin"),
             **_runs(base)}
    return {k: str(v) for k, v in found.items()}


def _names(line: str, needle: str) -> bool:
    """``line`` names ``needle``: a flag by its option (``--fast-memory``) or its field
    (``fast_memory``, as a config's message says), a path or word as it is."""
    if needle.startswith("--"):
        return needle[2:].replace("-", "_") in line.replace("-", "_")
    return needle.lower() in line.lower()


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)`` in this process: (status, stdout, stderr)."""
    threads = torch.get_num_threads()
    try:
        status = main(argv)
    except SystemExit as done:  # argparse
        status = done.code if isinstance(done.code, int) else 1
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(("argv", "needle"), [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_is_one_clear_line(argv: list[str], needle: str, paths, tmp_path, capsys) -> None:
    fill = {**paths, "new": str(tmp_path / "new")}
    argv = [a.format(**fill) for a in argv]
    needle = needle.format(**fill)
    status, out, err = run_cli(argv, capsys)
    lines = err.strip().splitlines()
    assert status not in (0, None), f"accepted: moeflow {' '.join(argv)}\nstdout: {out[-500:]}"
    assert "Traceback" not in err and "unexpected" not in err, err
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err[-2000:]}"
    assert _names(lines[0], needle), f"the message does not name {needle!r}: {lines[0]}"
    assert out == "", f"work started before the refusal; stdout: {out[-500:]}"


def test_the_sweep_covers_every_subcommand() -> None:
    from moeflow.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    tried = {argv[0] for _, argv, _ in CASES if argv}
    assert set(commands) <= tried, set(commands) - tried
    assert len(CASES) >= 100 and len({i for i, _, _ in CASES}) == len(CASES)

"""``LMTrainConfig``: every setting of a language-model training run, validated on construction.

A bad value fails where the config is written (naming the field and the value), not steps into
a run; the model and parallel overrides are checked by building their configs
(``model_config``, ``parallel_config``). ``to_dict``/``from_dict`` round-trip it through the
JSON a checkpoint's index stores, so a resumed run can compare its data settings with the saved
ones. The loop that runs it is ``moeflow.train.lm``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from moeflow.checks import _float
from moeflow.config import ParallelConfig, RouterConfig, _int
from moeflow.models import GPT_PRESETS, GPTConfig, gpt_config
from moeflow.train.data import DEFAULT_VAL_WORKS
from moeflow.train.init_from import MODEL_OVERRIDES, init_checkpoint
from moeflow.train.prepare import DEFAULT_VAL_FRACTION

__all__ = ["LMTrainConfig"]


def source_weight(source: str) -> tuple[str, float]:
    """``(source, weight)`` of ``SOURCE`` or ``SOURCE@WEIGHT`` (weight 1 by default, > 0)."""
    path, at, weight = source.rpartition("@")
    if not at:
        return source, 1.0
    try:
        w = float(weight)
    except ValueError:
        raise ValueError(f"data source {source!r}: the weight after '@' must be a number, got {weight!r}") from None
    if not (w > 0 and w < float("inf")):
        raise ValueError(f"data source {source!r}: the weight must be a positive finite number, got {weight}")
    if not path:
        raise ValueError(f"data source {source!r}: no source before '@'")
    return path, w


@dataclass(frozen=True, kw_only=True)
class LMTrainConfig:
    """Everything a language-model training run needs; validated on construction.

    ``batch_size`` is the global number of sequences per optimizer step (split over
    ``grad_accum`` micro-batches and over the ranks). ``lr`` warms up linearly for
    ``warmup_steps`` and then follows a cosine down to ``min_lr`` at ``steps``. ``amp``:
    ``"auto"`` uses bf16 autocast on a CUDA device that supports it and full fp32 on CPU
    (CPUs without native bf16 run it 50-90x slower). ``dtype`` is the parameter dtype
    (``float64`` for exact comparisons, e.g. one process against expert-parallel ranks).
    ``device``: ``"cpu"``, ``"cuda:N"``, or ``"cuda"``, this process's current GPU (on a torchrun
    rank ``cuda:LOCAL_RANK``: each rank its own); the library's default is the CPU, ``moeflow
    train``'s is CUDA where available.
    ``parallel`` and ``overlap_degree`` set the MoE layers' parallel mode and pipelining under
    ``--nproc`` (``"auto"``: tuned at run time; see ``moeflow.ParallelConfig``). A run with
    ``"auto"`` writes the tuner's choices to ``out_dir/tuned.json``; ``tuned`` (such a file)
    locks them in a later run, which then uses the same settings from its first step (shapes the
    file lacks are still tuned).
    ``deterministic`` turns on ``torch.use_deterministic_algorithms`` (an op without a
    deterministic kernel then raises instead of varying; on CUDA set
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` as torch asks); with it a run repeats bit for bit on the
    same machine and world size. moeflow's own dispatch and combine are gathers (no atomic adds),
    so they need no change; the auto-tuner is refused (its choice depends on timings).
    With several ranks: ``vocab_parallel`` splits the embedding and the tied output projection
    by vocabulary rows (``moeflow.models.vocab_parallel``); ``rebalance_every`` moves experts
    (and their optimizer state) every that many steps to a load-aware placement computed from the
    expert load since the last move, with ``expert_slots`` experts per rank (0: E / ranks, i.e.
    no memory for replicas; more lets hot experts be replicated). ``exchange`` picks the
    all-to-all of the expert-parallel layers: ``"flat"``, ``"two-level"`` (inside each node,
    then across nodes; needs the node size, see ``train_lm``) or ``"auto"`` (two-level when the
    ranks span more than one node). Under torchrun (``moeflow train``'s ranks):
    ``collective_timeout_s`` bounds every collective (a peer that died turns into a failure and,
    with ``--max-restarts``, a restart), and a rank whose heartbeat stops for
    ``stall_timeout_s`` (stopped, or its host hung) is named and the job stopped
    (``moeflow.parallel.launch.heartbeat``).
    ``checkpoint_every`` saves are written in the background (``async_checkpoints``:
    ``moeflow.checkpoint.save_checkpoint_async``; the training waits only until the state is
    staged in host memory); the final save is synchronous.

    Following the run (rank 0; ``moeflow.train.metrics``): ``progress`` shows a tqdm bar when
    stderr is a terminal, else (or with ``progress=False``) a plain line every ``log_every``
    steps (0: about 50 lines per run, at least every 10 steps), the load is gathered at those
    steps; every step's metrics go to ``out_dir/metrics.jsonl`` and, with ``tensorboard``, to
    ``out_dir/tensorboard`` (needs the tensorboard package).

    A step whose loss or global gradient norm is not finite stops the run with
    ``moeflow.train.nonfinite.NonFiniteLossError`` before the optimizer step (the weights and
    every checkpoint stay finite; the latest checkpoint is the last good one), unless
    ``skip_nonfinite`` > 0: then up to that many such steps are skipped (no update; recorded in
    the history's ``"skipped"``) and the next one stops the run. Every number must be finite.

    Data: the Shakespeare corpus (``val_works`` held out) unless ``data`` names one's own
    sources (``moeflow.train.sources``: text, JSONL/JSON, Parquet, datasets directories,
    ``hf:NAME``; or a directory ``moeflow prepare-data`` wrote), each ``SOURCE`` or
    ``SOURCE@WEIGHT`` (sequences drawn from the sources in proportion to their weights).
    Validation: ``val_data`` (sources like ``data``), else ``val_fraction`` of each raw source
    (whole documents chosen by a hash of their index; with too few documents the last tokens,
    at least one window of ``seq_len``: ``moeflow.train.prepare``), or a prepared source's own
    validation split; a run always has one (``val_fraction`` 0 needs ``val_data``). Raw sources
    are tokenized once into ``out_dir/data`` (rank 0; every rank then memory-maps it,
    ``mmap_window`` bytes of each shard at a time). ``tokenizer``: ``byte`` (UTF-8 bytes and an
    end-of-document token for one's own data), ``bpe`` (trained on the training documents,
    ``bpe_vocab``), or a ``tokenizer.json`` / model directory; a prepared source brings its own.
    ``text_field``: the JSON key or column of the text; ``skip_empty``: skip empty documents
    (counted) instead of refusing them.

    ``n_layers``, ``dim``, ``n_heads`` and ``expert_hidden`` (like ``num_experts`` ... ``moe_every``)
    override the preset's fields (None: the preset's), validated by building the ``GPTConfig``.
    ``init_from`` (a checkpoint, or a run directory) starts the run from that model's weights
    and takes its config and tokenizer (``moeflow.train.init_from`` says what and why); the
    optimizer starts fresh. ``expert_recompute``: the experts keep only their input rows and
    recompute the hidden activation in backward (``ExpertsConfig.recompute``: same gradients,
    less activation memory, more time); a run may resume with it on or off.

    ``out_dir`` belongs to one run (``moeflow.train.lm_checkpoint`` has the rules): a new run
    into a directory that holds another is refused unless ``overwrite`` (which deletes that
    run's files, nothing else); ``resume`` continues the run there from its latest checkpoint
    (``steps`` below that checkpoint's step is refused; equal to it: finished, nothing to do).
    """

    out_dir: Path
    preset: str = "tiny"
    num_experts: int | None = None
    top_k: int | None = None
    capacity_factor: float | None = None
    moe_every: int | None = None
    load_balance_coef: float | None = None
    n_layers: int | None = None
    dim: int | None = None
    n_heads: int | None = None
    expert_hidden: int | None = None
    expert_recompute: bool = False
    init_from: Path | None = None
    parallel: str = "expert"
    overlap_degree: int | str = 1
    tuned: Path | None = None
    seq_len: int = 128
    tokenizer: str = "byte"
    bpe_vocab: int = 1024
    val_works: tuple[str, ...] = DEFAULT_VAL_WORKS
    data: tuple[str, ...] = ()
    val_data: tuple[str, ...] = ()
    val_fraction: float = DEFAULT_VAL_FRACTION
    text_field: str = "text"
    skip_empty: bool = False
    mmap_window: int = 256 << 20
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    skip_nonfinite: int = 0
    async_checkpoints: bool = True
    seed: int = 0
    amp: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    resume: bool = False
    overwrite: bool = False
    deterministic: bool = False
    vocab_parallel: bool = False
    rebalance_every: int = 0
    expert_slots: int = 0
    exchange: str = "auto"
    stall_timeout_s: float = 30.0
    collective_timeout_s: float = 300.0
    progress: bool = True
    log_every: int = 0
    tensorboard: bool = False
    plot: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.tuned is not None:
            object.__setattr__(self, "tuned", Path(self.tuned))
            if "auto" not in (self.parallel, self.overlap_degree):
                raise ValueError(f"tuned={str(self.tuned)!r} fixes the auto-tuner's choices: it needs parallel or "
                                 "overlap_degree 'auto'")
        object.__setattr__(self, "val_works", tuple(self.val_works))
        for name in ("data", "val_data"):
            value = getattr(self, name)
            if isinstance(value, (str, Path)) or not all(isinstance(v, (str, Path)) for v in value):
                raise TypeError(f"{name} must be a list of sources (paths, hf:NAME), got {value!r}")
            object.__setattr__(self, name, tuple(str(v) for v in value))
        if self.val_data and not self.data:
            raise ValueError(f"val_data={list(self.val_data)} goes with data (one's own training sources)")
        _float("val_fraction", self.val_fraction)
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"text_field must be a non-empty string, got {self.text_field!r}")
        _int("mmap_window", self.mmap_window, minimum=1 << 16)
        for source in self.data:
            source_weight(source)  # the weight's syntax, before any work
        if self.init_from is not None:
            object.__setattr__(self, "init_from", Path(self.init_from))
            given = [k for k in MODEL_OVERRIDES if getattr(self, k) is not None]
            if given:
                raise ValueError(f"init_from={str(self.init_from)!r} takes the model from the checkpoint: "
                                 f"{', '.join(f'{k}={getattr(self, k)!r}' for k in given)} would change it")
        if self.preset not in GPT_PRESETS:
            raise ValueError(f"preset must be one of {sorted(GPT_PRESETS)}, got {self.preset!r}")
        if self.tokenizer not in ("byte", "bpe") and not (self.data and Path(self.tokenizer).exists()):
            raise ValueError(f"tokenizer must be 'byte', 'bpe'" + (" or a tokenizer.json / model directory" if self.data
                             else " (a tokenizer.json goes with data)") + f", got {self.tokenizer!r}")
        if self.dtype not in ("float32", "float64", "bfloat16"):
            raise ValueError(f"dtype must be float32, float64 or bfloat16, got {self.dtype!r}")
        if self.amp not in ("auto", "bf16", "fp16", "off"):
            raise ValueError(f"amp must be one of auto, bf16, fp16, off, got {self.amp!r}")
        for name in ("seq_len", "steps", "batch_size", "grad_accum", "eval_batches", "keep_checkpoints", "bpe_vocab"):
            _int(name, getattr(self, name), minimum=1)
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "seed", "rebalance_every", "expert_slots",
                     "skip_nonfinite", "log_every"):
            _int(name, getattr(self, name), minimum=0)
        if self.tokenizer == "bpe" and self.bpe_vocab < 257:
            raise ValueError(f"bpe_vocab must be >= 257 (the 256 bytes and a merge), got {self.bpe_vocab}")
        if self.exchange not in ("auto", "flat", "two-level"):
            raise ValueError(f"exchange must be 'auto', 'flat' or 'two-level', got {self.exchange!r}")
        for name in ("stall_timeout_s", "collective_timeout_s"):
            _float(name, getattr(self, name))
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.resume and self.overwrite:
            raise ValueError("resume=True and overwrite=True contradict each other: resume continues the run in "
                             f"out_dir={str(self.out_dir)!r}, overwrite deletes it to start a new one")
        if self.deterministic and "auto" in (self.parallel, self.overlap_degree):
            raise ValueError("deterministic=True needs a fixed parallel mode and overlap_degree: "
                             "'auto' chooses by timing, which differs from run to run")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} must be divisible by grad_accum={self.grad_accum}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            _float(name, getattr(self, name))  # a type and finiteness first: nan passes no comparison below
        for name in ("capacity_factor", "load_balance_coef"):
            if getattr(self, name) is not None:
                _float(name, getattr(self, name))
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device must name a torch device (cpu, cuda, cuda:N), got {self.device!r}") from None
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")
        model = self.model_config(vocab_size=256)  # validates the model overrides (reads init_from's index)
        if self.init_from is not None and self.seq_len > model.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} is longer than the context of the init_from model "
                             f"({model.max_seq_len} tokens)")
        if self.init_from is not None and self.init_extra().get("tokenizer") is None and model.vocab_size < 256:
            raise ValueError(f"init_from={str(self.init_from)!r} has no tokenizer (a model converted without "
                             f"tokenizer.json: trained on bytes) and a vocabulary of {model.vocab_size} ids, fewer than the 256 bytes")
        self.parallel_config()  # and the parallel settings

    def init_extra(self) -> dict | None:
        """The ``extra`` of the ``init_from`` checkpoint (model, tokenizer, dtype); None without it."""
        return None if self.init_from is None else init_checkpoint(self.init_from)[1]

    def model_config(self, *, vocab_size: int):  # type: ignore[no-untyped-def]
        """The model this run trains: the preset with the overrides (``max_seq_len`` =
        ``seq_len``), or with ``init_from`` the checkpoint's own (``vocab_size`` then unused)."""
        if self.init_from is not None:
            try:
                return self._with_recompute(GPTConfig.from_dict(self.init_extra()["model"]))  # type: ignore[index]
            except (KeyError, TypeError) as err:
                raise ValueError(f"init_from={str(self.init_from)!r}: corrupt model description: {err}") from None
        overrides = {k: getattr(self, k) for k in ("num_experts", "top_k", "capacity_factor", "moe_every", "n_layers",
                                                   "dim", "n_heads", "expert_hidden") if getattr(self, k) is not None}
        if self.load_balance_coef is not None:
            router = GPT_PRESETS[self.preset].get("router", RouterConfig())
            overrides["router"] = dataclasses.replace(router, load_balance_coef=self.load_balance_coef)
        return self._with_recompute(gpt_config(self.preset, vocab_size=vocab_size, max_seq_len=self.seq_len, **overrides))

    def _with_recompute(self, model: GPTConfig) -> GPTConfig:
        """``model`` with its experts recomputing their hidden activation in backward when
        ``expert_recompute`` (the same gradients, less memory, more time)."""
        if not self.expert_recompute:
            return model
        return dataclasses.replace(model, experts=dataclasses.replace(model.experts, recompute=True))

    def parallel_config(self) -> ParallelConfig:
        """How the MoE layers run their calls under ``--nproc`` (``expert_parallel``'s config)."""
        return ParallelConfig(parallel=self.parallel, overlap_degree=self.overlap_degree)  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["tuned"] = None if self.tuned is None else str(self.tuned)
        d["init_from"] = None if self.init_from is None else str(self.init_from)
        d["val_works"] = list(self.val_works)
        d["data"], d["val_data"] = list(self.data), list(self.val_data)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LMTrainConfig":
        return cls(**d)

"""What the eager and the compiled generation loops share (``moeflow.models.generation``,
``moeflow.models.compiled_decode``): what they need of a model (``Decoder``), how the next token
is chosen (``SamplingConfig``, ``sample_next``), the result (``Generation``), the checks of a
call's arguments and the prefill.

Generation never imports the model's module: the model (``MoEGPT.generate``) calls generation,
and generation reads the model through ``Decoder``, so imports point one way.

Randomness: a sampled token is drawn with the caller's ``generator`` on *the generator's* device
(``sample_next``). A generator on the logits' device (``torch.Generator(device=...)``) draws in
place; any other one still works: each step's probabilities ``[B, V]`` are copied to it and the
tokens back (a CPU generator with a model on CUDA draws as it would on the CPU, at one copy a
step). ``moeflow generate`` makes its generator on the model's device.

Legend: ``B`` rows, ``S`` columns, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from moeflow.checks import _int

__all__ = ["Decoder", "SamplingConfig", "Generation", "sample_next", "draw_device"]


@runtime_checkable
class Decoder(Protocol):
    """What generation reads of a model (``moeflow.models.MoEGPT`` is one): ``config``
    (``vocab_size``, ``max_seq_len``), the embedding (its weight tells the device and dtype) and
    the output head, the whole-sequence forward (``model(idx) -> logits [B, S, V]``: the
    uncached reference), ``new_cache`` and ``forward_cached`` (prefill and eager decode), and
    the static step (``decode_step``, ``decode_hidden``: compiled decode)."""

    config: Any
    embed: nn.Module
    lm_head: nn.Module

    def __call__(self, idx_BS: torch.Tensor) -> torch.Tensor: ...

    # a protocol's members are what isinstance checks: a mutant's trampoline would add members no
    # model has (the signature is not code that runs)
    def new_cache(self, pad_B: torch.Tensor, capacity: int, *, zeroed: bool = False) -> Any: ...  # pragma: no mutate

    def forward_cached(self, idx_BS: torch.Tensor, cache: Any) -> torch.Tensor: ...

    def decode_step(self, next_B: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor: ...

    def decode_hidden(self, next_B: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the next token is chosen from the logits; validated on construction.

    ``temperature=0`` is greedy (argmax); else the logits are divided by ``temperature``, cut
    to the ``top_k`` largest (0: no cut) and then to the smallest set of tokens whose
    probability adds up to at least ``top_p`` (1: no cut), and one token is drawn. ``eos``:
    the stop tokens (a token id, a collection of them, or None), a ``frozenset`` once built;
    a row stops after producing one. ``check_vocab`` checks them against a vocabulary."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(t).__name__} {t!r}")
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {t}")
        _int("top_k", self.top_k, minimum=0)
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise TypeError(f"top_p must be a number, got {type(p).__name__} {p!r}")
        if not (0 < p <= 1):  # also refuses nan
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        eos: object = self.eos
        if eos is None:
            eos = ()
        elif isinstance(eos, int) and not isinstance(eos, bool):
            eos = (eos,)
        elif not isinstance(eos, (list, tuple, set, frozenset)):
            raise TypeError(f"eos must be a token id, a list of token ids or None, got {type(eos).__name__} {eos!r}")
        object.__setattr__(self, "eos", frozenset(_check_token_ids("eos", eos)))

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` (naming ``eos`` and the id) if a stop token is not below ``vocab_size``."""
        _check_token_ids("eos", sorted(self.eos), vocab_size)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Generation:
    """New tokens per prompt (a stop token ends its row and is included) and the time spent.

    ``prefill_s`` runs the prompts and picks each row's first token; ``decode_s`` the rest
    (``decode_tokens`` of them)."""

    tokens: list[list[int]]
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def draw_device(generator: torch.Generator | None, logits_device: torch.device) -> torch.device:
    """Where ``sample_next`` draws: on ``generator``'s device (torch draws only there), on the
    logits' device without one (torch's default generator of that device)."""
    return logits_device if generator is None else torch.device(generator.device)


def sample_next(logits_BV: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token ``[B]`` (int64, on ``logits_BV``'s device) of each row of ``logits_BV``
    (computed in >= fp32). ``generator`` may live on another device than the logits: the draw
    runs on the generator's (``draw_device``; the probabilities are copied there and the tokens
    back): a CPU generator draws from the same probabilities as it would with the model on the
    CPU."""
    if sampling.greedy:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV.to(torch.promote_types(logits_BV.dtype, torch.float32)) / sampling.temperature
    V = logits_BV.shape[-1]
    if 0 < sampling.top_k < V:
        kth_B1 = torch.topk(logits_BV, sampling.top_k).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if sampling.top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(-1, descending=True)
        probs_BV = sorted_BV.softmax(-1)
        # drop a token when the more likely ones already hold top_p of the mass (never the first)
        drop_BV = (probs_BV.cumsum(-1) - probs_BV) >= sampling.top_p
        drop_BV[:, 0] = False
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    probs_BV = logits_BV.softmax(-1)
    where = draw_device(generator, probs_BV.device)
    if where == probs_BV.device:
        return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
    return torch.multinomial(probs_BV.to(where), 1, generator=generator).squeeze(1).to(logits_BV.device)


def _check_token_ids(name: str, ids: Iterable[object], vocab_size: int | None = None) -> list[int]:
    """``ids`` as a list, each an int (not a bool) in ``[0, vocab_size)`` (``>= 0`` without a
    vocabulary); errors name ``name`` and the value."""
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"{name} holds {type(t).__name__} {t!r}; token ids are ints")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size or 'vocab_size'}), got {t}")
        out.append(t)
    return out


def _check_prompts(prompts: object, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dtype not in (torch.int64, torch.int32) or prompts.dim() != 2 or 0 in prompts.shape:
            raise ValueError(f"prompts must be an int tensor [batch, seq] with at least one token per row, got "
                             f"{prompts.dtype} {tuple(prompts.shape)}")
        lo, hi = int(prompts.min()), int(prompts.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompts: token ids must be in [0, {vocab_size}), got {lo if lo < 0 else hi}")
        return prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise TypeError(f"prompts must be a non-empty list of token-id lists or an int tensor [batch, seq], "
                        f"got {type(prompts).__name__} {prompts!r:.80}")
    rows = []
    for i, row in enumerate(prompts):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {row!r:.80}")
        rows.append(_check_token_ids(f"prompts[{i}]", row, vocab_size))
    return rows


def _check_args(model, max_new_tokens: object, generator: object, **sampling: object) -> SamplingConfig:
    """The checked ``SamplingConfig`` of a call (``sampling``: its fields; ``top_k=None`` is 0),
    after checking the call's other arguments; errors name the argument and value."""
    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a decoder such as MoEGPT (moeflow.models.decoding.Decoder: new_cache, "
                        f"forward_cached, decode_step, ...), got {type(model).__name__}")
    _int("max_new_tokens", max_new_tokens, minimum=0)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    config = SamplingConfig(**{**sampling, "top_k": sampling.get("top_k") or 0})  # type: ignore[arg-type]
    config.check_vocab(model.config.vocab_size)
    return config


def _left_padded(rows: list[list[int]], max_new_tokens: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The token history of a generation: the prompts left-padded (pad id 0, never attended
    to) to the longest, ``P``, with room for ``max_new_tokens`` more columns ``[B, P + n]``; the
    padding of each row ``[B]``; and ``P``."""
    P = max(len(r) for r in rows)
    seq_BS = torch.zeros(len(rows), P + max_new_tokens, dtype=torch.long, device=device)
    seq_BS[:, :P] = torch.tensor([[0] * (P - len(r)) + r for r in rows], dtype=torch.long, device=device)
    return seq_BS, torch.tensor([P - len(r) for r in rows], dtype=torch.long, device=device), P


def _prefill(model, seq_BS: torch.Tensor, pad_B: torch.Tensor, capacity: int):
    """A new cache holding the last ``max_seq_len`` columns of ``seq_BS``, and the logits of the
    last column ``[B, V]``."""
    start = max(0, seq_BS.shape[1] - model.config.max_seq_len)
    cache = model.new_cache((pad_B - start).clamp(min=0), capacity)
    return cache, model.forward_cached(seq_BS[:, start:], cache)

"""Text generation with ``MoEGPT``: a batch of prompts of any lengths, KV-cached decoding,
greedy or sampled (temperature, top-k, top-p), per-row stop tokens (legend below).

The prompts are left-padded to one length and run once (prefill, ``MoEGPT.forward_cached``
into a ``KVCache``); then each step feeds one token per unfinished row. A row that produced a
stop token leaves the batch (its cache rows are dropped), so the remaining rows do not pay for
it. The context of each token is the last ``max_seq_len`` tokens of its row, as the model's
docs state: once a row is longer, the window slides and every further token re-runs the window
(the keys of a cropped context differ from the cached ones in every block past the first, so
they cannot be reused); give the model a ``max_seq_len`` of at least prompt + new tokens to
stay on the cached path. ``generate_uncached`` is the plain loop (the whole context per token),
the reference the tests hold the cached path to.

Every step goes through each block's own layers (the MoE's router, dispatcher and experts), so
a model whose experts live elsewhere (``moeflow.storage``) generates through the same code.

Compiled decode (``generate(..., compile=True)``, ``moeflow generate --compile``) lives in
``moeflow.models.compiled_decode``; sampling, the result and the argument checks, which both
loops share, in ``moeflow.models.decoding`` (both re-exported here).

Legend: ``B`` rows still generating, ``S`` columns, ``V`` vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from moeflow.models.compiled_decode import (STOP_CHECK_EVERY, CompiledDecoder, HeadProduct, compiled_decoder,
                                            generate_compiled)
from moeflow.models.decoding import (Decoder, Generation, SamplingConfig, _check_args, _check_prompts, _left_padded,
                                     _prefill, draw_device, sample_next)

__all__ = ["Decoder", "SamplingConfig", "Generation", "generate", "generate_uncached", "generate_tensor", "sample_next",
           "draw_device", "CompiledDecoder", "compiled_decoder", "STOP_CHECK_EVERY", "HeadProduct"]


def generate(model, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
             eos: int | Sequence[int] | None = None, generator: torch.Generator | None = None,
             clock: Callable[[], float] = time.perf_counter, compile: bool = False) -> Generation:
    """Up to ``max_new_tokens`` new tokens for each prompt (lists of token ids of any lengths,
    or an int tensor ``[B, S]``), KV-cached; sampling as in ``SamplingConfig``; a row stops
    after a token of ``eos``. ``generator`` (None: torch's default) may be on any device: the
    draws run on its device (``sample_next``). Bad arguments raise ``ValueError``/``TypeError``
    naming them.
    ``clock`` times prefill and decode (wall time; ``time.process_time`` gives CPU time, steadier
    on a shared machine; a compiled generation synchronises a CUDA device before each reading).
    ``compile=True``: the decode steps run the compiled static step (``moeflow.models.compiled_decode``; the
    first call of a batch size and cache capacity compiles and warms it up before the clock
    starts)."""
    with torch.no_grad():
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be a bool, got {type(compile).__name__} {compile!r}")
        sampling = _check_args(model, max_new_tokens, generator, temperature=temperature, top_k=top_k, top_p=top_p,
                               eos=eos)
        if compile:
            return generate_compiled(model, prompts, max_new_tokens, sampling, generator, clock)
        V, device = model.config.vocab_size, model.embed.weight.device
        rows = _check_prompts(prompts, V)
        stop = sampling.eos
        out: list[list[int]] = [[] for _ in rows]
        prompt_tokens = sum(len(r) for r in rows)
        if max_new_tokens == 0:
            return Generation(tokens=out, prefill_tokens=prompt_tokens, prefill_s=0.0, decode_tokens=0, decode_s=0.0)
        seq_BS, pad_B, P = _left_padded(rows, max_new_tokens, device)  # the sliding window reads the history
        # columns ever fed: the prompt and every new token but the last
        capacity = min(model.config.max_seq_len, P + max_new_tokens - 1)
        live = list(range(len(rows)))  # the prompt of each cache row
        cols = P

        t0 = clock()
        cache, logits_BV = _prefill(model, seq_BS[:, :cols], pad_B, capacity)
        t1 = None
        for step in range(max_new_tokens):
            next_B = sample_next(logits_BV, sampling, generator)
            ids = next_B.tolist()  # the one host sync of a step (stop tokens are checked here)
            if t1 is None:
                t1 = clock()
            seq_BS[:, cols] = next_B
            cols += 1
            keep = []
            for i, (r, t) in enumerate(zip(live, ids)):
                out[r].append(t)
                if t not in stop:
                    keep.append(i)
            if not keep or step == max_new_tokens - 1:
                break
            if len(keep) < len(live):
                keep_B = torch.tensor(keep, dtype=torch.long, device=device)
                seq_BS, next_B, pad_B = seq_BS.index_select(0, keep_B), next_B.index_select(0, keep_B), pad_B[keep_B]
                cache.keep_rows(keep_B)
                live = [live[i] for i in keep]
            if cache.length < cache.capacity:
                logits_BV = model.forward_cached(next_B.unsqueeze(1), cache)
            else:  # the context is longer than max_seq_len: the window slides
                cache, logits_BV = _prefill(model, seq_BS[:, :cols], pad_B, capacity)
        t2 = clock()
        generated = sum(len(o) for o in out)
        return Generation(tokens=out, prefill_tokens=prompt_tokens, prefill_s=t1 - t0,  # type: ignore[operator]
                          decode_tokens=generated - len(rows), decode_s=t2 - t1)  # type: ignore[operator]


def generate_uncached(model, idx_BS: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                      top_k: int | None = None, top_p: float = 1.0, eos: int | Sequence[int] | None = None,
                      generator: torch.Generator | None = None) -> list[list[int]]:
    """The reference: each step runs the model on the last ``max_seq_len`` tokens of every row
    (``idx [B, S]``, no padding) and picks the next token from the last position. Returns the
    new tokens per row, cut after a stop token, as ``generate`` does."""
    with torch.no_grad():
        sampling = _check_args(model, max_new_tokens, generator, temperature=temperature, top_k=top_k, top_p=top_p,
                               eos=eos)
        _check_prompts(idx_BS if isinstance(idx_BS, torch.Tensor) else torch.as_tensor(idx_BS, device="cpu"),
                       model.config.vocab_size)  # a host list: checked on the host
        if not isinstance(idx_BS, torch.Tensor):  # then on the model's device, as a tensor prompt is
            idx_BS = torch.as_tensor(idx_BS, device=model.embed.weight.device)
        stop = sampling.eos
        out: list[list[int]] = [[] for _ in range(idx_BS.shape[0])]
        done = [False] * idx_BS.shape[0]
        for _ in range(max_new_tokens):
            logits_BV = model(idx_BS[:, -model.config.max_seq_len:])[:, -1, :]
            next_B = sample_next(logits_BV, sampling, generator)
            idx_BS = torch.cat([idx_BS, next_B.unsqueeze(1)], dim=1)
            for b, t in enumerate(next_B.tolist()):
                if not done[b]:
                    out[b].append(t)
                    done[b] = t in stop
            if all(done):
                break
        return out


def generate_tensor(model, idx_BS: torch.Tensor, max_new_tokens: int, *, use_cache: bool = True,
                    compile: bool = False, **kwargs: object) -> torch.Tensor:
    """``MoEGPT.generate``: ``idx [B, S]`` followed by the new tokens ``[B, S + n]``; a row that
    stopped early repeats its stop token up to the longest row's ``n``. ``compile``: as in
    ``generate`` (cached decoding only)."""
    if not isinstance(idx_BS, torch.Tensor) or idx_BS.dim() != 2 or idx_BS.shape[1] == 0:
        raise ValueError(f"idx must be [batch, seq] with at least one token per row, got "
                         f"{tuple(getattr(idx_BS, 'shape', ()))}")
    for name, flag in (("use_cache", use_cache), ("compile", compile)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    if compile and not use_cache:
        raise ValueError("compile=True decodes with the cached static step; it cannot go with use_cache=False")
    if use_cache:
        new = generate(model, idx_BS, max_new_tokens, compile=compile, **kwargs).tokens  # type: ignore[arg-type]
    else:
        new = generate_uncached(model, idx_BS, max_new_tokens, **kwargs)  # type: ignore[arg-type]
    n = max((len(r) for r in new), default=0)
    if n == 0:
        return idx_BS.clone()
    tail = torch.tensor([r + r[-1:] * (n - len(r)) for r in new], dtype=idx_BS.dtype, device=idx_BS.device)
    return torch.cat([idx_BS, tail], dim=1)

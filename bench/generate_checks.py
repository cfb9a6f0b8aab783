"""What keeps ``bench.generate``'s decode figures honest (issue 46): the checks and limits
beside its timings (legend: ``B`` rows, ``P`` prompt columns, ``V`` vocabulary, ``n`` new tokens).

- ``token_agreement``: greedy tokens of two runs, equal or the first step where they part.
  In fp32 compiled decode must give eager decode's tokens; in bf16 the two round differently,
  a near tie flips and the rows part after a few steps, so bf16 is held to its logits instead:
- ``eager_step_logits`` / ``compiled_step_logits`` / ``hf_step_logits`` and
  ``logits_difference``, gathered by ``first_step_logits``: the logits of the first decode
  step (after the prompt and one given token), each against the fp32 eager step's;
- ``fp32_token_check``: compiled and eager tokens of an fp32 model, which must be equal;
- ``like_for_like_ratios``: eager against eager, compiled against compiled, withdrawn where a
  compiled side compiled or recorded CUDA graphs in its timed calls;
- ``decode_step_bytes``, ``RouterHits`` and ``bandwidth_fraction``: the bytes a decode step must
  read (the floor) over the device's copy bandwidth, as a fraction of the measured step time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

__all__ = ["token_agreement", "fp32_token_check", "decode_step_bytes", "RouterHits", "bandwidth_fraction",
           "eager_step_logits", "compiled_step_logits", "hf_step_logits", "logits_difference", "first_step_logits",
           "like_for_like_ratios"]


def token_agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """``"identical"``, or ``"differ from step k"``: the first step (0: the first new token) at
    which any row of ``a`` and ``b`` differs (a row that ends early differs where it ends)."""
    if a == b:
        return "identical"
    if len(a) != len(b):
        raise ValueError(f"the runs have {len(a)} and {len(b)} rows")
    steps = [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), min(len(r), len(s))) for r, s in zip(a, b)
             if r != s]
    return f"differ from step {min(steps)}"


def decode_step_bytes(model, *, rows: int, cache_len: float,  # type: ignore[no-untyped-def]
                      experts_hit: Sequence[float]) -> dict:
    """The bytes one decode step of ``rows`` rows of a ``MoEGPT`` must read, each once (the floor
    a perfect kernel would still pay): the embedding rows of its tokens (the whole matrix where
    the head shares it), every parameter outside the routed experts (attention, norms, routers,
    shared experts, the head), the routed experts the step's tokens hit (``experts_hit[i]``
    distinct experts in MoE layer ``i``, in ``moe_layers`` order: ``RouterHits`` counts them; their weights' buffers too where they are
    stored quantised), and
    the keys and values of ``cache_len`` cached columns in every block. Parameters only: the
    routers' per-expert buffers are a few bytes. ``{"embedding", "dense", "experts", "kv_cache",
    "total"}`` in bytes."""
    from moeflow.layer.moe import moe_layers

    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    if not cache_len > 0:
        raise ValueError(f"cache_len must be > 0, got {cache_len!r}")
    layers = moe_layers(model)
    if len(experts_hit) != len(layers) or not all(0 <= h <= layer.config.num_experts
                                                  for h, layer in zip(experts_hit, layers)):
        raise ValueError(f"experts_hit must hold one count in [0, num_experts] per MoE layer ({len(layers)}), "
                         f"got {list(experts_hit)}")
    # the experts' weights: parameters, or buffers where they are stored quantised
    # (``FP8WeightExperts``' e4m3 codes and scales)
    per_expert = {id(p): (hit, layer.config.num_experts) for hit, layer in zip(experts_hit, layers)
                  for p in (*layer.experts.parameters(), *layer.experts.buffers())}
    expert_buffers = [b for layer in layers for b in layer.experts.buffers()]
    embed = model.embed.weight
    tied = model.lm_head.weight is embed
    out = {"embedding": 0.0, "dense": 0.0, "experts": 0.0}
    for p in (*model.parameters(), *expert_buffers):  # (each shared parameter once)
        nbytes = p.numel() * p.element_size()
        if id(p) in per_expert:
            hit, E = per_expert[id(p)]
            out["experts"] += nbytes / E * hit
        elif p is embed and not tied:
            out["embedding"] += rows * embed.shape[1] * embed.element_size()
        else:
            out["dense"] += nbytes
    # what one cached column holds, from the model's own cache (grouped-query keys and values,
    # or a latent attention's latent), at the step's mean length
    one = model.new_cache(torch.zeros(rows, dtype=torch.long, device=embed.device), 1)
    column = sum(t.numel() * t.element_size() for t in (*one.k, *one.v))
    out["kv_cache"] = float(column * cache_len)
    out["total"] = sum(out.values())
    return out


class RouterHits:
    """While active, the distinct experts each router call of ``model``'s MoE layers selected
    (a forward hook on each ``layer.router``); ``per_step()``: per MoE layer, the mean over a
    generation's decode steps (every call after the layer's first, the prefill)."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        from moeflow.layer.moe import moe_layers

        self.layers = moe_layers(model)
        self.calls: list[list[int]] = [[] for _ in self.layers]
        self._hooks: list = []

    def __enter__(self) -> RouterHits:
        for i, layer in enumerate(self.layers):
            self._hooks.append(layer.router.register_forward_hook(
                lambda mod, args, out, i=i: self.calls[i].append(int(out.ids_TK.unique().numel()))))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def per_step(self) -> list[float]:
        if any(len(c) < 2 for c in self.calls):
            raise ValueError(f"a generation with at least one decode step is needed, got router calls "
                             f"{[len(c) for c in self.calls]}")
        return [statistics.fmean(c[1:]) for c in self.calls]


def bandwidth_fraction(bytes_per_step: float, copy_gbps: float, step_s: float) -> float:
    """The step's time at the copy bandwidth (its bytes at ``copy_gbps`` GB/s) over the measured
    ``step_s``: 1 is a step as fast as its reads allow, 0.1 one ten times slower."""
    for name, value in (("bytes_per_step", bytes_per_step), ("copy_gbps", copy_gbps), ("step_s", step_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    return bytes_per_step / (copy_gbps * 1e9) / step_s


@torch.no_grad()
def eager_step_logits(model: torch.nn.Module, idx_BS: torch.Tensor, first_B: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, V]`` (fp32) of the eager decode step after the prompt ``idx_BS`` (no
    padding) and the token ``first_B`` (``MoEGPT.forward_cached``, as ``generate`` runs it)."""
    B, P = idx_BS.shape
    cache = model.new_cache(torch.zeros(B, dtype=torch.long, device=idx_BS.device), P + 1)
    model.forward_cached(idx_BS, cache)
    return model.forward_cached(first_B.unsqueeze(1), cache).float()


@torch.no_grad()
def compiled_step_logits(model, idx_BS: torch.Tensor, first_B: torch.Tensor,  # type: ignore[no-untyped-def]
                         max_new_tokens: int) -> torch.Tensor:
    """Logits ``[B, V]`` (fp32) of the first compiled decode step as ``generate(compile=True,
    max_new_tokens=...)`` runs it: on the compiled decoder's cache for that generation's capacity
    (compiled by an earlier such call, else compiled now), after the eager prefill of
    ``idx_BS`` and the token ``first_B``. Reaches into ``moeflow.models.compiled_decode``
    (the decoder, its cache and capacity rule): the generation returns tokens only."""
    from moeflow.models.compiled_decode import _bucket, compiled_decoder

    B, P = idx_BS.shape
    S = model.config.max_seq_len
    decoder = compiled_decoder(model)
    decoder.prepare(model)
    with decoder.generation(model):
        cache = decoder.cache(model, torch.zeros(B, dtype=torch.long, device=idx_BS.device),
                              _bucket(min(S, P + max_new_tokens - 1), S))
        model.forward_cached(idx_BS, cache)
        pos = torch.full((), P, dtype=torch.long, device=idx_BS.device)
        # (.clone(): a CUDA graph's output is overwritten by the next replay)
        return decoder.run(first_B, pos, cache, guarded=True).float().clone()


@torch.no_grad()
def hf_step_logits(hf, idx_BS: torch.Tensor, first_B: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Logits ``[B, V]`` (fp32) of transformers' model at the same position: its forward over
    the prompt and ``first_B``, last column."""
    ids = torch.cat([idx_BS, first_B.unsqueeze(1)], dim=1)
    return hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()


def logits_difference(got_BV: torch.Tensor, ref_BV: torch.Tensor) -> dict:
    """``{"max_abs", "max_rel", "top1_agree"}``: the largest absolute difference, that over the
    largest reference magnitude, and the fraction of rows whose argmax agrees."""
    if got_BV.shape != ref_BV.shape:
        raise ValueError(f"logits of shapes {tuple(got_BV.shape)} and {tuple(ref_BV.shape)}")
    got, ref = got_BV.double(), ref_BV.double()
    max_abs = float((got - ref).abs().max())
    return {"max_abs": max_abs, "max_rel": max_abs / float(ref.abs().max()),
            "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).double().mean())}


def fp32_token_check(model32, idx_BS: torch.Tensor, n: int) -> dict:  # type: ignore[no-untyped-def]
    """Greedy tokens of ``generate(model32, idx_BS, n)`` eager and with ``compile=True``, an
    fp32 model: ``{"checked": True, "equal", "agreement" (token_agreement), "rows",
    "new_tokens"}``. They must be equal: the two paths compute the same step, in an order that
    rounds differently only in the last fp32 bits."""
    from moeflow.models.generation import generate

    if next(model32.parameters()).dtype != torch.float32:
        raise ValueError(f"model32 must be an fp32 model, got {next(model32.parameters()).dtype}")
    eager = generate(model32, idx_BS, n, temperature=0).tokens
    comp = generate(model32, idx_BS, n, temperature=0, compile=True).tokens
    return {"checked": True, "equal": eager == comp, "agreement": token_agreement(eager, comp),
            "rows": idx_BS.shape[0], "new_tokens": n}


def first_step_logits(model: torch.nn.Module, model32: torch.nn.Module, idx_BS: torch.Tensor, *,
                      compiled_new_tokens: int | None = None, hf: torch.nn.Module | None = None) -> dict:
    """``{path: logits_difference}`` of the first decode step after the prompt ``idx_BS`` and
    the fp32 model's first (greedy) token: ``"moeflow"``, ``model``'s eager step;
    ``"moeflow:compiled"`` (with ``compiled_new_tokens``), its compiled step in a generation of
    that many tokens; ``"transformers"`` (with ``hf``), transformers' model at the same
    position; each against ``model32``'s eager step (``model32``: the same weights in fp32)."""
    first_B = model32(idx_BS)[:, -1].argmax(-1)
    ref = eager_step_logits(model32, idx_BS, first_B)
    out = {"moeflow": logits_difference(eager_step_logits(model, idx_BS, first_B), ref)}
    if compiled_new_tokens is not None:
        out["moeflow:compiled"] = logits_difference(
            compiled_step_logits(model, idx_BS, first_B, compiled_new_tokens), ref)
    if hf is not None:
        out["transformers"] = logits_difference(hf_step_logits(hf, idx_BS, first_B), ref)
    return out


def like_for_like_ratios(rows: list[dict]) -> list[dict]:
    """Like with like (> 1: moeflow faster): eager over transformers' fastest eager generate,
    compiled over transformers' static-cache compiled generate, compiled over eager moeflow; a
    ratio whose sides compiled or recorded CUDA graphs in their timed calls is withdrawn."""
    by = {r["candidate"]: r for r in rows}
    eager_hf = [r for name, r in by.items() if name.startswith("hf:") and name != "hf:static" and r["decode_tok_s"]]
    pairs = []
    if eager_hf:
        pairs.append(("moeflow eager / transformers eager", by["moeflow"],
                      max(eager_hf, key=lambda r: r["decode_tok_s"])))
    if "moeflow:compiled" in by and "hf:static" in by:
        pairs.append(("moeflow compiled / transformers static-cache compiled", by["moeflow:compiled"], by["hf:static"]))
    if "moeflow:compiled" in by:
        pairs.append(("moeflow compiled / moeflow eager", by["moeflow:compiled"], by["moeflow"]))
    out = []
    for label, a, b in pairs:
        busy = [f"{r['candidate']} ({r['timed_compile']['graphs']} graphs compiled, "
                f"{r['timed_compile']['cuda_graphs']} CUDA graphs recorded)"
                for r in (a, b) if r["timed_compile"]["graphs"] or r["timed_compile"]["cuda_graphs"]]
        withdrawn = (f"{' and '.join(busy)} during the timed calls: their time includes compilation"
                     if busy else None)
        out.append({"pair": label, "batch": a["batch"], "new_tokens": a["new_tokens"], "candidate": a["candidate"],
                    "baseline": b["candidate"], "withdrawn": withdrawn,
                    "decode_x": None if withdrawn or not (a["decode_tok_s"] and b["decode_tok_s"])
                    else a["decode_tok_s"] / b["decode_tok_s"],
                    "prefill_x": None if withdrawn else a["prefill_tok_s"] / b["prefill_tok_s"]})
    return out

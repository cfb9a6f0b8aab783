"""What a Hugging Face model family is to the converter (``Family``), and reading its
``config.json`` so that no field is ignored unnoticed (``Fields``).

A family is its ``model_type`` plus three functions: ``config_from_hf`` (``config.json`` dict ->
``GPTConfig``), ``hf_config_from`` (``GPTConfig`` -> the family's own ``config.json`` dict, for
``--to-hf``) and ``tensor_map`` (``GPTConfig`` -> the ``Entry`` list of
``moeflow.convert.tensor_map``: every moeflow tensor and the HF tensors it comes from). The
registry of families and the directory-level functions are in ``moeflow.convert.hf``.

``config_from_hf`` reads through a ``Fields``: every read is recorded, a field read with the
wrong type is refused by name and value, and ``Fields.done`` refuses every field nothing read
(its name and value), except the fields in ``IGNORED``, which concern transformers' Python API
or are taken from other files, never the weights' meaning:

- ``transformers_version``, ``architectures``, ``_name_or_path``, ``model_type`` (the family
  itself), ``torch_dtype`` / ``dtype`` (the tensors carry their own dtypes);
- what a forward call returns: ``use_cache``, ``output_router_logits``, ``output_hidden_states``,
  ``output_attentions``, ``return_dict``, ``chunk_size_feed_forward`` (chunked feed-forward
  changes memory, not values), ``is_encoder_decoder``, and the classification heads'
  ``id2label``, ``label2id``, ``problem_type``;
- ``bos_token_id``, ``eos_token_id``, ``pad_token_id``: kept with the tokenizer
  (``moeflow.convert.hf_tokenizer``), checked against the vocabulary there;
- ``quantization_config``: how the weights are stored (``moeflow.convert.quant``).

RoPE: ``rope_from_hf`` / ``rope_to_hf`` map transformers' ``rope_parameters`` (or the older
``rope_theta`` + ``rope_scaling`` + ``partial_rotary_factor``) to ``rope_theta``,
``RopeScaling`` and ``AttentionConfig.rotary_fraction``, for every family.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from moeflow.checkpoint.schema import CheckpointError
from moeflow.convert.tensor_map import Entry
from moeflow.models.gpt_config import GPTConfig, RopeScaling

__all__ = ["Family", "Fields", "IGNORED", "REQUIRED", "rope_from_hf", "rope_to_hf"]

IGNORED = frozenset({
    "transformers_version", "architectures", "_name_or_path", "model_type", "torch_dtype", "dtype",
    "use_cache", "output_router_logits", "output_hidden_states", "output_attentions", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "quantization_config",
})

REQUIRED = object()  # a field without a default: absent is an error
_KINDS = {"count": "an int >= 1", "index": "an int >= 0", "number": "a finite number >= 0", "bool": "a bool",
          "str": "a string", "dict": "a JSON object", "list": "a JSON list"}


@dataclass(frozen=True, kw_only=True)
class Family:
    """One Hugging Face model family: ``model_type`` (``config.json``'s), ``name`` (for messages),
    and the three functions of the module docstring."""

    model_type: str
    name: str
    config_from_hf: Callable[[dict], GPTConfig]
    hf_config_from: Callable[[GPTConfig], dict]
    tensor_map: Callable[[GPTConfig], list[Entry]]
    left_out: Callable[[dict], dict[str, str]] = lambda hf: {}
    """``{tensor name prefix: why}`` of what the checkpoint of ``config.json`` ``hf`` stores and
    moeflow leaves out on purpose (DeepSeek-V3's multi-token-prediction block): warned about at
    load, not refused; every other tensor without a place is refused."""


class Fields:
    """A ``config.json`` dict (or one of its nested objects, ``where`` naming it) read field by
    field. ``get`` checks a field's type; ``expect`` refuses a value moeflow cannot express;
    ``mark`` records fields another function reads from the plain dict (``hf``); ``done``
    refuses what nothing read."""

    def __init__(self, hf: object, family: str, where: str = "config.json") -> None:
        if not isinstance(hf, dict):
            raise CheckpointError(f"{where}: a JSON {type(hf).__name__}, expected an object")
        self.hf, self.family, self.where = hf, family, where
        self.read: set[str] = set()

    def get(self, name: str, kind: str, default: object = REQUIRED) -> object:
        """``hf[name]`` checked to be ``kind`` (a key of ``_KINDS``); absent or null gives
        ``default`` (``CheckpointError`` when there is none)."""
        self.read.add(name)
        value = self.hf.get(name)
        if value is None:
            if default is REQUIRED:
                raise CheckpointError(f"{self.where}: required field {name!r} is missing" if name not in self.hf else
                                      f"{self.where}: {name}=null, expected a value")
            return default
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = {"count": number and isinstance(value, int) and value >= 1,
              "index": number and isinstance(value, int) and value >= 0,
              "number": number and math.isfinite(value) and value >= 0,
              "bool": isinstance(value, bool), "str": isinstance(value, str), "dict": isinstance(value, dict),
              "list": isinstance(value, list)}[kind]
        if not ok:
            raise CheckpointError(f"{self.where}: {name}={value!r:.60} ({type(value).__name__}), expected {_KINDS[kind]}")
        return value

    def expect(self, name: str, kind: str, supported: object, default: object = REQUIRED) -> object:
        """``get`` that refuses any value but ``supported`` (naming the field and the value)."""
        value = self.get(name, kind, default)
        if value != supported:
            raise CheckpointError(f"{self.where}: {name}={value!r:.60} is not supported by moeflow's {self.family} "
                                  f"conversion (it needs {supported!r})")
        return value

    def section(self, name: str) -> "Fields | None":
        """The nested object ``hf[name]`` as ``Fields`` (None when absent or null); its own
        ``done`` refuses its unread keys."""
        value = self.get(name, "dict", None)
        return None if value is None else Fields(value, self.family, f"{self.where}: {name}")

    def mark(self, names: Iterable[str]) -> dict:
        """Record ``names`` as read by a function that takes the plain dict, and return it."""
        self.read.update(names)
        return self.hf

    def done(self, ignored: Iterable[str] = IGNORED) -> None:
        """``CheckpointError`` naming every field (and its value) that nothing read and that is
        not in ``ignored``: a field moeflow does not know may change the model, so it is
        refused rather than dropped."""
        left = sorted(set(self.hf) - self.read - set(ignored))
        if left:
            shown = ", ".join(f"{k}={self.hf[k]!r:.40}" for k in left[:8])
            raise CheckpointError(f"{self.where}: field(s) {shown} not understood by moeflow's {self.family} "
                                  "conversion (refused rather than ignored)")


def rope_from_hf(fields: Fields, max_seq_len: int, default_theta: float) -> tuple[float, RopeScaling | None, float]:
    """``(rope_theta, rope_scaling, rotary_fraction)`` of a ``config.json``: transformers 5's
    ``rope_parameters`` object, else the older top-level ``rope_theta``, ``rope_scaling`` and
    ``partial_rotary_factor``. Types ``default``, ``linear`` and ``yarn``; any other is refused, and
    so is a field the type does not take (a linear RoPE's ``beta_fast``).
    YaRN's defaults are transformers': ``factor`` = ``max_position_embeddings /
    original_max_position_embeddings`` when absent, ``beta_fast``/``beta_slow`` 32/1 when absent
    or 0, ``mscale``/``mscale_all_dim`` used only when both are set (else None)."""
    theta = fields.get("rope_theta", "number", None)
    fraction = fields.get("partial_rotary_factor", "number", None)
    rope, old = fields.section("rope_parameters"), fields.section("rope_scaling")
    if rope is not None and old is not None and rope.hf != old.hf:
        raise CheckpointError(f"{fields.where}: rope_parameters={rope.hf!r:.60} and rope_scaling={old.hf!r:.60} "
                              "disagree (give one)")
    rope = rope or old
    if rope is not None:
        theta = rope.get("rope_theta", "number", theta)
        fraction = rope.get("partial_rotary_factor", "number", fraction)
    if not (fraction is None or 0 < fraction <= 1):
        raise CheckpointError(f"{(rope or fields).where}: partial_rotary_factor={fraction!r} must be in (0, 1]")
    theta, fraction = float(default_theta if theta is None else theta), float(1.0 if fraction is None else fraction)
    if rope is None:
        return theta, None, fraction
    kind = rope.get("rope_type", "str", None) or rope.get("type", "str", "default")
    if kind not in ("default", "linear", "yarn"):
        raise CheckpointError(f"{rope.where}.rope_type={kind!r:.40} is not supported (moeflow's GPT has 'default', "
                              "'linear' and 'yarn')")
    scaling = None
    try:
        if kind == "linear":
            scaling = RopeScaling(kind="linear", factor=float(rope.get("factor", "number")))
        elif kind == "yarn":
            original = rope.get("original_max_position_embeddings", "count", max_seq_len)
            mscale, mscale_all = rope.get("mscale", "number", None), rope.get("mscale_all_dim", "number", None)
            both = bool(mscale) and bool(mscale_all)
            scaling = RopeScaling(
                kind="yarn", factor=float(rope.get("factor", "number", None) or max_seq_len / original),
                original_max_seq_len=original, beta_fast=float(rope.get("beta_fast", "number", None) or 32.0),
                beta_slow=float(rope.get("beta_slow", "number", None) or 1.0),
                mscale=float(mscale) if both else None, mscale_all_dim=float(mscale_all) if both else None,
                attention_factor=rope.get("attention_factor", "number", None), truncate=rope.get("truncate", "bool", True))
    except ValueError as err:  # RopeScaling's own checks (a CheckpointError is one too: kept as it is)
        raise err if isinstance(err, CheckpointError) else CheckpointError(f"{rope.where}: {err}") from None
    # each type's own fields were read above (get records them): another type's field (a linear
    # RoPE's beta_fast, say, from a YaRN config retyped by hand) is refused, not ignored; transformers
    # too knows only rope_type, factor, rope_theta and partial_rotary_factor in a linear RoPE
    rope.mark(("rope_type", "type", "rope_theta", "partial_rotary_factor"))
    rope.done(ignored=())
    return theta, scaling, fraction


def rope_to_hf(cfg: GPTConfig) -> dict:
    """transformers 5's ``rope_parameters`` for ``cfg`` (the inverse of ``rope_from_hf``)."""
    out: dict = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.attention.rotary_fraction != 1.0:
        out["partial_rotary_factor"] = cfg.attention.rotary_fraction
    s = cfg.rope_scaling
    if s is not None:
        out.update(rope_type=s.kind, factor=s.factor)
        if s.kind == "yarn":
            out.update(original_max_position_embeddings=s.original_max_seq_len, beta_fast=s.beta_fast,
                       beta_slow=s.beta_slow, truncate=s.truncate)
            out.update({k: v for k, v in (("mscale", s.mscale), ("mscale_all_dim", s.mscale_all_dim),
                                          ("attention_factor", s.attention_factor)) if v is not None})
    return out

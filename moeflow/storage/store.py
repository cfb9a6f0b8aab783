"""The model's side of an expert store: ``offload_experts`` moves a model's routed experts into
an ``ExpertStore`` and puts a ``StoredExperts`` (the experts protocol) in each MoE layer.

Legend: moeflow.types (``E`` experts, ``D`` model dim).

The layer keeps calling ``self.experts(expert_in, counts_E)``; ``StoredExperts`` owns no
parameters and asks the store for the weights on each call, so the layer never learns where
they live (see the package docstring for why a module and not a hook). Which fast-tier layout
serves the model (``RingStreamer`` or ``ExpertCache``) is decided once, when the store is built
from ``config.mode``.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.experts.ffn import GroupedExperts
from moeflow.storage.base import ExpertStore
from moeflow.storage.config import StorageConfig

__all__ = ["StoredExperts", "offload_experts"]

_NO_COPY = ("a model with offloaded experts cannot be copied or pickled: its expert weights live in an "
            "ExpertStore; copy the model before offload_experts, or read store.layer_weights(i)")


class StoredExperts(nn.Module):
    """The experts protocol (``forward(expert_in, counts_E) -> expert_out``) over one layer of
    an ``ExpertStore``: it owns no parameters; each call fetches the layer's weights from the
    store (ring slot or cached experts) and runs exactly ``GroupedExperts``' math on them."""

    # the experts protocol's flag: the parameters live in the store, not in this module (what
    # checkpoint code reads, rather than knowing this class)
    resident = False

    def __init__(self, store: ExpertStore, layer: int) -> None:
        super().__init__()
        if not isinstance(store, ExpertStore):
            raise TypeError(f"store must be an ExpertStore, got {type(store).__name__}")
        store._check_layer(layer)
        # a plain attribute (not a submodule): the store is shared by every layer
        object.__setattr__(self, "store", store)
        self.layer = layer
        self.num_experts = store.layers[layer].num_experts
        self.dim = store.layers[layer].template.dim

    def extra_repr(self) -> str:
        c = self.store.config
        return f"layer={self.layer}, num_experts={self.num_experts}, offload={c.offload}, mode={c.mode}"

    def forward(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return self.store.run(self.layer, expert_in, counts_E)

    # state_dict: the layer's expert weights under the in-memory names (``...experts.w_in``),
    # host copies read from the store, so a checkpoint of the offloaded model is complete and
    # equals the in-memory model's; loading one writes them into the store's home tier
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, t in self.store.layer_weights(self.layer).items():
            destination[prefix + name] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,  # type: ignore[no-untyped-def]
                              unexpected_keys, error_msgs) -> None:
        store = self.store
        store._require_open()
        home = store.layers[self.layer].home
        loaded = {}
        for name, dst in home.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            src = state_dict[key]
            if tuple(src.shape) != tuple(dst.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(src.shape)}, "
                                  f"the stored experts have shape {tuple(dst.shape)}")
                continue
            loaded[name] = src
        if loaded:  # written into the home tier (disk: checksums renewed), every slot forgotten
            store.set_layer_weights(self.layer, loaded)

    # the store owns a copy thread and files: a copy would share (or fight over) them
    def __deepcopy__(self, memo: dict) -> StoredExperts:
        raise TypeError(_NO_COPY)

    def __getstate__(self) -> dict:
        raise TypeError(_NO_COPY)


def offload_experts(model: nn.Module, config: StorageConfig) -> ExpertStore:
    """Move the routed experts of every MoE layer of ``model`` into a new ``ExpertStore`` (a
    ``RingStreamer`` for ``config.mode="ring"``, an ``ExpertCache`` for ``"cache"``).

    Each module with a ``GroupedExperts`` child named ``experts`` (every ``moeflow.MoE`` with
    built-in experts), in ``model.modules()`` order (the execution order of ``MoEGPT``), gets a
    ``StoredExperts`` in its place; the original parameters are dropped from the model, so
    ``model.parameters()`` afterwards is the dense part only. Returns the store.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    owners = [m for m in model.modules() if isinstance(getattr(m, "experts", None), GroupedExperts)]
    if not owners:
        raise ValueError(f"model has no MoE layer with GroupedExperts experts: {type(model).__name__}")
    store = ExpertStore([m.experts for m in owners], config)
    for i, owner in enumerate(owners):
        owner.experts = StoredExperts(store, i)
    return store

"""Deprecated alias of ``moeflow.convert.mixtral`` (Mixtral weight conversion), kept for one
release: importing it warns with a ``DeprecationWarning``; import from the new module instead."""

import warnings

from moeflow.convert.mixtral import (
    gpt_config_from_hf,
    gpt_from_hf,
    gpt_to_hf,
    hf_config_from_gpt,
    read_hf,
    read_hf_config,
    state_dict_from_hf,
    state_dict_to_hf,
    write_hf,
)

__all__ = ["gpt_config_from_hf", "hf_config_from_gpt", "state_dict_from_hf", "state_dict_to_hf",
           "read_hf", "read_hf_config", "write_hf", "gpt_from_hf", "gpt_to_hf"]

warnings.warn("moeflow.models.hf is deprecated and will be removed in the next release; "
              "import from moeflow.convert.mixtral", DeprecationWarning, stacklevel=2)

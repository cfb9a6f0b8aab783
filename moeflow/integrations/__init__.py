"""Drop-ins for other libraries' MoE models.

``moeflow.integrations.hf``: the MoE blocks of Hugging Face transformers 5.x models on moeflow's
index dispatch and grouped GEMMs (needs ``transformers``; import it explicitly, so that
``import moeflow`` never imports transformers).
"""

__all__ = ["hf"]


def __getattr__(name: str) -> object:
    # lazy: ``moeflow.integrations.hf`` imports transformers, an optional dependency
    if name == "hf":
        import importlib

        return importlib.import_module("moeflow.integrations.hf")
    raise AttributeError(f"module 'moeflow.integrations' has no attribute {name!r}")

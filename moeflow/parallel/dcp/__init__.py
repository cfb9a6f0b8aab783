"""PyTorch's distributed checkpoint (DCP) for expert- and vocabulary-parallel models: global
views of the shards (``state``, ``layout``, ``tensor``), the guard that refuses a rank-local
plain state dict (``guard``), the directory's files (``files``) and conversion between moeflow
checkpoints and DCP (``convert``). Import from the modules (or the public names from
``moeflow.parallel``)."""

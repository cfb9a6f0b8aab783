"""Conversion between moeflow's formats and other libraries' (``moeflow convert``): Hugging Face
model directories both ways. ``hf`` is the entry (the registry of families, ``gpt_from_hf``,
``gpt_to_hf``, ``import_hf``); ``family`` and ``tensor_map`` say what a family is (config both
ways, where each tensor lives); one module per family (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``,
``deepseek_v3``, ``gpt_oss``; ``gqa`` what the grouped-query ones share, ``moe_blocks`` every
family's MoE half); ``hf_model`` fills a model
through a family's map; ``hf_files`` (config.json, safetensors, read lazily as untrusted input),
``hf_tokenizer`` (special tokens, tokenizer and generation files), ``chat`` (the chat template they
keep, rendered by transformers' sandboxed renderer) and ``quant`` (quantised
weights, dequantised at load) are the files. Above ``models`` and ``checkpoint``, which it
uses."""

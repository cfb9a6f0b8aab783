"""The serving engine with its decode step compiled: concurrent greedy requests give the tokens
of sequential ``generate`` calls (``test_serve_engine.py``'s eager test, compiled). Apart from
that file because the compilation takes about 15 s: the ``serve`` mutation run
(``tests/tools/mutation_run.py``) runs the eager file's tests for every mutant of the engine.
"""

from __future__ import annotations

import pytest

from moeflow.models.compiled_decode import compiled_decoder
from moeflow.serve.engine import Engine, EngineConfig

from test_serve_engine import _greedy_against_generate, model  # noqa: F401  (the module's model fixture)


@pytest.mark.e2e
def test_compiled_concurrent_greedy_requests_give_sequential_generates_tokens(model, gen, monkeypatch):  # noqa: F811
    """The same, the decode step compiled (two slots: one graph for one row, one for two, both
    compiled when the engine starts; the model's eager step never runs)."""
    before = compiled_decoder(model).compilations
    engine = Engine(model, EngineConfig(slots=2, max_queue=8, prefill_chunk=5, compile=True))
    eager: list[tuple] = []
    real = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda *args: eager.append(args) or real(*args))
    try:
        _greedy_against_generate(engine, model, gen)
    finally:
        engine.shutdown(drain_s=0)
    assert compiled_decoder(model).compilations - before == 2 and eager == []

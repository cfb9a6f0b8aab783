"""``moeflow serve``: an OpenAI-compatible HTTP server with continuous batching over fixed decode
slots (issue 48). ``engine.py`` is the batching engine (one thread owns the model; its types in
``request.py``, the model side of its slots in ``slots.py``); the HTTP layer sits on top of it:
``protocol.py`` (OpenAI's bodies), ``text.py`` (the tokenizer side: prompts, chats, incremental
detokenization, stop strings), ``metrics.py`` (Prometheus), ``app.py`` (the FastAPI app) and
``server.py`` (uvicorn, draining on SIGTERM). The public names are imported from their modules."""

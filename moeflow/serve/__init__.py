"""``moeflow serve``: an OpenAI-compatible HTTP server with continuous batching over fixed decode
slots (issue 48). ``engine.py`` is the batching engine (one thread owns the model; its types in
``request.py``, the model side of its slots in ``slots.py``); the HTTP layer sits on top of it.
The public names are imported from their modules."""

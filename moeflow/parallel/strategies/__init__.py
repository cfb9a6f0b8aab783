"""How an expert-parallel call runs (``base``: ``ExpertGroup`` = where, ``Call`` = what): rows to
their experts' ranks (``expert``, pipelined in chunks: ``pipeline``), expert weights to the rows
(``data``), hidden slices of every expert on every rank (``sharded``, ``slices``) or on ``r``
ranks per expert (``hybrid``). The dispatcher (``moeflow.parallel.dispatcher``) picks one per
call. Import from the modules."""

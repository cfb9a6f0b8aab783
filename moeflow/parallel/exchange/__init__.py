"""The exchange of expert parallelism: the group's slot assignment (``assignment``: capacity,
drops, replicas, hidden slices, each rank's send and receive side), a rank's ``ExchangePlan``
(``plan``) and the all-to-all that moves the rows (``alltoall``: flat, or two-level over nodes).
Import from the modules (or the public names from ``moeflow.parallel``)."""

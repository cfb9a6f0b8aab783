"""Where experts live and which way a call runs: the placement of experts and replicas on ranks
(``plan``), moving experts by the observed load (``rebalance``), the exchange's cost model
(``costmodel``) and the run-time tuner of parallel modes (``tuner``). Import from the modules (or
the public names from ``moeflow.parallel``)."""

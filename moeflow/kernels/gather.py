"""Row gather whose backward is also a gather (legend: moeflow.types).

Dispatch and combine both move rows along a *partial one-to-K mapping*: every output row comes
from at most one source row, and every source row feeds at most K output rows (K = top-k for
dispatch, 1 for combine). Autograd's default backward of ``index_select`` is a scatter-add
(``index_add``), which is serial and slow on CPU and needs atomics on GPU. Because the mapping is
known in both directions, the backward can be written as a gather too:

    forward:  out_MD[m] = src_ND[index_M[m]]                 if valid_M[m] else 0
    backward: grad_src_ND[n] = sum_k grad_out_MD[rev_NK[n, k]] if rev_valid_NK[n, k]

Contract (the dispatcher guarantees it): for every valid ``m`` there is exactly one valid
``(n, k)`` with ``n = index_M[m]`` and ``rev_NK[n, k] = m``, and conversely.

``gather_rows`` is ``moeflow.kernels.permute.permute_rows`` without weights (one custom op,
the Triton gather-reduce on CUDA); ``gather_rows_reference`` is the plain autograd version
(index_select + mask) that the tests compare against. Both live in ``moeflow.kernels.permute``.
"""

from __future__ import annotations

from moeflow.kernels.permute import gather_rows, gather_rows_reference

__all__ = ["gather_rows", "gather_rows_reference"]

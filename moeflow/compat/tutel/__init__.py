"""A Tutel-compatible entry point on moeflow: change one import.

    # from tutel import moe as tutel_moe
    from moeflow.compat.tutel import moe as tutel_moe

    layer = tutel_moe.moe_layer(
        gate_type={"type": "top", "k": 2, "capacity_factor": 1.0, "gate_noise": 1.0, "fp32_gate": True},
        model_dim=512,
        experts={"type": "ffn", "count_per_node": 8, "hidden_size_per_expert": 2048,
                 "activation_fn": lambda x: torch.nn.functional.relu(x)},
        scan_expert_func=lambda name, p: setattr(p, "skip_allreduce", True),
    )
    y = layer(x)                     # x [..., 512] -> y [..., 512]
    loss = task_loss(y) + 0.01 * y.l_aux

Modules mirror Tutel's: ``moe`` (``moe_layer``, ``fast_encode``, ``fast_decode``,
``extract_critical`` alias ``top_k_routing``, ``fast_cumsum_sub_one``, ``fast_dispatcher``),
``impls.moe_layer``, ``impls.fast_dispatch`` (also ``get_dispatch_count``, ``GatingEncoder``,
``GatingDecoder``), ``impls.losses``, ``jit_kernels.gating``, and the parts of ``system`` and
``net`` that Tutel's examples use (session set-up, ``all_to_all``, ``simple_all_reduce``,
``zero_gather``, ``create_groups_from_world``), so the examples run with
``from moeflow.compat.tutel import system, moe, net``. ``moe_layer`` is a
subclass of ``moeflow.MoE`` (routing is Tutel's, dispatch/experts/combine are moeflow's index
dispatch and grouped experts), so moeflow's tools (``moeflow.parallel``, ``moeflow.aux_loss``,
checkpoints) see it as an MoE layer.

Semantics reproduced (Tutel's documented equations):
    - gate: ``logits = x W_g^T`` (``'top'``) or the cosine router (``'cosine_top'``,
      ``proj_dim``/``init_t``, temperature clamped at 1/0.01); in training, ``gate_noise``
      adds ``randn * gate_noise / E`` to the logits; ``scores = softmax(noisy logits)``;
      top-k of the scores; gates = picked scores, divided by their sum when
      ``normalize_gate`` and k > 1 (not for k = 1).
    - capacity (``tutel_capacity``): ``n = ceil(T/E)``; cf > 0: ``C = K * int(cf * n)``;
      cf = 0: dropless; cf < 0: dropless capped at ``K * int(|cf| * n)``; then rounded up to a
      multiple of ``a2a_ffn_overlap_degree`` (Tutel's ``sharded_count * degree`` alignment, on
      one process too; with Tutel's ``megablocks_size`` inference, of that). It is translated to
      moeflow's ``C = min(T, ceil(cf' T K / E))`` by ``moeflow_capacity_factor`` (checked to
      give the same C exactly; clipping to T never changes a result).
    - slots: first choices of all tokens before second choices, tokens in order (moeflow
      ``drop_policy="position"``); ``batch_prioritized_routing``: inside each choice, tokens by
      descending best score (``"bpr"``). Overflowing assignments contribute 0; the other
      gates are not renormalised.
    - ``is_postscore``: gate applied to the expert output (True) or input (False).
    - gates: ``'top'``, ``'cosine_top'``, the string form ``'Top<k>Gate'``, and custom gate
      modules (``{'type': 'custom', 'module': cls, ...}``: ``cls(model_dim=, num_global_experts=,
      **entries)``, its ``top_k`` and optional ``capacity_factor``/``gate_noise`` read back).
    - experts: ``'ffn'`` (``activation_fn`` or ``activation_fn_with_self(h, experts)``),
      ``'llama_ffn'`` (SwiGLU, as moeflow's ``GroupedExperts``) and ``'custom'`` modules.
    - ``l_aux`` (``y.l_aux`` and ``layer.l_aux``): GShard loss on the top-1 choice,
      ``E * sum_e mean_t(scores) * mean_t(onehot(top1))``, on the noisy scores; with
      ``is_gshard_loss=False``, Tutel's importance + load loss.
    - ``scan_expert_func(name, param)`` on every expert parameter at construction (Tutel's
      names: ``batched_fc1_w [e, H, D]``, ``batched_fc2_w [e, H, O]``, ``batched_fc1_bias``,
      ``batched_fc2_bias``); expert parameters also get ``_tutel_expert`` and ``moeflow_expert``.
    - ``group``: expert parallelism with ``moeflow.parallel.expert_parallel`` over
      ``count_per_node * W`` experts (None: the default group if torch.distributed is
      initialised, else one process).

Differences from Tutel (bugs fixed or choices made; each deliberate):
    1. Per-call ``capacity_factor=0`` means dropless; Tutel's ``capacity_factor or default``
       silently used the gate's default instead.
    2. A tiny positive cf gives ``C >= 1`` (clamped); Tutel gave ``C = 0`` and dropped every
       token. The same clamp applies to the cap of a negative cf.
    3. ``ffn`` experts without ``activation_fn`` use ReLU (some Tutel versions crash).
    4. Bad arguments raise ``ValueError``/``TypeError`` naming the argument and value: unknown
       gate types or gate/expert keys, ``k`` > E (Tutel clamps k silently), negative or zero
       ``count_per_node`` (sharded experts are not supported), ``a2a_ffn_overlap_degree`` < 1
       (and > 1 together with batch-prioritized routing, normalised gates at k > 1 and
       ``is_postscore``), ``parallel_type`` != ``'adaptive:1'``, ``adaptive_r`` not in (None, 1), ``use_2dh=True``.
       Unknown keyword arguments raise ``TypeError`` naming the keyword, as in Tutel, which
       also accepts and ignores ``pad_samples`` (so does this layer).
    5. With ``group=`` and drops (cf != 0), capacity and drop priority are moeflow's
       expert-parallel semantics: the result equals the single-process layer on the group's
       concatenated batch (one pool of about ``W * C`` slots per expert, global first-choice
       priority); Tutel gives every source rank its own ``C`` slots. Identical when nothing
       is dropped (always with cf = 0). ``T`` in the capacity rule is the group's largest
       token count (Tutel's ``inequivalent_tokens=True`` rule, equal to its default when every
       rank holds as many tokens), so every rank agrees on ``C`` and ranks may hold different
       token counts (never a hang); ``inequivalent_tokens`` is therefore accepted and needs
       nothing. ``l_aux`` is per rank, as in Tutel.
    6. ``fp32_gate=False`` computes the gate in the input dtype promoted to at least fp32
       (moeflow's router rule), not in fp16/bf16. Dispatch/combine run in the experts' dtype
       (fp64 stays fp64); Tutel casts to the gate's dtype and its dispatch kernels then run in
       fp32 for anything but fp16, so Tutel rounds fp64 tokens to fp32 on the way through.
    7. ``batch_prioritized_routing`` ties (equal best scores) are broken by token index
       (Tutel's argsort is not stable).
    8. Custom experts (``{'type': 'custom', 'module': cls, ...}``): ``cls`` is called with the
       other entries plus whichever of ``model_dim``, ``local_experts``/``num_experts_per_device``
       and ``sharded_count`` (=1) its signature takes (an ``nn.Module`` instance is used as
       is); it holds this rank's experts and is called as ``module(x [e, N, D], layer)``. In
       dropless mode N is the largest expert's row count (rows past an expert's own count are
       zero padding whose output is dropped).
    9. State-dict keys are moeflow's (``router.linear.weight``, ``extra_gates.i...``,
       ``experts.batched_fc1_w``): a Tutel checkpoint needs its gate keys renamed
       (``gates.0.wg.weight`` -> ``router.linear.weight``); expert keys match.
    10. ``seeds=(a, b, c)``: ``b`` seeds the experts, ``a`` (+ gate index) the gates, ``c`` the
        RNG afterwards. Initial values differ from Tutel's (different draw order).
    11. ``batch_prioritized_routing`` with ``capacity_factor <= 0``: the dropless capacity is the
        largest expert's true count. Tutel reads it (and its dispatch count) from the last row
        of its location scan, which under batch-prioritized ordering is the last token's row, not
        the per-expert total, so Tutel's "dropless" mode drops tokens there. A Tutel bug fixed.
    12. ``llama_ffn`` experts hold moeflow's ``w_in [E, D, 2H]`` (``W_fc1`` then ``W_fc2``) and
        ``w_out [E, H, D]`` (``W_fc3``); Tutel's flat ``W_fc1/2/3`` state-dict entries load
        (one process). Custom gates sit under ``router.module.`` (gate 0) or
        ``extra_gates.<i-1>.module.``; Tutel's keys are ``gates.<i>.``.
    13. ``megablocks_size`` runs the same grouped experts (its capacity alignment is kept, so
        the result is Tutel's); ``dispatch_count`` is the whole layer's ``[E]`` count.
"""

from moeflow.compat.tutel import impls, jit_kernels, moe, net, system
from moeflow.compat.tutel.impls.fast_dispatch import (
    extract_critical,
    fast_cumsum_sub_one,
    fast_decode,
    fast_dispatcher,
    fast_encode,
    tutel_capacity,
)
from moeflow.compat.tutel.impls.moe_layer import MOELayer, moe_layer, moeflow_capacity_factor

__all__ = [
    "moe",
    "net",
    "system",
    "impls",
    "jit_kernels",
    "moe_layer",
    "MOELayer",
    "fast_encode",
    "fast_decode",
    "extract_critical",
    "fast_cumsum_sub_one",
    "fast_dispatcher",
    "tutel_capacity",
    "moeflow_capacity_factor",
]

"""The GPU acceptance run: one command that shows what moeflow does on a CUDA machine.

    python -m bench.gpu_check            # CUDA, bf16, full shapes, in a 540 s budget (H100 runs: docs/benchmarks.md)
    python -m bench.gpu_check --smoke    # the same stages at tiny shapes on CPU (= --device cpu --tiny)
    make gpu-check

Every stage runs in subprocesses of its own, with its own timeout, under one overall time budget
(``--budget``); a stage that fails or times out is recorded (its log under ``--out-dir/logs``)
and the run goes on. Nothing needs moeflow installed: the subprocesses run ``sys.executable``
with the repository root on ``PYTHONPATH``. Stages, in order (each module's docstring says more):

    gpu-tests  ``pytest -m gpu`` on the test files that mark a test ``gpu`` (``gpu_tests``)
    kernels    ``bench.gpu_kernels``: mm TFLOP/s, copy GB/s, the layer per experts backend (``kernels``)
    hf-layer   the ``moeflow.MoE`` layer against transformers' ``grouped_mm`` experts on the same
               weights, fwd and fwd+bwd, and ScatterMoE where installed (``hf_layer``)
    train      a 1-rank torchrun ``moeflow train`` (tiny preset): a checkpoint (``training``)
    resume     the same run resumed with more steps (``training``)
    dcp        ``torch.distributed.checkpoint`` save/load of the trained model and optimizer, and
               the train checkpoint converted to DCP (``training``)
    generate   ``moeflow generate`` from that checkpoint, sampled and greedy (``generation``)
    infer      ``moeflow infer --offload disk --compare`` on it (``infer``)
    decode     ``bench.generate`` on issue 27's Mixtral-shaped model in bf16: moeflow's eager and
               compiled decode each against transformers' like (eager ``generate``, static-cache
               compiled ``generate``), fp32 compiled = eager tokens, bf16 first-step logits
               against fp32, the fraction of the memory-bandwidth limit (``generation``)
    decode-bw  ``bench.decode_bandwidth`` (issue 50): compiled decode of a Qwen3-30B-A3B-shaped
               model with all 48 layers in bf16 at batch 1, 4, 16 against the bytes a step must
               read at the measured copy bandwidth (``decode_bw``)
    fp8        ``bench.gpu_fp8``: the layer fwd+bwd with bf16 against FP8 (row-wise e4m3) experts at
               the Mixtral-like and DeepSeek-like shapes, ms, speed-up and error, FP8 weight-only
               experts at decode's rows, the demo model trained 400 steps both ways (``fp8``)
    overlap    ``bench.gpu_overlap`` on one GPU (NCCL loopback exchange, degrees 1, 2, 4; Mixtral- and
               DeepSeek-like layers; compute ratio, predicted 8- and 64-GPU steps) (``overlap``)
    profile    ``bench.stage_profile`` on the DeepSeek-like layer (``profiling``)
    serve      ``bench.serve`` (issue 48): ``moeflow serve`` on a 2.7 B Qwen3-MoE-shaped model in
               bf16, compiled, under streamed greedy load: tokens/s per concurrency, concurrency 16
               over sequential ``generate``, p99 at 8 over a lone request, TTFT, the server's
               device memory; in the whole run a reduced run (concurrency 1, 8, 16) when the
               budget leaves the time for it, else skipped; the full levels and transformers'
               ``generate`` alone: ``python -m bench.gpu_check --stages serve --budget 540``
               (``serve``)
    families   ``bench.families``: issue 47's six public families against transformers on the
               same weights in bf16, the train step against ``grouped_mm`` experts, compiled
               decode against default and static-cache compiled ``generate``, peak memory; in
               the whole run the train step of the families that fit in what the budget leaves,
               all of it alone: ``python -m bench.gpu_check --stages families --budget 540``
               (``families``)

It prints a progress line per stage, the hf-layer, profile and families tables, and last one summary
table (stage, status ``ok`` / ``FAILED`` / ``skipped`` with the reason, seconds, key figures);
writes the JSON report (``--json``; keys in ``runner.REPORT_KEYS`` and ``runner.STAGE_KEYS``,
``runner.FORMAT`` names its version) and keeps the logs, traces and per-stage JSON under
``--out-dir``. Exit status 0 when no stage failed.

Smoke mode (``--smoke``): the same stages on CPU at tiny shapes, fp32, gloo instead of NCCL, the
Triton interpreter (``TRITON_INTERPRET=1`` in the subprocesses' environment) where Triton runs
(not in hf-layer's ``triton`` column: seconds per call), the stages of the training run (and
families, which balances the chains) and the others in two chains at once (``--jobs 2``);
``tests/test_bench_gpu_check.py`` runs it so the script cannot rot between GPU runs. On CUDA the
stages run one at a time (``--jobs 1``).

The package: ``runner`` (what every stage shares: ``Stage``, ``Context``, ``run_command``,
``run_stages``, the summary and the report's format), a module per stage or group of related
stages with its in-process worker beside it (``--worker`` runs one in the subprocess the
orchestrator starts: hf, profile; dcp under torchrun), and ``cli`` (the stage list, the flags,
``main``). This file imports none of them: ``python -m bench.gpu_check`` runs ``__main__``.
"""

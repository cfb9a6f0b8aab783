"""Stage infer: ``python -m moeflow infer --offload disk --compare`` on the training run's
checkpoint: experts streamed from disk, the output compared with the in-memory model's."""

from __future__ import annotations

import json
import shutil

from bench.gpu_check.runner import Context, StageFailed, python, run_command
from bench.gpu_check.training import needs_run

__all__ = ["stage_infer"]


def stage_infer(ctx: Context, timeout_s: float) -> dict:
    run = needs_run(ctx)
    path = ctx.out / "infer.json"
    path.unlink(missing_ok=True)
    tier = ctx.out / "tier"
    shutil.rmtree(tier, ignore_errors=True)
    tier.mkdir(parents=True)
    new = "4" if ctx.tiny else "16"
    run_command(ctx, "infer", python("-m", "moeflow", "infer", str(run), "--offload", "disk", "--device", ctx.device,
                                     "--fast-memory", "8MB", "--dir", str(tier), "--new-tokens", new, "--compare",
                                     "--json", str(path)), timeout_s)
    shutil.rmtree(tier, ignore_errors=True)
    r = json.loads(path.read_text())
    stats = r["stats"]
    figures = {"identical": r.get("identical"), "layout": r.get("layout"), "prefill_s": r["prefill_s"],
               "decode_s": r["decode_s"], "in_memory_decode_s": r.get("in_memory_decode_s"),
               "bytes_from_disk": stats["bytes_from_disk"], "hit_rate": stats["hit_rate"], "stall_s": stats["stall_s"]}
    if figures["identical"] is not True:
        raise StageFailed(f"the offloaded model's tokens differ from the in-memory model's ({r.get('identical')!r})")
    return {**figures, "summary": f"{r['layout']}: {stats['bytes_from_disk'] / 2**20:.1f} MiB from disk, hit rate "
                                  f"{stats['hit_rate']:.0%}, decode {r['decode_s'] * 1e3:.0f} ms "
                                  f"(in memory {figures['in_memory_decode_s'] * 1e3:.0f} ms), same tokens"}

"""``moeflow convert``: inspect or reshard a checkpoint; Hugging Face model directories of every
family ``moeflow.convert.hf`` registers, both ways; PyTorch distributed checkpoints (DCP) both ways."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_convert"]


def add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="inspect or reshard a checkpoint; import/export Hugging Face model directories; DCP both ways",
        description="Inspect (--info) or reshard a moeflow checkpoint. Checkpoints store every expert under "
        "its global index, so any world size can load any checkpoint; resharding only regroups the files "
        "(e.g. --world-size 1 gathers everything into one file). --from-hf HF_DIR DST writes a moeflow "
        "checkpoint of a Hugging Face model directory of a supported family (config.json's model_type; "
        "quantised weights dequantised), keeping its tokenizer and generation files; SRC --to-hf HF_DIR "
        "writes a moeflow MoE GPT checkpoint as a model directory of its family (--family; default: the "
        "family it was converted from, else mixtral), with those files, sharded past --max-shard-size. "
        "SRC --to-dcp DIR writes a torch.distributed.checkpoint directory "
        "(the layout of moeflow.parallel.dcp_state_dict); --from-dcp DIR DST writes one as a moeflow checkpoint "
        "(both exact).",
    )
    p.add_argument("paths", type=Path, nargs="*", metavar="PATH",
                   help="SRC [DST]: a checkpoint directory (or a root: its latest complete checkpoint) and the "
                   "destination root; with --from-hf and --from-dcp only DST")
    p.add_argument("--world-size", type=int, default=None, help="number of rank files to write")
    p.add_argument("--info", action="store_true", help="print layers, experts, shapes and files, then exit")
    p.add_argument("--from-hf", type=Path, default=None, metavar="HF_DIR",
                   help="import a Hugging Face model directory (config.json's model_type picks the family; an "
                   "unsupported one is refused, naming those moeflow converts)")
    p.add_argument("--to-hf", type=Path, default=None, metavar="HF_DIR", help="export to a Hugging Face model directory")
    p.add_argument("--family", default=None, metavar="MODEL_TYPE",
                   help="with --to-hf: the family to write (a model_type moeflow converts; default: the checkpoint's "
                   "own, else mixtral)")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="with --to-hf: the largest weight file, e.g. 5GB or 500MiB (default 5GB; past it, shards "
                   "and model.safetensors.index.json)")
    p.add_argument("--to-dcp", type=Path, default=None, metavar="DIR",
                   help="write SRC as a PyTorch distributed checkpoint (DCP) directory")
    p.add_argument("--from-dcp", type=Path, default=None, metavar="DIR",
                   help="write a DCP directory (saved from moeflow.parallel.dcp_state_dict) as a checkpoint under DST")
    p.add_argument("--step", type=int, default=None,
                   help="with --from-dcp: the step of the checkpoint (default: the step DIR records)")
    p.set_defaults(func=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from moeflow.checkpoint import CheckpointError, describe_checkpoint, latest_checkpoint, reshard_checkpoint
    from moeflow.checkpoint.format import checkpoint_dir
    from moeflow.cli.flags import check_output_dir

    def fail(msg: str) -> int:
        print(f"moeflow convert: error: {msg}", file=sys.stderr)
        return 2

    paths = list(args.paths)
    for flag, value in (("--family", args.family), ("--max-shard-size", args.max_shard_size)):
        if value is not None and args.to_hf is None:
            return fail(f"{flag} {value} goes with --to-hf HF_DIR")
    try:
        if args.from_hf is not None:
            if len(paths) != 1 or args.to_hf is not None:
                return fail("usage: moeflow convert --from-hf HF_DIR DST")
            check_output_dir("DST", paths[0])
            return _convert_from_hf(args.from_hf, paths[0])
        if args.step is not None and args.from_dcp is None:
            return fail(f"--step {args.step} goes with --from-dcp DIR")
        if args.from_dcp is not None:
            if len(paths) != 1 or args.to_dcp is not None:
                return fail("usage: moeflow convert --from-dcp DIR DST [--step N]")
            from moeflow.checkpoint.dcp import dcp_to_moeflow

            check_output_dir("DST", paths[0])
            print(f"wrote {dcp_to_moeflow(args.from_dcp, paths[0], step=args.step)} (from DCP {args.from_dcp})")
            return 0
        if not paths:
            return fail("give SRC (and DST --world-size N, --info, --to-hf HF_DIR or --to-dcp DIR)")
        src = paths[0]
        if not (src / "index.json").exists() and latest_checkpoint(src) is None and (src / "checkpoints").is_dir():
            src = src / "checkpoints"  # a run directory: its checkpoints
        src = checkpoint_dir(src)
        if args.to_hf is not None:
            check_output_dir("--to-hf", args.to_hf)
            return _convert_to_hf(src, args.to_hf, args.family, args.max_shard_size)
        if args.to_dcp is not None:
            if len(paths) != 1:
                return fail("usage: moeflow convert SRC --to-dcp DIR")
            from moeflow.checkpoint.dcp import moeflow_to_dcp

            check_output_dir("--to-dcp", args.to_dcp)

            print(f"wrote {moeflow_to_dcp(src, args.to_dcp)} (DCP, from {src})")
            return 0
        if args.info:
            print(describe_checkpoint(src))
            return 0
        if len(paths) != 2 or args.world_size is None:
            return fail("give DST and --world-size (or --info, --to-hf, --to-dcp)")
        check_output_dir("DST", paths[1])
        out = reshard_checkpoint(src, paths[1], args.world_size)
    except (CheckpointError, ValueError, TypeError) as err:
        return fail(str(err))
    except BrokenPipeError:  # `convert --info | head`: main ends quietly
        raise
    except OSError as err:  # an unreadable source or an unwritable destination
        return fail(f"{err.filename or ''}: {err.strerror or err}".lstrip(": "))
    print(f"wrote {out} for {args.world_size} rank(s)")
    return 0


def _convert_from_hf(hf_dir: Path, dst: Path) -> int:
    from moeflow.checkpoint import save_checkpoint
    from moeflow.convert.hf import FAMILIES, import_hf
    from moeflow.train.lm import MODEL_FAMILY

    model, kept = import_hf(hf_dir)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    extra = {"family": MODEL_FAMILY, "model": model.config.to_dict(), "dtype": dtype, **kept}
    out = save_checkpoint(dst, 0, model, extra=extra)
    name = FAMILIES[kept["hf"]["model_type"]].name
    print(f"wrote {out} (MoE GPT from {name}: {model.config.n_layers} layers, {model.config.num_experts} experts"
          f"{', tokenizer' if kept['tokenizer'] is not None else ''})")
    return 0


def _convert_to_hf(src: Path, hf_dir: Path, family: str | None, max_shard_size: str | None) -> int:
    from moeflow.convert.hf import FAMILIES, gpt_to_hf
    from moeflow.convert.hf_files import DEFAULT_SHARD_SIZE, parse_size
    from moeflow.train import build_from_checkpoint

    size = parse_size(max_shard_size, "--max-shard-size") if max_shard_size is not None else DEFAULT_SHARD_SIZE
    if family is not None and family not in FAMILIES:
        raise ValueError(f"--family {family}: moeflow converts {', '.join(sorted(FAMILIES))}")
    model, _, info = build_from_checkpoint(src)
    extra = info["extra"]
    kept = extra.get("hf") if isinstance(extra.get("hf"), dict) else {}
    family = family or kept.get("model_type") or "mixtral"
    out = gpt_to_hf(model, hf_dir, family=family, special_tokens=extra.get("special_tokens"),
                    tokenizer=extra.get("tokenizer"), files=kept.get("files"),
                    max_shard_size=size)
    print(f"wrote {out} ({FAMILIES[family].name}, {model.config.n_layers} layers, {model.config.num_experts} experts"
          f"{', tokenizer' if extra.get('tokenizer') is not None else ''})")
    return 0

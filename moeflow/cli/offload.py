"""What ``moeflow infer``, ``moeflow generate`` and ``moeflow serve`` share to run a model with its experts
offloaded: the storage flags, the ``StorageConfig`` they build (checked before any work), the
store built from a model, and the report of what the store moved.

    storage = storage_config(args)            # UsageError (exit 2) for a bad --fast-memory, --mode, ...
    store = offload_experts(model, storage)   # model.parameters() is now the dense part only
    with store:
        ...                                   # the model's own forward / generate
    lines = store_lines(store, storage)       # layout, bytes moved, hit rate, peak fast-tier bytes
    check_budget(store, storage)              # the peak never above --fast-memory (else exit 1)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from moeflow.cli.errors import UsageError
from moeflow.cli.flags import DEVICE_HELP, check_device, check_output_dir, choose_device, int_at_least

__all__ = ["add_storage_flags", "check_budget", "expert_bytes", "layout_line", "offload_storage", "storage_config",
           "store_lines"]

# (flag, attribute, value when not given) of the storage flags, in the order they are documented
# (--device when not given: ``moeflow.cli.flags.default_device()``, CUDA where available)
STORAGE_DEFAULTS = (("--offload", "offload", "disk"), ("--fast-memory", "fast_memory", "512MB"),
                    ("--mode", "mode", "ring"), ("--prefetch", "prefetch", 1), ("--disk-reads", "disk_reads", "direct"))


def add_storage_flags(p: argparse.ArgumentParser, *, offload_help: str, mode_default: str = "ring") -> None:
    """``--offload --fast-memory --mode --ring-slots --prefetch --dir --disk-reads --evict-page-cache --device``."""
    p.add_argument("--offload", default=None, choices=["host", "disk"], help=offload_help)
    p.add_argument("--fast-memory", default=None,
                   help="fast-tier byte budget for expert weights, e.g. 512MB, 2GiB (default 512MB)")
    p.add_argument("--mode", default=None, choices=["ring", "cache"],
                   help="ring: whole layers stream through slots (prefill); cache: an LRU cache of the routed "
                   f"experts with prefetch (decoding) (default {mode_default})")
    p.add_argument("--ring-slots", type=int_at_least(1), default=None,
                   help="with --mode ring (default: as many as --fast-memory holds)")
    p.add_argument("--prefetch", type=int_at_least(0), default=None,
                   help="layers loaded ahead (0: synchronous loading; default 1)")
    p.add_argument("--dir", type=Path, default=None, help="where the disk tier writes (default: a temporary dir)")
    p.add_argument("--disk-reads", default=None, choices=["direct", "cached"],
                   help="direct: O_DIRECT reads, every load from the device (a model far larger than RAM); cached: "
                   "through the page cache, so a file that fits in free RAM is read from memory after the first "
                   "pass, as a memory-mapped offload is (default direct)")
    p.add_argument("--evict-page-cache", action="store_true",
                   help="drop each disk read from the page cache (only matters where O_DIRECT is unavailable)")
    p.add_argument("--device", default=None,
                   help=f"where the model runs and, with --offload, the fast tier lives: {DEVICE_HELP}")


def storage_config(args: argparse.Namespace, *, mode_default: str = "ring"):  # type: ignore[no-untyped-def]
    """The ``StorageConfig`` of the storage flags (the unset ones at their defaults, written back
    into ``args``); ``UsageError`` naming the flag for a bad value (``--fast-memory 12XB``,
    ``--dir`` unwritable, ``--ring-slots`` with ``--mode cache``, ...). Builds nothing."""
    from moeflow.storage import StorageConfig

    if args.dir is not None:
        check_output_dir("--dir", args.dir)
    if args.device is None:
        args.device = choose_device("--device", None).device
    else:
        check_device("--device", args.device)
    for _, name, default in STORAGE_DEFAULTS:
        if getattr(args, name) is None:
            setattr(args, name, mode_default if name == "mode" else default)
    try:
        return StorageConfig(offload=args.offload, fast_memory=args.fast_memory, mode=args.mode,
                             ring_slots=args.ring_slots, prefetch=args.prefetch, directory=args.dir,
                             evict_page_cache=args.evict_page_cache, disk_reads=args.disk_reads, device=args.device)
    except (ValueError, TypeError) as err:
        raise UsageError(_flag_names(str(err))) from None


def offload_storage(args: argparse.Namespace, *, mode_default: str = "cache"):  # type: ignore[no-untyped-def]
    """For a command whose offload is optional (``generate``, ``serve``): the ``StorageConfig`` of
    the storage flags, or ``None`` without ``--offload`` (``UsageError`` for a bad value, or a
    storage flag given without ``--offload``)."""
    if args.offload is None:
        given = [flag for flag, value in (
            ("--fast-memory", args.fast_memory), ("--mode", args.mode), ("--ring-slots", args.ring_slots),
            ("--prefetch", args.prefetch), ("--dir", args.dir), ("--disk-reads", args.disk_reads),
            ("--evict-page-cache", args.evict_page_cache or None)) if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only applies with --offload host|disk (the experts held outside "
                             "the model)")
        return None
    return storage_config(args, mode_default=mode_default)


def _flag_names(message: str) -> str:
    """A ``StorageConfig`` message with its fields spelled as the flags that set them."""
    for field, flag in (("fast_memory", "--fast-memory"), ("ring_slots", "--ring-slots"), ("prefetch", "--prefetch"),
                        ("evict_page_cache", "--evict-page-cache"), ("disk_reads", "--disk-reads"),
                        ("directory", "--dir"), ("offload", "--offload"),
                        ("mode", "--mode"), ("device", "--device")):
        message = re.sub(rf"(?<![\w-]){field}(=| must| has| only)",
                         lambda m, flag=flag: flag + (" " if m.group(1) == "=" else m.group(1)), message)
    return message


def expert_bytes(model) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the routed experts' weights of an in-memory model (what the store takes over)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def layout_line(store, storage) -> str:  # type: ignore[no-untyped-def]
    from moeflow.storage import format_bytes

    if storage.mode == "ring":
        return f"ring of {store.num_slots} slot(s) x {format_bytes(store.slot_bytes)}"
    return f"LRU cache of {store.cache_slots} experts x {format_bytes(store.expert_slot_bytes)}"


def resident_bytes(store, storage) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the slots the budget holds (ring slots or cache slots)."""
    if storage.mode == "cache":
        return store.cache_slots * store.expert_slot_bytes
    return store.num_slots * store.slot_bytes


def peak_line(store, storage) -> str:  # type: ignore[no-untyped-def]
    """The peak fast-tier bytes against the budget: the resident slots, plus anything transient
    (an ``acquire_experts`` workspace a caller asked for; the model's own path adds none)."""
    from moeflow.storage import format_bytes

    stats = store.stats
    resident = resident_bytes(store, storage)
    extra = stats.peak_fast_bytes - resident
    head = (f"peak fast-tier bytes {format_bytes(stats.peak_fast_bytes)} of the {format_bytes(storage.fast_memory)} "
            f"budget = {format_bytes(resident)} of resident slots")
    if extra <= 0:
        return f"{head}, nothing transient (the experts compute on the slots in place)"
    return f"{head} + {format_bytes(extra)} transient (buffers held during a layer's compute)"


def store_lines(store, storage) -> list[str]:  # type: ignore[no-untyped-def]
    """What the store moved (bytes, loads, stall, hit rate), its peak, and in cache mode how
    many hits the routing-aware prefetch earned."""
    lines = [store.stats.format(), peak_line(store, storage)]
    if storage.mode == "cache":
        lines.append(f"routing-aware prefetch: {store.prefetch_hits} of {store.stats.hits} hits were prefetched experts")
    return lines


def check_budget(store, storage) -> None:
    """``UsageError`` (status 1) if the fast tier ever held more than ``--fast-memory``: the
    store's own accounting, checked after every run so an overrun is never silent."""
    from moeflow.storage import format_bytes

    peak = store.stats.peak_fast_bytes
    if peak > storage.fast_memory:
        raise UsageError(f"the fast tier peaked at {format_bytes(peak)}, above --fast-memory "
                         f"{format_bytes(storage.fast_memory)} (a bug in moeflow.storage)", status=1)

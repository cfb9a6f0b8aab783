"""``moeflow serve``: an OpenAI-compatible HTTP server over a ``moeflow train`` / ``convert``
checkpoint or a Hugging Face model directory.

    moeflow serve runs/shakespeare --port 8000
    moeflow serve path/to/Mixtral-dir --max-concurrency 16 --timeout 120 --model-name mixtral
    moeflow serve runs/big --offload disk --fast-memory 2GiB

The model and its tokenizer come as ``moeflow generate`` takes them (``build_from_checkpoint``;
a Hugging Face directory is converted in memory, as ``train --init-from`` converts one: its
``tokenizer.json``, chat template and end-of-sequence ids kept), and so do the stop ids (every
end-of-sequence id the model declares, ``declared_eos``) and the storage flags (``--offload``
as ``generate``/``infer`` take it: ``moeflow.cli.offload``). The engine
(``moeflow.serve.engine``) runs ``--max-concurrency`` requests in its decode slots, queues
``--max-queue`` more (beyond them: 429), prefills ``--prefill-chunk`` prompt tokens between
decode steps, ends a request after ``--timeout`` seconds; the app is ``moeflow.serve.app``,
under uvicorn (``moeflow.serve.server``). ``SIGTERM``/``SIGINT``: admission stops (503), the
running requests get ``--shutdown-grace`` seconds to finish (then finish_reason ``"shutdown"``),
exit status 0.

Every flag is checked, and the address taken, before the model is loaded: a refusal is one
line ``moeflow serve: error: ...`` naming the flag, status 2.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
from pathlib import Path

from moeflow.cli.errors import UsageError
from moeflow.cli.flags import choose_device, env_threads, float_at_least, int_at_least
from moeflow.cli.generate import declared_eos, read_template_file
from moeflow.cli.offload import add_storage_flags, check_budget, layout_line, offload_storage, store_lines

__all__ = ["add_serve", "load_served_model"]

# EngineConfig's fields as the flags that set them (its messages name the fields)
_ENGINE_FLAGS = (("max_queue", "--max-queue"), ("prefill_chunk", "--prefill-chunk"), ("slots", "--max-concurrency"),
                 ("capacity", "--context"), ("compile", "--compile"), ("threads", "--threads"))


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
                       description="Load a `moeflow train` / `moeflow convert` checkpoint or a Hugging Face model "
                       "directory and serve it over HTTP: /v1/completions and /v1/chat/completions (OpenAI's API, "
                       "streaming included), /v1/models, /health and /metrics (Prometheus). Requests share the "
                       "model's decode slots step by step (continuous batching). SIGTERM or Ctrl+C drains and exits.")
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_OR_HF_DIR",
                   help="a checkpoint directory (or a checkpoints root, or a train --out directory), or a Hugging "
                   "Face model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int_at_least(0), default=8000, help="the TCP port (0: one the system picks)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model's name in the API (requests' \"model\"; default: the directory's name)")
    p.add_argument("--max-concurrency", type=int_at_least(1), default=8,
                   help="decode slots: requests generated at once (each a row of the KV cache)")
    p.add_argument("--max-queue", type=int_at_least(0), default=64,
                   help="requests waiting for a slot; beyond them a request gets 429")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=64,
                   help="prompt tokens prefilled between two decode steps (a long prompt does not stall the others)")
    p.add_argument("--context", type=int_at_least(2), default=None, metavar="TOKENS",
                   help="KV cache columns per slot: prompt + generated tokens of one request at most (default: the "
                   "model's max_seq_len)")
    p.add_argument("--timeout", type=float_at_least(0, strict=True), default=None, metavar="SECONDS",
                   help="end a request this long after it arrived (finish_reason \"timeout\"; default: no limit)")
    p.add_argument("--shutdown-grace", type=float_at_least(0), default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: how long the running requests may take to finish before they end with "
                   "finish_reason \"shutdown\"")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="decode with the compiled static step (compiled once at start, reused for any mix of "
                   "requests); not with --offload")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions instead of the model's own")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch threads of the engine, which runs every step (default: OMP_NUM_THREADS when set, "
                        "else torch's default); the model loads on one")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log every request (uvicorn's access log, on stderr)")
    add_storage_flags(p, offload_help="hold the routed experts in host memory or on disk and stream them through "
                      "--fast-memory (default: none, the whole model in memory)", mode_default="cache")
    p.set_defaults(func=_run_serve)


def _flag_names(message: str) -> str:
    """An engine's message with its fields spelled as the flags that set them."""
    for field, flag in _ENGINE_FLAGS:
        message = re.sub(rf"(?<![\w-]){field}(?!\w)", flag, message)
    return message


def _engine_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import torch

    from moeflow.serve.engine import EngineConfig

    try:
        return EngineConfig(slots=args.max_concurrency, max_queue=args.max_queue, capacity=args.context,
                            prefill_chunk=args.prefill_chunk, compile=args.compile,
                            threads=args.threads or env_threads() or torch.get_num_threads())
    except (ValueError, TypeError) as err:
        raise UsageError(_flag_names(str(err))) from None


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening: a client is refused, not kept
    waiting, until the model is loaded and uvicorn listens on it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise UsageError(f"--host {host!r}: not an address of this machine ({err.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({err.strerror})") from None
    return sock


def load_served_model(path: Path, device: str):  # type: ignore[no-untyped-def]
    """``(model, tokenizer, extra)`` of a moeflow checkpoint (``build_from_checkpoint``) or a
    Hugging Face directory (``import_hf``, converted in memory), the model in eval mode on
    ``device``; ``ValueError`` when it has no tokenizer."""
    from moeflow.convert.hf import import_hf
    from moeflow.train import build_from_checkpoint
    from moeflow.train.data import tokenizer_from_dict
    from moeflow.train.init_from import is_hf_dir

    if is_hf_dir(path):
        model, extra = import_hf(path)
        model = model.to(device).eval()
        tok = None if extra.get("tokenizer") is None else tokenizer_from_dict(extra["tokenizer"])
    else:
        model, tok, info = build_from_checkpoint(path, device=device)
        extra = info["extra"]
    if tok is None:
        raise ValueError(f"{path}: the model has no tokenizer (a Hugging Face directory without tokenizer.json, "
                         "or a checkpoint converted from one); moeflow serve needs one to read prompts")
    return model, tok, extra


def _run_serve(args: argparse.Namespace) -> int:
    import torch

    from moeflow.checkpoint import CheckpointError

    if not args.checkpoint.exists():
        raise UsageError(f"{args.checkpoint}: no such checkpoint or Hugging Face directory")
    if not args.host:
        raise UsageError("--host must not be empty")
    if args.port > 65535:
        raise UsageError(f"--port must be a TCP port, 0 to 65535, got {args.port}")
    device = choose_device("--device", args.device)
    args.device, args.device_line = device.device, device.line  # the fast tier's too, with --offload
    storage = offload_storage(args, mode_default="cache")
    if args.compile and storage is not None:
        raise UsageError(f"--compile cannot go with --offload {args.offload}: the expert store moves experts between "
                         "the host and the fast tier during a step, which a compiled step cannot hold")
    config = _engine_config(args)
    template = None if args.chat_template is None else read_template_file(args.chat_template)  # ValueError: 1 line
    name = args.model_name if args.model_name is not None else args.checkpoint.resolve().name
    if not name:
        raise UsageError("--model-name must not be empty")
    # the engine's thread runs every step with the threads (EngineConfig.threads); this thread
    # loads the model on one, so that it never holds a second OpenMP pool (which would stop the
    # engine's workers from spin-waiting between a step's parallel regions)
    torch.set_num_threads(1)
    sock = _listen(args.host, args.port)
    try:
        try:
            model, tok, extra = load_served_model(args.checkpoint, "cpu" if storage else device.device)
        except CheckpointError as err:
            raise UsageError(str(err), status=1) from None
        if storage is None:
            return _serve(args, model, tok, extra, config, template, name, sock)
        from moeflow.storage import offload_experts

        model = model.to(storage.device)
        with offload_experts(model, storage) as store:
            status = _serve(args, model, tok, extra, config, template, name, sock)
            print(f"experts in {storage.offload}, fast tier {layout_line(store, storage)}", file=sys.stderr)
            print("\n".join(store_lines(store, storage)), file=sys.stderr)
            check_budget(store, storage)
        return status
    finally:
        sock.close()


def _serve(args, model, tok, extra, config, template, name, sock) -> int:  # type: ignore[no-untyped-def]
    from moeflow.serve.app import create_app
    from moeflow.serve.engine import Engine
    from moeflow.serve.server import run_server
    from moeflow.serve.text import ModelText

    where = str(args.checkpoint)
    vocab = model.config.vocab_size
    text = ModelText(tok, eos_ids=declared_eos(extra, tok, vocab, where), vocab_size=vocab, extra=extra,
                     template=template, where=where)
    try:
        engine = Engine(model, config)
    except ValueError as err:  # --context past the model's max_seq_len, a model --compile cannot compile
        raise UsageError(_flag_names(str(err))) from None
    app = create_app(engine, text, model_name=name, timeout_s=args.timeout)
    print(args.device_line, file=sys.stderr, flush=True)  # after every check: a refusal is one line
    try:
        engine.start()  # compiled: compiles and warms the step up first
    except RuntimeError as err:
        raise UsageError(str(err), status=1) from None
    host, port = sock.getsockname()[:2]
    print(f"moeflow serve: {name!r} on http://{host}:{port} ({config.slots} slots of {engine.capacity} tokens, "
          f"queue {config.max_queue}{', compiled' if config.compile else ''}; chat template "
          f"{'yes' if text.template is not None else 'none'})", file=sys.stderr, flush=True)
    run_server(app, sock=sock, drain_s=args.shutdown_grace, access_log=args.access_log)
    print("moeflow serve: stopped", file=sys.stderr, flush=True)
    return 0

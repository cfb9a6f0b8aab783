"""``moeflow generate``: sample text from a ``moeflow train`` or ``moeflow convert --from-hf``
checkpoint.

    moeflow generate runs/shakespeare --prompt "ROMEO." --max-new-tokens 200
    moeflow generate runs/shakespeare --prompts-file prompts.txt --batch-size 8 --temperature 0 --eos '\\n'
    moeflow generate runs/shakespeare --offload disk --fast-memory 512MB --mode cache --temperature 0
    moeflow generate runs/mixtral --chat --prompt "What is a mixture of experts?"

A row stops at any stop token: by default every end-of-sequence id the model declares (a
converted model's ``generation_config.json`` may list several; the checkpoint's
``extra["special_tokens"]``) and the tokenizer's end-of-document token; ``--eos`` replaces them.
With ``--chat`` each prompt is the user's message, rendered through the model's chat template
(``moeflow.convert.chat``), and only the replies are printed.

The model runs on ``--device`` (default: CUDA where torch sees it, else the CPU; the first line on
stderr says which and why), and sampling draws with a generator made there from ``--seed``
(``seeded_generator``), so no step copies its probabilities to the host.

With ``--offload host|disk`` the routed experts leave the model for an expert store
(``moeflow.storage``, built as ``moeflow infer`` builds it: ``moeflow.cli.offload``) and only
``--fast-memory`` bytes of them are resident: ``--mode cache`` (the default here) fetches the
experts each layer's router selected and prefetches the next layer's likely ones while the
current one computes; ``--mode ring`` streams whole layers through slots (prefill-shaped work).
The same generation loop runs either way (the layers call their store-backed experts); the
store's traffic (bytes read, hit rate, peak fast-tier bytes, never above the budget) follows
the tokens/s on stderr.

Prompts of any lengths run in batches (``moeflow.models.generation.generate``: KV-cached, left
padding, per-row stop tokens). The completions go to stdout; the prefill and decode tokens/s
go to stderr, so stdout is the text alone. A bad value is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from moeflow.cli.errors import UsageError
from moeflow.cli.flags import choose_device
from moeflow.cli.offload import add_storage_flags, check_budget, layout_line, offload_storage, store_lines

__all__ = ["add_generate", "declared_eos", "read_template_file", "sample", "seeded_generator"]


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a `moeflow train` or `moeflow convert --from-hf` checkpoint",
                       description="Rebuild the model and tokenizer of a `moeflow train` or `moeflow convert "
                       "--from-hf` checkpoint (any world size that wrote it) and continue --prompt, or each line of "
                       "--prompts-file, in batches (KV-cached), or with --chat answer them through the model's chat "
                       "template. Prints the completions, then prefill and decode tokens/s on stderr.")
    p.add_argument("checkpoint", type=Path, help="a checkpoint directory, a checkpoints root, or a train --out directory")
    p.add_argument("--prompt", default="ROMEO.\n", help="one prompt ('\\n' is a newline); default 'ROMEO.\\n'")
    p.add_argument("--prompts-file", type=Path, default=None, metavar="PATH",
                   help="several prompts, one per line (blank lines skipped; '\\n' is a newline); replaces --prompt")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt at most (default 300)")
    p.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)  # the old name of --max-new-tokens
    p.add_argument("--eos", action="append", default=None, metavar="TOKEN",
                   help="stop a row after this token: a token id, or text the tokenizer encodes as one token "
                   "(e.g. '\\n'); repeat for several (default: every end-of-sequence id the model declares, e.g. "
                   "generation_config.json's list, and the tokenizer's end-of-document token, with which a model "
                   "trained on your own documents ends one)")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is the user's message: render it through the checkpoint's chat template (kept "
                   "from its Hugging Face directory) with the assistant's turn after it, and print only the replies "
                   "(needs transformers: pip install 'moeflow[hf]')")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="with --chat (implied): a Jinja chat template to use instead of the checkpoint's")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--sample-top-k", type=int, default=None, metavar="K",
                   help="sample among the k most likely tokens only; 0 = all (default 40). Not the router's "
                   "top-k (`train --top-k`)")
    p.add_argument("--top-k", type=int, default=None, dest="old_top_k", metavar="K",
                   help="deprecated spelling of --sample-top-k (it read as the router's k of `train --top-k`)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with "
                   "probability >= p (default 1: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="decode with the compiled static step (torch.compile, CUDA graphs on CUDA): compiles once "
                   "per batch size and cache size (seconds to minutes), then runs each step without Python "
                   "overhead; on the CPU (fp32) the experts multiply packed copies of their weights (their "
                   "memory once more); not with --offload")
    add_storage_flags(p, offload_help="hold the routed experts in host memory or on disk and stream them through "
                      "--fast-memory (default: none, the whole model in memory)", mode_default="cache")
    p.set_defaults(func=_run_generate)


def read_template_file(path: Path) -> str:
    """The text of ``--chat-template FILE`` (``ValueError`` naming the flag)."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--chat-template {path}: cannot read it ({err})") from None


def _fail(message: str) -> int:
    print(f"moeflow generate: error: {message}", file=sys.stderr)
    return 2


def _unescape(text: str) -> str:
    return text.replace("\\n", "\n")


def _settings(args: argparse.Namespace) -> tuple[int, int]:
    """``(max_new_tokens, sample_top_k)`` from the flags and their old spellings (checked)."""
    if args.tokens is not None and args.max_new_tokens is not None:
        raise ValueError("--tokens is the old name of --max-new-tokens: give one of them")
    if args.old_top_k is not None and args.sample_top_k is not None:
        raise ValueError("--top-k is the old name of --sample-top-k: give one of them")
    new_flag, new = ("--tokens", args.tokens) if args.tokens is not None else ("--max-new-tokens", args.max_new_tokens)
    top_k_flag, top_k = ("--top-k", args.old_top_k) if args.old_top_k is not None else ("--sample-top-k", args.sample_top_k)
    new = 300 if new is None else new
    top_k = 40 if top_k is None else top_k
    if new < 0:
        raise ValueError(f"{new_flag} must be >= 0, got {new}")
    if top_k < 0:
        raise ValueError(f"{top_k_flag} must be >= 0 (0 = all tokens), got {top_k}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be finite and >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.old_top_k is not None:  # after the checks: a refused command prints one line
        print("moeflow generate: warning: --top-k is deprecated, use --sample-top-k (the sampling cut; "
              "`train --top-k` is the router's k)", file=sys.stderr)
    return new, top_k


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file is None:
        return [_unescape(args.prompt)]
    try:
        lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--prompts-file {args.prompts_file}: cannot read it ({err})") from None
    prompts = [_unescape(line) for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt (only blank lines)")
    return prompts


def declared_eos(extra: dict, tok, vocab_size: int, where: str) -> list[int]:  # type: ignore[no-untyped-def]
    """The stop ids a checkpoint declares: every end-of-sequence id of its ``special_tokens``
    (a converted model's, carried on by a run fine-tuned from it: ``generation_config.json``'s,
    which may be a list, else ``config.json``'s), then the tokenizer's end-of-document token
    (what follows a document's end is another document), each once."""
    from moeflow.convert.hf_tokenizer import check_special_tokens

    declared = extra.get("special_tokens")
    ids = [] if declared is None else check_special_tokens(declared, vocab_size, f"{where}: special_tokens")[
        "eos_token_id"]
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    eod = getattr(tok, "eod", None)
    return list(dict.fromkeys([*ids, *([int(eod)] if eod is not None else [])]))


def _eos_ids(values: list[str] | None, tok, declared: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """``--eos`` as token ids, or without it the ``declared`` ones."""
    if values is None:
        return declared
    ids = []
    for value in values:
        if value.lstrip("-").isdigit():
            ids.append(int(value))
            continue
        enc = tok.encode(_unescape(value))
        if len(enc) != 1:
            raise ValueError(f"--eos {value!r} is {len(enc)} tokens under the checkpoint's tokenizer; give one token "
                             "or a token id")
        ids.append(enc[0])
    return ids


def _check_sampling(args: argparse.Namespace, model, top_k: int,  # type: ignore[no-untyped-def]
                    eos: list[int]) -> None:
    """``ValueError`` for settings ``generate`` would refuse (a stop token outside the vocabulary)."""
    from moeflow.models.generation import SamplingConfig

    SamplingConfig(temperature=args.temperature, top_k=top_k, top_p=args.top_p, eos=eos).check_vocab(
        model.config.vocab_size)


def _run_generate(args: argparse.Namespace) -> int:
    from moeflow.checkpoint import CheckpointError

    try:
        new, top_k = _settings(args)
        prompts = _prompts(args)
        device = choose_device("--device", args.device)
        args.device = device.device  # the fast tier's too, with --offload
        storage = offload_storage(args, mode_default="cache")
        template = None if args.chat_template is None else read_template_file(args.chat_template)
        args.chat = args.chat or template is not None  # --chat-template implies --chat
        if args.compile and storage is not None:
            raise UsageError(f"--compile cannot go with --offload {args.offload}: the expert store moves experts "
                             "between the host and the fast tier during a step, which a compiled step cannot hold")
    except UsageError as err:
        print(f"moeflow generate: error: {err}", file=sys.stderr)
        return err.status
    except ValueError as err:
        return _fail(str(err))
    try:
        from moeflow.train import build_from_checkpoint

        # offloaded experts go from the host to their store; the rest of the model to --device
        model, tok, info = build_from_checkpoint(str(args.checkpoint), device="cpu" if storage else device.device)
        if tok is None:
            raise ValueError(f"{args.checkpoint}: the checkpoint has no tokenizer (converted from a Hugging Face "
                             "directory without tokenizer.json); sample with transformers' tokenizer instead")
        eos = _eos_ids(args.eos, tok, declared_eos(info["extra"], tok, model.config.vocab_size, str(args.checkpoint)))
        _check_sampling(args, model, top_k, eos)  # before the device line: a refusal is one line
        if args.chat:
            prompts = _chat_prompts(prompts, info["extra"], template, str(args.checkpoint))
            encoded = [tok.encode(p, add_special_tokens=False) or [0] for p in prompts]  # they hold their own
        else:
            encoded = [tok.encode(p) or [0] for p in prompts]
        if storage is None:
            print(device.line, file=sys.stderr, flush=True)
            return _generate_all(args, model, tok, prompts, encoded, new, top_k, eos)
        from moeflow.storage import offload_experts

        model = model.to(storage.device)
        store = offload_experts(model, storage)
    except (CheckpointError, ValueError, TypeError, ImportError) as err:
        return _fail(str(err))
    print(device.line, file=sys.stderr, flush=True)
    try:
        with store:
            status = _generate_all(args, model, tok, prompts, encoded, new, top_k, eos)
            print(f"experts in {storage.offload}, fast tier {layout_line(store, storage)}, prefetch {storage.prefetch}",
                  file=sys.stderr)
            print("\n".join(store_lines(store, storage)), file=sys.stderr)
            check_budget(store, storage)
    except UsageError as err:
        print(f"moeflow generate: error: {err}", file=sys.stderr)
        return err.status
    return status


def _generate_all(args, model, tok, prompts, encoded, new, top_k, eos) -> int:  # type: ignore[no-untyped-def]
    """Generate every prompt in batches of ``--batch-size``; the text to stdout, the rates to stderr."""
    import torch

    from moeflow.models.generation import generate

    gen = seeded_generator(model, args.seed)
    prefill = [0, 0.0]
    decode = [0, 0.0]
    for start in range(0, len(encoded), args.batch_size):
        batch = encoded[start:start + args.batch_size]
        result = generate(model, batch, new, temperature=args.temperature, top_k=top_k, top_p=args.top_p,
                          eos=eos, generator=gen, compile=args.compile)
        prefill = [prefill[0] + result.prefill_tokens, prefill[1] + result.prefill_s]
        decode = [decode[0] + result.decode_tokens, decode[1] + result.decode_s]
        for i, (ids, out) in enumerate(zip(batch, result.tokens)):
            if len(prompts) > 1:
                print(f"### prompt {start + i + 1}")
            print(tok.decode(out if args.chat else ids + out))  # a chat: the reply alone
    print(f"prefill: {_rate(*prefill)}; decode: {_rate(*decode)}; batch size {args.batch_size}", file=sys.stderr)
    return 0


def _chat_prompts(prompts: list[str], extra: dict, template: str | None, where: str) -> list[str]:
    """Each prompt as the user's message through the chat template (``template``, from
    ``--chat-template``, else the checkpoint's), ready to encode (``moeflow.convert.chat``)."""
    from moeflow.convert.chat import chat_template, render_chat, special_token_texts

    template = template if template is not None else chat_template(extra, where)
    if template is None:
        raise ValueError(f"--chat: the checkpoint {where} has no chat template (no chat_template.jinja or "
                         "tokenizer_config.json chat_template kept from a Hugging Face directory); give one with "
                         "--chat-template FILE")
    special = special_token_texts(extra, where)
    return [render_chat(template, p, special, where) for p in prompts]


def _rate(tokens: int, seconds: float) -> str:
    per_s = f"{tokens / seconds:,.0f} tokens/s" if seconds > 0 else "- tokens/s"
    return f"{tokens} tokens in {seconds:.3f} s ({per_s})"


def seeded_generator(model, seed: int):  # type: ignore[no-untyped-def]
    """A ``torch.Generator`` seeded with ``seed`` on the device of ``model``'s logits (its output
    head's; with offloaded experts, the fast tier's), where ``sample_next`` then draws without
    copying each step's probabilities (``moeflow.models.decoding.draw_device``)."""
    import torch

    return torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)


def sample(checkpoint: str, prompt: str, tokens: int, temperature: float, top_k: int | None, seed: int, *,
           device: str = "cpu") -> str:
    """``prompt`` and ``tokens`` sampled tokens after it, from the model and tokenizer of a ``moeflow
    train`` checkpoint, run on ``device`` (``ValueError`` when it has no tokenizer: one converted
    from a Hugging Face directory without ``tokenizer.json``)."""
    import torch

    from moeflow.train import build_from_checkpoint

    model, tok, _ = build_from_checkpoint(checkpoint, device=device)
    if tok is None:
        raise ValueError(f"{checkpoint}: the checkpoint has no tokenizer (converted from a Hugging Face directory "
                         "without tokenizer.json); sample with transformers' tokenizer instead")
    ids = tok.encode(prompt) or [0]
    out = model.generate(torch.tensor([ids], device=model.lm_head.weight.device), tokens, temperature=temperature,
                         top_k=top_k, generator=seeded_generator(model, seed))
    return tok.decode(out[0].tolist())

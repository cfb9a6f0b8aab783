"""Chat templates: a conversation rendered through the model's own template into the text the
model was trained to answer. ``moeflow generate --chat`` renders each prompt as the user's one
message; ``moeflow serve``'s ``/v1/chat/completions`` renders a request's messages. Both use this
module, which sits with the tokenizer files it reads (``moeflow.convert.hf_tokenizer``), below
the command line and the server.

The template is the one a checkpoint keeps of its Hugging Face directory (``extra["hf"]
["files"]``, ``moeflow.convert.hf_tokenizer``): ``chat_template.jinja`` where present (transformers
lets that file win over the config), else ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of named templates whose ``default`` is taken); or a file the user gives
(``--chat-template``).

A chat template is a Jinja program from the model's publisher, so it is untrusted code, and
the functions and filters it may call (``raise_exception``, ``tojson``, ``strftime_now``,
loop controls, the named special tokens such as ``bos_token``) are transformers' API. It is
therefore rendered by transformers' own renderer (``render_jinja_template``: its sandboxed Jinja
environment, the same globals and filters, the special tokens passed as
``apply_chat_template`` passes them), not by a copy of it here: the text is exactly what
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` gives.
It needs transformers (the ``hf`` extra; jinja2 comes with it). The rendered text holds its
special tokens as text, so it is encoded without the tokenizer adding its own
(``add_special_tokens=False``), as transformers encodes it.
"""

from __future__ import annotations

import json

__all__ = ["SPECIAL_TOKEN_NAMES", "chat_template", "render_chat", "render_messages", "special_token_texts"]

# the named special tokens transformers passes a template (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _kept_files(extra: dict) -> dict:
    hf = extra.get("hf")
    files = hf.get("files") if isinstance(hf, dict) else None
    return files if isinstance(files, dict) else {}


def _json_file(files: dict, name: str, where: str) -> dict:
    if not isinstance(files.get(name), str):
        return {}
    try:
        data = json.loads(files[name])
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: its kept {name} is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: its kept {name} is not a JSON object")
    return data


def chat_template(extra: dict, where: str) -> str | None:
    """The chat template a checkpoint keeps (module docstring), or None when it has none;
    ``where`` (the checkpoint) names it in a ``ValueError`` for a malformed one."""
    files = _kept_files(extra)
    if isinstance(files.get("chat_template.jinja"), str):
        return files["chat_template.jinja"]
    template = _json_file(files, "tokenizer_config.json", where).get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{where}: tokenizer_config.json names chat templates {sorted(map(str, named))} and "
                             "none 'default'; give one with --chat-template FILE")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{where}: tokenizer_config.json's chat_template is a {type(template).__name__}, not text")
    return template


def special_token_texts(extra: dict, where: str) -> dict[str, str]:
    """``{bos_token: "<s>", ...}``: the named special tokens of the kept ``tokenizer_config.json``
    (``special_tokens_map.json`` for those it lacks), which a template may print."""
    files = _kept_files(extra)
    merged = {**_json_file(files, "special_tokens_map.json", where), **_json_file(files, "tokenizer_config.json", where)}
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = merged.get(name)
        value = value.get("content") if isinstance(value, dict) else value  # an AddedToken's description
        if isinstance(value, str):
            out[name] = value
    return out


def render_messages(template: str, messages: list[dict], special: dict[str, str], where: str) -> str:
    """``messages`` (``[{"role": ..., "content": text}, ...]``) rendered through ``template`` with
    the assistant's generation prompt after them (module docstring); ``ValueError`` naming
    ``where`` for a template that does not render them (one that refuses a role with
    ``raise_exception``, say), ``ImportError`` without transformers."""
    try:
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError as err:
        raise ImportError("a chat template is rendered with transformers' renderer: pip install 'moeflow[hf]'") from err
    try:
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                            add_generation_prompt=True, **special)
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"{where}: the chat template does not render ({type(err).__name__}: {err})") from None
    return rendered[0]


def render_chat(template: str, prompt: str, special: dict[str, str], where: str) -> str:
    """``prompt`` as one user message through ``template`` (``render_messages``)."""
    return render_messages(template, [{"role": "user", "content": prompt}], special, where)

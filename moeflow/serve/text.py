"""The tokenizer side of ``moeflow serve``: prompts and conversations to token ids, and the
generated ids back to text as they arrive, cut at stop strings.

- ``ModelText``: a served model's tokenizer (``moeflow.train.data``: its own, or the Hugging
  Face ``tokenizer.json`` kept with the checkpoint), its end-of-sequence ids and its chat
  template (``moeflow.convert.chat``: rendered by transformers' sandboxed renderer, exactly as
  ``moeflow generate --chat`` renders it). A completions prompt is encoded as ``generate``
  encodes one (with the tokenizer's own special tokens, a leading ``<s>`` say); a rendered
  conversation holds its special tokens as text and is encoded without adding them.
- ``Detokenizer``: incremental detokenization. Decoding one token at a time is wrong twice: a
  byte-level token may hold part of a UTF-8 character (decoded alone it is U+FFFD), and
  SentencePiece-style decoders drop a word's leading space at the start of a text. So the text
  of the new ids is decoded after a few ids of context (``CONTEXT``, the prompt's last ones at
  first) and handed out only when it does not end in U+FFFD (an incomplete character, held
  until the rest arrives); ``finish`` hands out what is held (an incomplete character at the
  very end stays U+FFFD, as a whole-sequence decode gives it). The pieces concatenate to the
  decode of the whole sequence (``reference_text``), which the tests check.
- ``StopStrings``: the first stop string to show ends the text before it (the occurrence that
  ends first, as the text grows; of those ending together, the one starting first: so the cut
  does not depend on how the text came in pieces, and nothing past it need be generated). Text
  that could be the start of a stop string (the longest suffix that is a prefix of one) is held
  back until the next piece shows whether it is, so a streamed reply never shows a stop string's
  first half and a non-streamed one is the concatenation of the streamed pieces.
- ``TextStream``: both, per choice: ``push(token) -> (text, stopped)``, ``finish() -> text``.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeflow.convert.chat import chat_template, render_messages, special_token_texts

__all__ = ["ModelText", "Detokenizer", "StopStrings", "TextStream", "NoChatTemplate", "reference_text"]

CONTEXT = 5  # ids decoded before the new ones: enough for a decoder's context (a leading space)
REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 character


class NoChatTemplate(ValueError):
    """The model has no chat template: ``/v1/chat/completions`` cannot render a conversation."""


class Detokenizer:
    """Generated ids to text, piece by piece (module docstring). ``tokenizer``: any
    ``moeflow.train.data.Tokenizer`` (``decode(ids) -> str``); ``prompt``: the prompt's ids,
    whose last ``CONTEXT`` are the first context."""

    def __init__(self, tokenizer, prompt: Sequence[int]) -> None:  # type: ignore[no-untyped-def]
        self._tok = tokenizer
        self._ids = list(prompt[-CONTEXT:])
        self._prefix = 0  # ids[prefix:read]: handed out as text already, the context of the next piece
        self._read = len(self._ids)

    def push(self, token: int) -> str:
        """The text ``token`` completes (may be "": a held incomplete character)."""
        self._ids.append(token)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""
        # the ids just handed out are the next piece's context (they start where a piece ended,
        # so on a character boundary)
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def finish(self) -> str:
        """What is held (an incomplete character at the end stays U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


def reference_text(tokenizer, prompt: Sequence[int], generated: Sequence[int]) -> str:  # type: ignore[no-untyped-def]
    """The reference of ``Detokenizer``: the text the generated ids add to the prompt, decoded
    whole (what the concatenated pieces must equal)."""
    return tokenizer.decode(list(prompt) + list(generated))[len(tokenizer.decode(list(prompt))):]


class StopStrings:
    """Text pieces in, the text before the first stop string to show out (module docstring)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def _hold(self, text: str) -> int:
        """The length of the longest suffix of ``text`` that begins some stop string."""
        for k in range(min(len(text), max((len(s) for s in self._stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self._stops):
                return k
        return 0

    def push(self, text: str) -> str:
        """The part of ``text`` (after what was held) that is surely before any stop string;
        sets ``stopped`` when a stop string showed (nothing after it is handed out, ever)."""
        if self.stopped:
            return ""
        text = self._held + text
        # (end, start) of each stop string's first occurrence: the one ending first stops the text
        hits = [(i + len(s), i) for s in self._stops if (i := text.find(s)) >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)[1]]
        keep = self._hold(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self) -> str:
        """What is held: the generation ended without completing a stop string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class TextStream:
    """One choice's generated ids to its text: ``Detokenizer`` then ``StopStrings``."""

    def __init__(self, tokenizer, prompt: Sequence[int], stops: Sequence[str] = ()) -> None:  # type: ignore[no-untyped-def]
        self._detok = Detokenizer(tokenizer, prompt)
        self._stops = StopStrings(stops)

    @property
    def stopped(self) -> bool:
        """A stop string showed: the request is to be ended with finish_reason "stop"."""
        return self._stops.stopped

    def push(self, token: int) -> str:
        return self._stops.push(self._detok.push(token))

    def finish(self) -> str:
        return self._stops.push(self._detok.finish()) + self._stops.finish()


class ModelText:
    """A served model's text side (module docstring). ``extra``: the checkpoint's ``extra``
    (where the chat template and the special tokens' texts are kept), ``template``: a chat
    template given instead of the kept one, ``where``: the model's path in messages."""

    def __init__(self, tokenizer, *, eos_ids: Sequence[int], vocab_size: int, extra: dict,  # type: ignore[no-untyped-def]
                 template: str | None = None, where: str) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.vocab_size = vocab_size
        self.where = where
        self.template = template if template is not None else chat_template(extra, where)
        self._special = special_token_texts(extra, where)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """A completions prompt as ids: text as ``moeflow generate`` encodes it; ids as given."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def render_chat(self, messages: list[dict]) -> str:
        """``messages`` through the chat template with the assistant's turn after them;
        ``NoChatTemplate`` without one, ``ValueError`` for a template that refuses them."""
        if self.template is None:
            raise NoChatTemplate(f"the model {self.where} has no chat template (no chat_template.jinja or "
                                 "tokenizer_config.json chat_template kept from a Hugging Face directory); use "
                                 "/v1/completions, or start the server with --chat-template FILE")
        return render_messages(self.template, messages, self._special, self.where)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The rendered conversation's ids (it holds its own special tokens)."""
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False)

    def stream(self, prompt: Sequence[int], stops: Sequence[str] = ()) -> TextStream:
        return TextStream(self.tokenizer, prompt, stops)

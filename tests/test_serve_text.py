"""``moeflow.serve.text``: the incremental detokenizer against the whole-sequence decode (its
reference) on fresh random text, never a piece ending in half a UTF-8 character; stop strings
against cutting the whole text before the first one to show, whatever the pieces; the chat side
(``ModelText``) rendering through ``moeflow.convert.chat`` as ``generate --chat`` does."""

from __future__ import annotations

import json
import random

import pytest
import torch

from moeflow.serve.text import REPLACEMENT, Detokenizer, ModelText, NoChatTemplate, StopStrings, TextStream, \
    reference_text
from moeflow.train.data import BPETokenizer, ByteTokenizer

pytestmark = pytest.mark.unit

# characters of one to four UTF-8 bytes: a byte-level token may hold part of any of them
ALPHABET = "abc xyz\n.,é߷日本語🙂🎉"


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@pytest.fixture
def rng(gen: torch.Generator) -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=gen, device="cpu")))


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    """A byte-level BPE: its merges join bytes across character boundaries, so tokens hold
    partial characters."""
    return BPETokenizer.train([_text(random.Random(s), 400) for s in range(20)], 300)


def _pieces(tok, prompt: list[int], ids: list[int]) -> list[str]:  # type: ignore[no-untyped-def]
    d = Detokenizer(tok, prompt)
    return [d.push(t) for t in ids] + [d.finish()]


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_pieces_concatenate_to_the_whole_decode_and_never_split_a_character(kind: str, rng, bpe) -> None:
    tok = ByteTokenizer(encoding="utf-8", eod=True) if kind == "bytes" else bpe
    for _ in range(20):
        prompt, text = tok.encode(_text(rng, rng.randint(1, 12))), _text(rng, rng.randint(1, 40))
        ids = tok.encode(text)
        pieces = _pieces(tok, prompt, ids)
        assert "".join(pieces) == reference_text(tok, prompt, ids) == text
        assert not any(REPLACEMENT in p for p in pieces)  # the text has none: no piece shows half a character
    if kind == "bytes":  # a multi-byte character's bytes give nothing until the last
        assert _pieces(tok, [], list("日".encode())) == ["", "", "日", ""]


def test_an_incomplete_character_at_the_end_is_given_as_the_whole_decode_gives_it() -> None:
    tok = ByteTokenizer(encoding="utf-8", eod=True)
    ids = list("a日".encode())[:-1]  # "a" and two of 日's three bytes
    pieces = _pieces(tok, [], ids)
    assert pieces[:-1] == ["a", "", ""] and "".join(pieces) == tok.decode(ids) == "a" + REPLACEMENT


def test_a_words_leading_space_survives_as_in_the_whole_decode() -> None:
    """A SentencePiece-style decoder drops the first word's leading space: decoded alone, the
    first generated word would lose it. With the prompt as context it keeps it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "▁hello", "▁world", "▁again"])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    tok = BPETokenizer(raw)
    prompt, ids = tok.encode("hello"), [vocab["▁world"], vocab["▁again"]]
    assert prompt == [vocab["▁hello"]] and tok.decode(ids[:1]) == "world"  # alone: no space
    assert "".join(_pieces(tok, prompt, ids)) == reference_text(tok, prompt, ids) == " world again"


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The reference: ``text`` up to the first stop string to show, read a character at a time
    (the first prefix of ``text`` that ends in a stop string; of those it ends in, the longest)."""
    for end in range(len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[:end - max(map(len, ending))], True
    return text, False


def test_stop_strings_cut_at_the_first_to_show_whatever_the_pieces(rng) -> None:
    for _ in range(200):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = StopStrings(stops)
        out = ""
        for piece in pieces:
            out += s.push(piece)
            assert _cut(text, stops)[0].startswith(out)  # nothing past a stop string, ever
        out += s.finish()
        assert (out, s.stopped) == _cut(text, stops), (text, stops, pieces)


def test_text_held_back_is_only_what_may_begin_a_stop_string() -> None:
    # a stop string that shows inside a longer one still coming ends the text: nothing past it
    # need be generated, and the cut is the same whether "xab" came whole or a character at a time
    for pieces in (["xab"], ["x", "a", "b"], ["xa", "bc"]):
        s = StopStrings(["abc", "b"])
        assert "".join(s.push(p) for p in pieces) + s.finish() == "xa" and s.stopped
    s = StopStrings(["ab", "b"])  # both end at once: the cut is before the longer
    assert s.push("xab") == "x"
    s = StopStrings(["END", "\n\n"])
    assert s.push("the E") == "the " and s.push("ND") == "" and s.stopped
    s = StopStrings(["END"])
    assert s.push("xE") == "x" and s.push("x") == "Ex" and s.finish() == "" and not s.stopped
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["a", ""])


def test_a_stream_stops_at_a_stop_string_split_across_tokens(rng) -> None:
    tok = ByteTokenizer(encoding="utf-8", eod=True)
    text = _text(rng, 30)
    stop = text[10:13]
    stream = TextStream(tok, tok.encode("p"), [stop])
    out = ""
    for t in tok.encode(text):
        out += stream.push(t)
        if stream.stopped:
            break
    assert stream.stopped and out + stream.finish() == _cut(text, [stop])[0]


def _hf_extra(template: str | None) -> dict:
    config = {"bos_token": "<s>", "eos_token": "</s>"} | ({"chat_template": template} if template else {})
    return {"hf": {"model_type": "mixtral", "files": {"tokenizer_config.json": json.dumps(config)}}}


def test_conversations_render_through_the_models_template_and_encode_without_added_tokens() -> None:
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
                "{% endif %}")
    tok = ByteTokenizer(encoding="utf-8", eod=True)
    text = ModelText(tok, eos_ids=[256], vocab_size=257, extra=_hf_extra(template), where="ck")
    messages = [{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}]
    assert text.render_chat(messages) == "<s>system: brief\nuser: hi\nassistant:"
    assert text.encode_chat(messages) == tok.encode("<s>system: brief\nuser: hi\nassistant:")
    with pytest.raises(ValueError, match="ck: the chat template does not render.*no tools"):
        text.render_chat([{"role": "tool", "content": "x"}])
    assert text.eos_ids == frozenset({256}) and text.encode_prompt([3, 4]) == [3, 4]

    bare = ModelText(tok, eos_ids=[], vocab_size=257, extra=_hf_extra(None), where="ck")
    with pytest.raises(NoChatTemplate, match="ck has no chat template"):
        bare.encode_chat(messages)
    given = ModelText(tok, eos_ids=[], vocab_size=257, extra=_hf_extra(None), template="{{ messages[0]['content'] }}",
                      where="ck")
    assert given.render_chat(messages) == "brief"


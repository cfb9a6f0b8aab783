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


def _metaspace(words: list[str]):  # type: ignore[no-untyped-def]
    """A SentencePiece-style tokenizer (a word's leading space is "▁", dropped at the start of a
    decode) with special tokens that decode to nothing and a post-processor that puts ``<s>``
    before an encoded text, as Llama's ``tokenizer.json`` does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *("▁" + w for w in words)])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return BPETokenizer(raw), vocab


def test_pieces_keep_their_spaces_across_tokens_that_decode_to_nothing(rng) -> None:
    """Special tokens (decoded to nothing) among words: the piece after one still has its
    word's leading space, the concatenation is the whole decode."""
    tok, vocab = _metaspace(["hello", "world", "again", "日本", "a"])
    words, specials = [i for w, i in vocab.items() if w.startswith("▁")], [vocab["<s>"], vocab["</s>"]]
    for _ in range(30):
        prompt = [rng.choice(words) for _ in range(rng.randint(1, 8))]
        ids = [rng.choice(words + specials) for _ in range(rng.randint(1, 25))]
        pieces = _pieces(tok, prompt, ids)
        assert "".join(pieces) == reference_text(tok, prompt, ids), (prompt, ids, pieces)
    prompt, ids = [vocab["▁hello"]], [vocab["▁world"], vocab["</s>"], vocab["▁again"]]
    assert _pieces(tok, prompt, ids) == [" world", "", " again", ""]


def test_a_stream_without_stop_strings_is_the_whole_decode(rng, bpe) -> None:
    """No stop strings: nothing is held back or cut, the end included (an incomplete character
    at the end as the whole decode gives it)."""
    for tok in (ByteTokenizer(encoding="utf-8", eod=True), bpe):
        for _ in range(10):
            prompt, ids = tok.encode(_text(rng, rng.randint(1, 9))), tok.encode(_text(rng, rng.randint(1, 30)))
            ids = ids[:rng.randint(1, len(ids))]  # may end inside a character
            stream = TextStream(tok, prompt)
            out = "".join(stream.push(t) for t in ids) + stream.finish()
            assert out == reference_text(tok, prompt, ids) and not stream.stopped
            assert stream.finish() == ""  # handed out once


def test_a_stream_hands_out_what_it_held_at_the_end_once(rng) -> None:
    """A generation that ends inside what may begin a stop string hands it out at the end (and
    only once), through the detokenizer's held bytes too."""
    tok = ByteTokenizer(encoding="utf-8", eod=True)
    for _ in range(20):
        stop = _text(rng, rng.randint(2, 4))
        text = _text(rng, rng.randint(0, 10)) + stop[:rng.randint(1, len(stop) - 1)]
        if stop in text:
            continue
        ids = tok.encode(text)
        stream = TextStream(tok, tok.encode("p"), [stop])
        out = "".join(stream.push(t) for t in ids)
        assert text.startswith(out) and len(out) < len(text)  # the stop string's beginning is held
        assert out + stream.finish() == text and not stream.stopped
        assert stream.finish() == ""
    s = StopStrings(["END"])
    assert s.push("aEN") == "a" and s.finish() == "EN" and s.finish() == ""


def test_the_served_models_text_side(rng) -> None:
    """What the app reads of ``ModelText``: the vocabulary size (ids past it are refused), a
    prompt encoded with the tokenizer's own special tokens and a rendered conversation without
    (it holds them: one ``<s>``, where the template put it), a stream per choice over the
    prompt's ids with the request's stop strings."""
    tok, vocab = _metaspace(["hello", "world", "again", "a"])
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}again"
    text = ModelText(tok, eos_ids=[2], vocab_size=7, extra=_hf_extra(template), where="ck")
    assert (text.vocab_size, text.eos_ids, text.template) == (7, frozenset({2}), template)
    words = [w[1:] for w in vocab if w.startswith("▁")]
    said = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
    assert text.encode_prompt(said) == [vocab["<s>"]] + [vocab["▁" + w] for w in said.split()]
    ids = text.encode_chat([{"role": "user", "content": said}])
    assert ids == [vocab["<s>"]] + [vocab["▁" + w] for w in said.split()] + [vocab["▁again"]]
    assert text.encode_prompt(ids) == ids

    gen = [rng.choice([vocab["▁" + w] for w in words]) for _ in range(rng.randint(2, 12))]
    whole = reference_text(tok, ids, gen)
    stop = whole[rng.randint(1, len(whole) - 2):][:3]
    stream = text.stream(ids, [stop])
    out = ""
    for t in gen:
        out += stream.push(t)
        if stream.stopped:
            break
    assert stream.stopped and out + stream.finish() == _cut(whole, [stop])[0]
    stream = text.stream(ids)
    assert "".join(stream.push(t) for t in gen) + stream.finish() == whole  # with the prompt's context: spaces kept


def test_a_model_without_a_template_says_how_to_chat_with_it_and_a_malformed_one_names_the_model() -> None:
    tok = ByteTokenizer(encoding="utf-8", eod=True)
    bare = ModelText(tok, eos_ids=[], vocab_size=257, extra=_hf_extra(None), where="ck/model")
    with pytest.raises(NoChatTemplate) as caught:
        bare.render_chat([{"role": "user", "content": "hi"}])
    assert str(caught.value) == (
        "the model ck/model has no chat template (no chat_template.jinja or tokenizer_config.json chat_template kept "
        "from a Hugging Face directory); use /v1/completions, or start the server with --chat-template FILE")
    broken = {"hf": {"model_type": "mixtral", "files": {"tokenizer_config.json": "{not json"}}}
    with pytest.raises(ValueError, match="^ck/model: its kept tokenizer_config.json is not JSON"):
        ModelText(tok, eos_ids=[], vocab_size=257, extra=broken, where="ck/model")
    broken = _hf_extra("{{ messages }}")
    broken["hf"]["files"]["special_tokens_map.json"] = "[1]"  # read for the special tokens' texts only
    with pytest.raises(ValueError, match="^ck/model: its kept special_tokens_map.json is not a JSON object"):
        ModelText(tok, eos_ids=[], vocab_size=257, extra=broken, where="ck/model")

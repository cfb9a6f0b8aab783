"""The whole engine from the command line on a Hugging Face model directory (issue 47, item 3):
``moeflow train --init-from HF_DIR`` (converted in memory; resuming never reads its weights),
``generate`` with the model's own tokenizer, every end-of-sequence id it declares and its chat
template, ``infer --offload`` on a converted model, and ``convert --to-hf`` of a fine-tuned
run back to the family's layout with the original tokenizer files.

The directory is a tiny Mixtral made by transformers (``MixtralConfig``, ``save_pretrained``
sharded), with a character-level tokenizer covering its whole vocabulary (so every generated id
shows in the text) that puts ``<s>`` first as Llama's does, a chat template in
``chat_template.jinja`` (which wins over the one in ``tokenizer_config.json``, as in
transformers), and a ``generation_config.json`` that declares two end-of-sequence ids: the
tokenizer's ``eos_token`` and an id the model's greedy continuation reaches (found here), so
stopping at the list and at the tokenizer's token differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moeflow.checkpoint import read_index
from moeflow.cli.main import main

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

CHARS = "abcdefghijklmnopqrstuvwxyz :01234567"  # ids 4-39, after <unk> <s> </s> <|im_end|>
PROMPT = "bad cab"
NEW = 16
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ('user', 'assistant') %}"
            "{{ raise_exception('no ' ~ m['role'] ~ ' turns') }}{% endif %}{{ m['role'][0] }}:{{ m['content'] }}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
CONFIG_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # chat_template.jinja wins over it
TRAIN = ["--device", "cpu", "--steps", "2", "--batch-size", "4", "--seq-len", "16", "--eval-batches", "1",
         "--warmup", "1", "--no-progress", "--no-plot", "--sample-tokens", "0", "--threads", "1"]


def _tokenizer_json() -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3, **{c: i + 4 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>", "<|im_end|>"])
    return tok.to_str(pretty=True)  # as published files are (a re-serialised one would differ)


def _greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' model, greedy, the whole context each step (no stop token)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, hf(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> dict:
    """The tiny Mixtral directory (module docstring) and what the tests compare with:
    ``greedy`` (its first ``NEW`` greedy tokens after ``PROMPT``), ``stop`` (the position of the
    declared end-of-sequence id among them)."""
    root = tmp_path_factory.mktemp("hf")
    cfg = transformers.MixtralConfig(vocab_size=40, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=1,
                                     eos_token_id=3)
    gen = torch.Generator().manual_seed(47)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    path = root / "mixtral"
    hf.save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    (path / "tokenizer.json").write_text(_tokenizer_json())
    special = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **special, "chat_template": CONFIG_TEMPLATE}))
    (path / "special_tokens_map.json").write_text(json.dumps(special))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    ids = [1, *(CHARS.index(c) + 4 for c in PROMPT)]
    greedy = _greedy(hf, ids, NEW)
    # the declared id: the first new token from the 4th on that is no special token and not seen before
    stop = next(j for j in range(3, NEW) if greedy[j] > 3 and greedy[j] not in greedy[:j])
    assert 3 not in greedy, "the seed's model reaches the tokenizer's eos_token: choose another seed"
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [3, greedy[stop]]}))
    return {"path": path, "ids": ids, "greedy": greedy, "stop": stop}


def _text(ids: list[int]) -> str:
    """What moeflow generate prints for these ids (the special tokens 1-3 are skipped)."""
    return "".join(CHARS[i - 4] if i >= 4 else "<unk>" for i in ids if i not in (1, 2, 3))


def _run(argv: list[object], capture) -> tuple[int, str, str]:
    """``moeflow ARGV`` in this process: (status, stdout, stderr), through ``capture`` (capsys, or
    capfd where ranks in other processes write too)."""
    threads = torch.get_num_threads()
    try:
        status = main([str(a) for a in argv])
    finally:
        torch.set_num_threads(threads)
    out, err = capture.readouterr()
    return status, out, err


def _convert(hf_dir: dict, tmp_path: Path, capsys) -> Path:
    assert _run(["convert", "--from-hf", hf_dir["path"], tmp_path / "ck"], capsys)[0] == 0
    return tmp_path / "ck"


def _corpus(root: Path) -> Path:
    root.mkdir()
    for i in range(40):
        (root / f"d{i}.txt").write_text(f"{CHARS[i % 26]}{CHARS[(i * 7) % 26]} {CHARS[(i * 3) % 36]}bad cab {i}")
    return root


def test_init_from_reads_a_hugging_face_directory_without_its_weights(hf_dir, monkeypatch) -> None:
    """``init_checkpoint`` gives what ``convert --from-hf`` keeps (the model config, the tokenizer,
    every end-of-sequence id, the family and its files) without reading a tensor."""
    from moeflow.convert.hf import import_hf
    from moeflow.convert.hf_files import HFWeights
    from moeflow.train.init_from import init_checkpoint, is_hf_dir

    _, kept = import_hf(hf_dir["path"])
    monkeypatch.setattr(HFWeights, "read", lambda self, name: pytest.fail(f"read {name}"))
    path, extra = init_checkpoint(hf_dir["path"])
    assert path == hf_dir["path"] and is_hf_dir(path)
    assert extra["special_tokens"] == {"bos_token_id": 1, "eos_token_id": [3, hf_dir["greedy"][hf_dir["stop"]]],
                                       "pad_token_id": None}
    for key in ("tokenizer", "special_tokens", "hf"):
        assert extra[key] == kept[key], key
    assert extra["model"]["num_experts"] == 4 and extra["hf"]["model_type"] == "mixtral"


def test_generate_equals_transformers_and_stops_at_every_declared_eos_id(hf_dir, tmp_path, capsys) -> None:
    """Greedy ``moeflow generate`` on the converted model gives transformers' ``generate`` tokens
    on the same prompt (tokenized alike, ``<s>`` first) and stops where it stops: at the second
    id of generation_config.json's list, which is not the tokenizer's end token. ``--eos``
    replaces the declared ids."""
    ck = _convert(hf_dir, tmp_path, capsys)
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir["path"])
    hf = transformers.MixtralForCausalLM.from_pretrained(hf_dir["path"]).eval()
    ids = auto(PROMPT)["input_ids"]
    assert ids == hf_dir["ids"]
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    stop = hf_dir["stop"]
    assert theirs == hf_dir["greedy"][:stop + 1]  # transformers stops at the declared id too

    status, out, _ = _run(["generate", ck, "--prompt", PROMPT, "--max-new-tokens", NEW, "--temperature", "0",
                           "--device", "cpu"], capsys)
    assert status == 0 and out == f"{PROMPT}{_text(theirs)}\n"
    status, out, _ = _run(["generate", ck, "--prompt", PROMPT, "--max-new-tokens", NEW, "--temperature", "0",
                           "--device", "cpu", "--eos", "3"], capsys)
    assert status == 0 and out == f"{PROMPT}{_text(hf_dir['greedy'])}\n"  # the whole continuation

    from moeflow.models.generation import generate
    from moeflow.train import build_from_checkpoint

    model, tok, _ = build_from_checkpoint(ck)
    assert tok.encode(PROMPT) == ids
    assert generate(model, [ids], NEW, temperature=0).tokens[0] == hf_dir["greedy"]


def test_chat_prompts_render_and_answer_as_in_transformers(hf_dir, tmp_path, capsys) -> None:
    """``--chat``: the prompt through the checkpoint's chat template (chat_template.jinja, not
    tokenizer_config.json's) is the text and the ids of transformers' ``apply_chat_template``,
    and the reply is transformers' greedy reply; a template that raises is one line naming the
    checkpoint."""
    from moeflow.checkpoint.format import latest_checkpoint
    from moeflow.convert.chat import chat_template, render_chat, special_token_texts

    ck = _convert(hf_dir, tmp_path, capsys)
    extra = read_index(latest_checkpoint(ck))["extra"]
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir["path"])
    messages = [{"role": "user", "content": PROMPT}]
    text = render_chat(chat_template(extra, "ck"), PROMPT, special_token_texts(extra, "ck"), "ck")
    assert text == auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"<s>u:{PROMPT}<|im_end|>a:"
    ids = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    from moeflow.train import build_from_checkpoint

    _, tok, _ = build_from_checkpoint(ck)
    assert tok.encode(text, add_special_tokens=False) == ids and ids[0] == 1 and ids.count(1) == 1

    hf = transformers.MixtralForCausalLM.from_pretrained(hf_dir["path"]).eval()
    reply = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    status, out, _ = _run(["generate", ck, "--chat", "--prompt", PROMPT, "--max-new-tokens", "10",
                           "--temperature", "0", "--device", "cpu"], capsys)
    assert status == 0 and out == f"{_text(reply)}\n"

    (tmp_path / "raises.jinja").write_text("{{ raise_exception('this template refuses') }}")
    status, out, err = _run(["generate", ck, "--chat-template", tmp_path / "raises.jinja", "--prompt", PROMPT],
                            capsys)
    assert (status, out) == (2, "") and err.count("\n") == 1 and "this template refuses" in err and str(ck) in err


def test_which_chat_template_and_special_tokens_a_checkpoint_keeps() -> None:
    """chat_template.jinja first, else tokenizer_config.json's template, a named list's
    ``default``; special tokens from tokenizer_config.json over special_tokens_map.json, an
    AddedToken's description by its content; malformed files named."""
    from moeflow.convert.chat import chat_template, special_token_texts

    def extra(**files: object) -> dict:
        return {"hf": {"model_type": "mixtral", "files": {k.replace("_json", ".json").replace("_jinja", ".jinja"):
                                                          v if isinstance(v, str) else json.dumps(v)
                                                          for k, v in files.items()}}}

    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert chat_template(extra(tokenizer_config_json={"chat_template": named}), "ck") == "D"
    assert chat_template(extra(tokenizer_config_json={"chat_template": "C"}, chat_template_jinja="J"), "ck") == "J"
    assert chat_template(extra(tokenizer_config_json={"eos_token": "</s>"}), "ck") is None
    assert chat_template({"tokenizer": {"kind": "byte"}}, "ck") is None  # a moeflow run of its own
    with pytest.raises(ValueError, match="ck: tokenizer_config.json names chat templates.*none 'default'"):
        chat_template(extra(tokenizer_config_json={"chat_template": named[:1]}), "ck")
    with pytest.raises(ValueError, match="ck: its kept tokenizer_config.json is not JSON"):
        chat_template(extra(tokenizer_config_json="{oops"), "ck")
    special = special_token_texts(extra(
        tokenizer_config_json={"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "<|im_end|>"},
        special_tokens_map_json={"eos_token": "</s>", "pad_token": "<pad>"}), "ck")
    assert special == {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>"}


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_infer_offloads_a_converted_model(hf_dir, tmp_path, capsys, offload) -> None:
    """``moeflow infer CKPT --offload host|disk`` on a converted model: the offloaded run's
    logits and greedy tokens are the in-memory model's."""
    ck = _convert(hf_dir, tmp_path, capsys)
    report = tmp_path / "report.json"
    status, _, err = _run(["infer", ck, "--offload", offload, "--fast-memory", "30KB", "--mode", "cache",
                           "--prompt", PROMPT, "--new-tokens", "6", "--compare", "--device", "cpu", "--json", report],
                          capsys)
    assert status == 0, err
    done = json.loads(report.read_text())
    assert done["identical"] is True and done["tokens"] == {"batch": 1, "prompt": len(hf_dir["ids"]), "new": 6}
    assert done["stats"]["bytes_loaded"] > 0


def test_fine_tune_a_hugging_face_directory_resume_and_export(hf_dir, tmp_path, capsys, monkeypatch) -> None:
    """``train --init-from HF_DIR`` trains exactly as ``--init-from`` its converted checkpoint
    (same losses), on ``--data`` tokenized with the model's tokenizer; its checkpoints carry the
    special tokens, the family and the kept files; ``--resume`` continues without the
    directory's weights; ``convert --to-hf`` (here after a round trip through DCP) writes a
    Mixtral directory with the original tokenizer files that transformers loads with the
    fine-tuned weights; ``generate --chat`` and
    ``infer --offload`` run on it."""
    from moeflow.convert.hf_files import HFWeights
    from moeflow.train import build_from_checkpoint

    hf = Path(shutil.copytree(hf_dir["path"], tmp_path / "hf"))
    data = _corpus(tmp_path / "corpus")
    ck = _convert(hf_dir, tmp_path, capsys)
    status, _, err = _run(["train", "--init-from", hf, "--data", data, "--out", tmp_path / "a", *TRAIN], capsys)
    assert status == 0, err
    assert _run(["train", "--init-from", ck, "--data", data, "--out", tmp_path / "b", *TRAIN], capsys)[0] == 0
    a = json.loads((tmp_path / "a" / "history.json").read_text())
    b = json.loads((tmp_path / "b" / "history.json").read_text())
    assert a["train_loss"] == b["train_loss"] and a["val"] == b["val"]
    saved = read_index(a["checkpoint"])["extra"]
    converted = read_index(ck / "step-00000000")["extra"]
    for key in ("tokenizer", "special_tokens", "hf"):
        assert saved[key] == converted[key], key
    assert saved == {**read_index(b["checkpoint"])["extra"], "train": saved["train"], "run_id": saved["run_id"]}

    for weights in hf.glob("*.safetensors*"):  # resuming reads the run's checkpoint, not these
        weights.unlink()
    monkeypatch.setattr(HFWeights, "__enter__", lambda self: pytest.fail("read the HF weights"))
    status, _, err = _run(["train", "--init-from", hf, "--data", data, "--out", tmp_path / "a", *TRAIN, "--steps",
                           "3", "--resume"], capsys)
    assert status == 0, err
    resumed = json.loads((tmp_path / "a" / "history.json").read_text())
    assert resumed["step"] == [1, 2, 3] and resumed["train_loss"][:2] == a["train_loss"]
    monkeypatch.undo()

    assert _run(["convert", tmp_path / "a", "--to-dcp", tmp_path / "dcp"], capsys)[0] == 0  # and back, through DCP
    assert _run(["convert", "--from-dcp", tmp_path / "dcp", tmp_path / "c"], capsys)[0] == 0
    assert _run(["convert", tmp_path / "c", "--to-hf", tmp_path / "out"], capsys)[0] == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (hf_dir["path"] / name).read_bytes(), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "mixtral"
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    model, _, _ = build_from_checkpoint(tmp_path / "a")
    x = torch.tensor([hf_dir["ids"]])
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(back(x).logits, transformers.MixtralForCausalLM.from_pretrained(
            hf_dir["path"])(x).logits)  # fine-tuned: not the original weights

    status, out, _ = _run(["generate", tmp_path / "a", "--chat", "--prompt", PROMPT, "--max-new-tokens", "4",
                           "--temperature", "0", "--device", "cpu"], capsys)
    assert status == 0 and out.endswith("\n")
    report = tmp_path / "report.json"  # a ring of whole layers this time
    assert _run(["infer", tmp_path / "a", "--offload", "disk", "--fast-memory", "80KB", "--mode", "ring",
                 "--new-tokens", "4", "--compare", "--device", "cpu", "--json", report], capsys)[0] == 0
    assert json.loads(report.read_text())["identical"] is True


def test_a_run_from_a_converted_checkpoint_exports_to_its_family_with_its_files(hf_dir, tmp_path, capsys) -> None:
    """``train --init-from`` a ``convert --from-hf`` checkpoint, then ``convert --to-hf`` of the
    run: the family's layout (not a fallback) with the original tokenizer files byte for byte,
    the chat template and every end-of-sequence id; a run continued from that run keeps them."""
    ck = _convert(hf_dir, tmp_path, capsys)
    data = _corpus(tmp_path / "corpus")
    assert _run(["train", "--init-from", ck, "--data", data, "--out", tmp_path / "a", *TRAIN], capsys)[0] == 0
    assert _run(["train", "--init-from", tmp_path / "a", "--data", data, "--out", tmp_path / "b", *TRAIN],
                capsys)[0] == 0
    for run in ("a", "b"):
        out = tmp_path / f"{run}-hf"
        assert _run(["convert", tmp_path / run, "--to-hf", out], capsys)[0] == 0
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                     "chat_template.jinja"):
            assert (out / name).read_bytes() == (hf_dir["path"] / name).read_bytes(), (run, name)
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "mixtral" and config["eos_token_id"] == [3, hf_dir["greedy"][hf_dir["stop"]]]
        auto = transformers.AutoTokenizer.from_pretrained(out)
        assert auto.apply_chat_template([{"role": "user", "content": "ab"}], add_generation_prompt=True,
                                        tokenize=False) == "<s>u:ab<|im_end|>a:"


def test_init_from_a_damaged_directory_is_refused_before_any_work(hf_dir, tmp_path, capsys) -> None:
    """A weight file that cannot be read is one line naming it, before ``--out`` is touched."""
    hf = Path(shutil.copytree(hf_dir["path"], tmp_path / "hf"))
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    status, out, err = _run(["train", "--init-from", hf, "--data", _corpus(tmp_path / "corpus"), "--out",
                             tmp_path / "run", *TRAIN], capsys)
    assert (status, out) == (2, "") and err.count("\n") == 1 and "--init-from" in err and shard.name in err, err
    assert not (tmp_path / "run").exists()


def test_the_readme_commands_on_two_expert_parallel_ranks(hf_dir, tmp_path, capfd) -> None:
    """The README's three commands: fine-tune the directory on 2 expert-parallel ranks (its first
    step's loss is one process's), chat with the run, export it to the family's layout."""
    data = _corpus(tmp_path / "corpus")
    flags = ["--init-from", hf_dir["path"], "--data", data, *TRAIN]
    assert _run(["train", *flags, "--out", tmp_path / "one"], capfd)[0] == 0
    assert _run(["train", *flags, "--nproc", "2", "--out", tmp_path / "run"], capfd)[0] == 0  # the ranks' output too
    one = json.loads((tmp_path / "one" / "history.json").read_text())
    two = json.loads((tmp_path / "run" / "history.json").read_text())
    assert two["world_size"] == 2 and two["val"][0][1] == pytest.approx(one["val"][0][1], rel=1e-5)
    assert two["train_loss"][0] == pytest.approx(one["train_loss"][0], rel=1e-5)
    status, out, _ = _run(["generate", tmp_path / "run", "--chat", "--prompt", PROMPT, "--max-new-tokens", "4",
                           "--device", "cpu"], capfd)
    assert status == 0 and out.endswith("\n")
    assert _run(["convert", tmp_path / "run", "--to-hf", tmp_path / "out"], capfd)[0] == 0
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").model_type == "mixtral"
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == TEMPLATE

"""``python -m bench.families`` (the public families against transformers, whole models on the
same weights) at tiny shapes: a row per family with both candidates' figures, greedy tokens
compared, and bad flags refused by name. No timing is asserted."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

pytest.importorskip("transformers")

from bench import families  # noqa: E402

pytestmark = pytest.mark.e2e


def test_a_tiny_family_run_reports_both_candidates(tmp_path):
    out = tmp_path / "families.json"
    assert families.main(["--families", "mixtral", "--shape", "tiny", "--repeats", "1", "--tokens", "17",
                          "--new-tokens", "4", "--prompt-len", "5", "--decode-batch", "1,2", "--hf-experts", "eager", "--no-hf-static",
                          "--threads", "1", "--clock", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["family"] == "mixtral" and row["parameters"] > 0
    train = row["train"]
    assert [d["batch"] for d in row["decode"]] == [1, 2]
    decode = row["decode"][1]
    assert train["tokens"] == 2 * 16 and set(train["median_s"]) == {"moeflow", "hf:eager"}
    assert train["ratio"] == pytest.approx(train["median_s"]["hf:eager"] / train["median_s"]["moeflow"])
    assert set(decode["tokens_per_s"]) == {"moeflow:compiled", "hf:generate"}
    assert decode["tokens_equal"]["moeflow:compiled"] is True  # the same weights, greedy: the same tokens


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_both_models_take_the_same_loss(tmp_path, family):
    """The train step times the same loss: every next token of the row (transformers' ``labels``
    alone are shifted inside and drop the last target)."""
    args = argparse.Namespace(seed=0, shape="tiny", prompt_len=5, new_tokens=4, tokens=17)
    hf, model = families._build(family, args, tmp_path)
    idx_BS = torch.randint(0, hf.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.loss(idx_BS[:, :-1], idx_BS[:, 1:])
        theirs = families._hf_loss(hf, "eager", idx_BS)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=0)


@pytest.mark.parametrize("argv, match", [
    (["--families", "llama"], "not one of|does not convert"),
    (["--tokens", "1"], "--tokens must be at least 2"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--decode-batch", "1,0"], "--decode-batch: every batch must be at least 1"),
    (["--decode-batch", "x"], "--decode-batch: comma-separated integers"),
    (["--max-warmups", "2"], "--max-warmups must be at least 3"),
])
def test_bad_flags_are_refused_by_name(argv, match):
    with pytest.raises(SystemExit, match=match):
        families.main(argv)

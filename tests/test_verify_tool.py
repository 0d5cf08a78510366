"""`specdecode verify`: passes on a lossless pair and reports planted bugs at the right place with exit code 1."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode import cli
from specdecode.bench.spec_bench import first_mismatch
from specdecode.builder import build_generator
from specdecode.errors import InvalidRequestError
from specdecode.tools.prompts import Prompt, load_prompts
from specdecode.tools.verify import verify
from specdecode.verification import verify as verification
from specdecode.verification.sampling import processed_probs

PROMPTS = [Prompt(f"p{i}", text, False) for i, text in enumerate(["hello world", "abc def ghi", "The cat sat on"])]


def test_lossless_pair_passes(tiny_pair):
    target, draft = tiny_pair
    report = verify(target, PROMPTS, ["model", "ngram", "ngram-tree", "suffix"], draft=draft, max_new_tokens=24)
    assert report.ok
    assert {(c.drafter, c.path) for c in report.checks} >= {("model", "alone"), ("model", "batched"),
                                                              ("none", "batched"), ("ngram-tree", "batched")}
    assert all(c.tokens == 24 for c in report.checks)


def test_sampled_pair_passes(tiny_pair):
    target, draft = tiny_pair
    report = verify(target, PROMPTS[:2], ["model", "ngram-tree"], draft=draft, max_new_tokens=16, temperature=1.0,
                    samples=400)
    assert report.ok, report.to_dict()
    assert report.settings["coupling"] == "gumbel"  # the identity check of a sampled setting
    assert {t.drafter for t in report.tests} == {"model", "ngram-tree"}


def _cross_row_head(monkeypatch, model) -> None:
    """A planted kernel bug: the lm_head's rows leak into each other, so a token's logits depend on what else its
    forward holds (in a plain step: padding; in a verify step: the draft)."""
    head = model.lm_head
    forward = head.forward

    def leaky(x: torch.Tensor) -> torch.Tensor:
        out = forward(x)
        return out + 0.5 * out.mean(dim=-2, keepdim=True) if out.dim() == 3 and out.shape[-2] > 1 else out

    monkeypatch.setattr(head, "forward", leaky)


def test_row_dependent_linear_is_reported_where_it_first_differs(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    _cross_row_head(monkeypatch, target.model)
    report = verify(target, PROMPTS, ["model"], draft=draft, max_new_tokens=24, batch=0)
    assert not report.ok
    plain = build_generator(target, drafter="none")
    spec = build_generator(target, draft=draft, drafter="model")
    found = 0
    for prompt, check in zip(PROMPTS, report.checks):
        want = plain.generate(prompt.content, max_new_tokens=24).token_ids
        got = spec.generate(prompt.content, max_new_tokens=24).token_ids
        position = first_mismatch(want, got)
        if position is None:
            assert check.difference is None
            continue
        found += 1
        d = check.difference
        assert d is not None and d.position == position
        assert (d.expected, d.got) == (want[position], got[position])
        assert d.context == target.tokenizer.decode(want[:position])[-80:]
        assert d.margin is not None and d.margin > 0  # plain decoding took the target's argmax there
    assert found


def test_sampler_that_skips_the_residual_fails_the_distribution_test(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    real = verification.verify_sampling

    def skips_residual(logits, tokens, q, params, generator, num_drafted=None):
        n, _ = real(logits, tokens, q, params, generator, num_drafted)
        p = processed_probs(logits, params)[torch.arange(len(n)), n]  # p where the next token is drawn: no residual
        return n, torch.multinomial(p, 1, generator=generator).squeeze(1)

    monkeypatch.setattr(verification, "verify_sampling", skips_residual)
    report = verify(target, PROMPTS[:1], ["model"], draft=draft, max_new_tokens=8, temperature=1.0, samples=1000,
                    batch=0)
    assert not report.ok
    first = next(t for t in report.tests if t.position == 1)
    assert not first.passed and first.p_value < 1e-3


def test_cli_exit_codes_and_json(tiny_pair, tmp_path, monkeypatch, capsys):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p.content}) for p in PROMPTS))
    args = ["verify", "--target", str(target.source), "--draft", str(draft.source), "--prompts", str(prompts),
            "--drafter", "model", "--drafter", "ngram", "--max-new-tokens", "12", "--json"]
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and len(out["checks"]) == 3 * 2 + 3 * 3  # alone per drafter, batched per drafter and plain
    from specdecode.models import loading

    load = loading.load_model

    def leaky_load(*a, **k):
        model = load(*a, **k)
        if k.get("decode_width"):  # the target
            _cross_row_head(monkeypatch, model.model)
        return model

    monkeypatch.setattr("specdecode.builder.load_model", leaky_load)
    assert cli.main(args[:-1]) == 1
    assert "DIFFERS at token" in capsys.readouterr().out


def test_prompt_files(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("first\n\nsecond\n")
    assert [p.content for p in load_prompts(str(text))] == ["first", "second"]
    rows = tmp_path / "p.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"turns": ["a", "b"]}\n{"prompt": "x"}\n')
    loaded = load_prompts(str(rows))
    assert [p.chat for p in loaded] == [True, True, False] and loaded[1].content == "a"
    assert len(load_prompts("spec-bench", 5)) == 5
    for bad in ['{"prompt": 3}', "not json", '{"messages": [{"role": "user"}]}']:
        rows.write_text(bad + "\n")
        with pytest.raises(InvalidRequestError, match="p.jsonl:1"):
            load_prompts(str(rows))
    with pytest.raises(InvalidRequestError, match="no prompts file"):
        load_prompts(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("argv, message", [(["--limit", "-1"], "--limit must be >= 0"),
                                           (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
                                           (["--batch", "-1"], "--batch must be >= 0"),
                                           (["--temperature", "1", "--samples", "3"], "--samples must be >= 20"),
                                           (["--temperature", "1", "--alpha", "2"], "--alpha must be between"),
                                           (["--prompts", "/"], "is a folder")])
def test_bad_arguments_fail_before_loading(argv, message, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr("specdecode.builder.load_target", no_load)
    assert cli.main(["verify", *argv]) == 2
    assert message in capsys.readouterr().err

"""`specdecode tune` and config files: the prediction, the choice, and --config honoured by generate, serve and
bench."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specdecode import cli
from specdecode.builder import build_generator
from specdecode.tools import tune as tuning
from specdecode.tools.config import expand_config, read_config, write_config
from specdecode.trace import StepTrace

PROMPTS = ["hello world hello world", "abc def abc def", "The cat sat on the mat. The cat"]


def test_prediction_by_hand():
    steps = [StepTrace(drafted=4, depth=4, accepted=2, draft_seconds=0.004), StepTrace(4, 4, 4, 0.004)]
    p = tuning.Profile(steps, tokens=100, requests=1, draft_seconds=0.001, per_token=True, catch_up_seconds=0.5,
                       tree=False, gamma=8)
    curve = {k: 10.0 * k for k in range(1, 18)}  # ms
    tokens, speed = tuning.predict(p, curve, 4)
    assert tokens == 4.0  # (3 + 5) / 2
    step_s = 0.050 + 0.004  # a forward of 5, four drafted tokens
    assert speed == pytest.approx(100 / (100 / 4 * step_s + 0.5))
    tokens, speed = tuning.predict(p, curve, 1)  # cut to one drafted token: both steps keep it
    assert tokens == 2.0 and speed == pytest.approx(100 / (50 * 0.021 + 0.5))


def _free_drafting(monkeypatch):
    """Mocked timings: drafting costs nothing, so the verify curve alone decides."""
    real = tuning.profile

    def profile(*args, **kwargs):
        p = real(*args, **kwargs)
        return replace(p, steps=[replace(s, draft_seconds=0.0) for s in p.steps], draft_seconds=0.0,
                       catch_up_seconds=0.0)

    monkeypatch.setattr(tuning, "profile", profile)


@pytest.mark.parametrize("curve, drafts", [({k: 10.0 for k in range(1, 18)}, True),  # flat: drafting pays
                                           ({k: 10.0 * k * k for k in range(1, 18)}, False)])  # steep: plain wins
def test_choice_is_the_best_predicted(tiny_pair, monkeypatch, curve, drafts):
    target, draft = tiny_pair
    _free_drafting(monkeypatch)
    ids = [target.tokenizer.encode(p) for p in PROMPTS]
    result = tuning.tune({"file": target}, ids, ["model", "ngram", "ngram-tree"], draft=draft, max_new_tokens=24,
                         confirm=0, curves={"file": curve})
    best = max(result.candidates, key=lambda c: c.predicted)
    assert result.chosen is best is result.candidates[0]
    assert (result.chosen.config.drafter != "none") == drafts
    labels = {c.config.label for c in result.candidates}
    assert {"plain [file]", "model g1 [file]", "model g8 [file]", "model [file]", "ngram-tree g8 [file]"} <= labels


def test_choice_is_the_best_confirmed(tiny_pair):
    target, draft = tiny_pair
    ids = [target.tokenizer.encode(p) for p in PROMPTS]
    result = tuning.tune({"file": target}, ids, ["model", "ngram"], draft=draft, max_new_tokens=16, confirm=2)
    confirmed = [c for c in result.candidates if c.measured is not None]
    assert len(confirmed) == 3  # plain and the two best predicted
    assert result.chosen.measured == max(c.measured for c in confirmed)
    assert set(result.verify_ms["file"]) == set(range(1, tuning.TREE_WIDTH + 1))


def test_config_round_trip_and_flags(tmp_path):
    path = tmp_path / "c.toml"
    write_config(path, {"drafter": "ngram", "gamma": 3, "quant": "file", "draft": None},
                 {"chosen": "ngram g3 [file]", "verify_ms": {"file": {"1": 2.5}}}, "a comment\nsecond line")
    assert read_config(path) == {"drafter": "ngram", "gamma": 3, "quant": "file"}
    assert path.read_text().startswith("# a comment\n# second line\n")
    parser = cli.build_parser()
    args = parser.parse_args(expand_config(parser, ["generate", "--prompt", "x", "--config", str(path)]))
    assert (args.drafter, args.gamma, args.quant) == ("ngram", 3, "file")
    args = parser.parse_args(expand_config(parser, ["generate", "--config", str(path), "--gamma", "5",
                                                    "--prompt", "x"]))
    assert args.gamma == 5  # the command line wins
    args = parser.parse_args(expand_config(parser, ["bench", f"--config={path}"]))
    assert args.methods == ["plain", "ngram"] and args.gamma == 3
    assert parser.parse_args(expand_config(parser, ["bench", f"--config={path}", "--gamma", "2"])).gamma == 2
    path.write_text('stop = ["a", "b"]\nmax_batch = 2\n')  # max_batch: serve's, skipped by generate
    args = parser.parse_args(expand_config(parser, ["generate", "--config", str(path), "--prompt", "x"]))
    assert args.stop == ["a", "b"]
    args = parser.parse_args(expand_config(parser, ["generate", "--config", str(path), "--prompt", "x",
                                                    "--stop", "c"]))
    assert args.stop == ["c"]  # the command line's list replaces the file's
    assert parser.parse_args(expand_config(parser, ["serve", "--config", str(path)])).max_batch == 2


@pytest.mark.parametrize("text, message", [("drafter = [\n", "not valid TOML"),
                                           ("temperature_x = 1\n", "'temperature_x' is not an option"),
                                           ("chat = 3\n", "true or false"),
                                           ("drafter = 'bogus'\n", "'drafter' must be one of"),
                                           ("gamma = 'four'\n", "'gamma' must be an integer"),
                                           ("gamma = 4.5\n", "'gamma' must be an integer"),
                                           ("stop = [1]\n", "'stop' must be text")])
def test_bad_config_files(tmp_path, capsys, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert cli.main(["generate", "--config", str(path), "--prompt", "x", "--target", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err
    assert cli.main(["generate", "--config", str(tmp_path / "missing.toml"), "--prompt", "x"]) == 2
    assert cli.main(["generate", "--config", str(path), "--config", str(path), "--prompt", "x"]) == 2
    assert "more than once" in capsys.readouterr().err
    assert cli.main(["doctor", "--config", str(path)]) == 2


def test_tune_writes_a_config_generate_and_serve_honour(tiny_pair, tmp_path, monkeypatch, capsys):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    out = tmp_path / "tuned.toml"
    assert cli.main(["tune", "--target", str(target.source), "--draft", str(draft.source), "--prompts",
                     str(prompts), "--drafter", "ngram", "--drafter", "model", "--max-new-tokens", "12",
                     "--confirm", "1", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "<- chosen" in table and "plain [file]" in table
    settings = read_config(out)
    assert settings["target"] == str(target.source) and settings["drafter"] in ("none", "ngram", "model")
    settings.update(drafter="ngram", gamma=2)  # a drafter that needs no draft model, whatever was chosen
    out.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items() if k != "draft"))
    assert cli.main(["generate", "--config", str(out), "--prompt", "hello world", "--max-new-tokens", "8",
                     "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["new_tokens"] == 8 and max(len(stats["drafted_by_position"]), 0) <= 2  # gamma 2 from the file
    seen = {}

    class Built(Exception):
        pass

    def build_scheduler(target, **kwargs):
        seen.update(kwargs, target=target)
        raise Built

    monkeypatch.setattr("specdecode.serving.scheduler.build_scheduler", build_scheduler)
    with pytest.raises(Built):
        cli.main(["serve", "--config", str(out), "--max-batch", "2"])
    assert (seen["target"], seen["drafter"], seen["gamma"], seen["max_batch"]) == (str(target.source), "ngram", 2, 2)
    assert build_generator  # the module's generator builder stays importable beside the patched scheduler


@pytest.mark.parametrize("argv", [["tune", "--out", "/nonexistent/x.toml"], ["tune", "--max-new-tokens", "0"],
                                  ["tune", "--limit", "-2"],
                                  ["generate", "--prompt", "x", "--html", "/nonexistent/r.html"],
                                  ["bench", "--html", "/nonexistent/r.html"],
                                  ["bench", "--out", "/nonexistent/run"]])
def test_outputs_and_counts_are_checked_before_loading(argv, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing lands in the checkout
    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr("specdecode.builder.load_target", no_load)
    monkeypatch.setattr("specdecode.bench.spec_bench.benchmark", no_load)
    assert cli.main(argv) == 2
    assert "specdecode: error:" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before creating anything

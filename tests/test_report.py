"""The HTML report (tools/report.py): its token spans agree with the statistics, model text is escaped, headless
Chromium renders it, and `generate --html` / `bench --html` write it."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser

import pytest

from specdecode import cli
from specdecode.builder import build_generator
from specdecode.tools.report import generation_html, token_texts, write_html

from .conftest import tiny_tokenizer


class Page(HTMLParser):
    """The classes of the token spans, the text of the prompt and of the output, and the page's <script> tags."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.kinds: list[str] = []
        self.titles: list[str] = []
        self.scripts = 0
        self.texts: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.scripts += tag == "script"
        if tag == "span" and (a.get("class") or "").startswith("tok "):
            self.kinds.append(a["class"].split()[1])
            self.titles.append(a["title"])

    def handle_data(self, data):
        self.texts.append(data)


def _page(gen, tokenizer, prompt: str, **request) -> tuple:
    result = gen.generate(prompt, trace=True, **request)
    return result, Page(generation_html(result, tokenizer, title="t", prompt=prompt, info={"drafter": "x"}))


@pytest.mark.parametrize("drafter, request_", [("model", {}), ("model", {"temperature": 1.0, "seed": 7}),
                                               ("ngram-tree", {})])
def test_token_spans_match_the_statistics(tiny_pair, drafter, request_):
    target, draft = tiny_pair
    # a fixed draft length: the same steps every run (a chosen one follows the measured costs)
    gen = build_generator(target, draft=draft if drafter == "model" else None, drafter=drafter, gamma=3)
    result, page = _page(gen, target.tokenizer, "quick brown fox", max_new_tokens=60, **request_)
    s, trace = result.stats, result.trace
    kinds = Counter(page.kinds)
    assert len(page.kinds) == len(result.token_ids) == s.new_tokens
    assert page.kinds == [t.kind for t in trace.tokens]
    assert kinds["accepted"] == s.accepted_tokens > 0 and kinds["corrected"] > 0 and kinds["bonus"] > 0
    # every step ends in one token of the target's, but a last step cut short (max tokens, a stop) ends in a draft's
    target_made = kinds["corrected"] + kinds["bonus"] + kinds["target"]
    cut = trace.tokens[-1].kind == "accepted"
    assert target_made == s.target_forward_passes - cut == len(trace.steps) - cut
    assert kinds["bonus"] + kinds["corrected"] == s.drafts - cut
    assert kinds["target"] == s.target_forward_passes - s.drafts
    assert all(t.startswith(f"step {tt.step + 1}, {tt.kind}\n") for t, tt in zip(page.titles, trace.tokens))
    if "temperature" in request_:  # the draft model's probabilities where it sampled
        assert any("q 0." in t for t, k in zip(page.titles, page.kinds) if k == "accepted")
    else:  # greedy and deterministic drafters give none
        assert all("q —" in t for t in page.titles)
    assert all("\nrejected '" in t for t, k in zip(page.titles, page.kinds) if k == "corrected")


def test_model_text_is_escaped(tiny_pair):
    target, draft = tiny_pair
    prompt = 'x <script>alert("&amp;")</script> & \'q\' "d"'
    gen = build_generator(target, draft=draft, drafter="model")
    result = gen.generate(prompt, max_new_tokens=10, trace=True)
    page = generation_html(result, target.tokenizer, title="<b>t</b>", prompt=prompt, info={"<i>": "&"})
    assert "<script>" not in page and "<b>t" not in page and "<i>" not in page
    parsed = Page(page)
    assert parsed.scripts == 0 and prompt in parsed.texts  # the prompt reads back exactly
    assert "&lt;i&gt;" in page and "&quot;d&quot;" in page and "&amp;amp;" in page


def test_token_texts_keep_multibyte_characters_whole():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("ab c.")
    assert "".join(token_texts(ids, tokenizer)) == "ab c."

    class Bytes:  # one token per UTF-8 byte, as a byte-level tokenizer splits an unknown character
        def decode(self, ids, **kwargs):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("aé€b".encode())
    texts = token_texts(ids, Bytes())
    assert "".join(texts) == "aé€b" and texts.count("") == 3 and "€" in texts


def test_generate_html(pair_dirs, tmp_path, capsys):
    target, draft = pair_dirs
    path = tmp_path / "r.html"
    assert cli.main(["generate", "--target", target, "--draft", draft, "--prompt", "hello", "--max-new-tokens", "20",
                     "--html", str(path)]) == 0
    assert f"report written to {path}" in capsys.readouterr().err
    page = Page(path.read_text())
    assert len(page.kinds) == 20 and "drafter: " in page.texts


def test_bench_html(pair_dirs, tmp_path):
    target, draft = pair_dirs
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"Tell {c} {i}."]})
                               for i, c in enumerate(["qa", "rag"])))
    out, path = tmp_path / "out", tmp_path / "bench.html"
    assert cli.main(["bench", "--target", target, "--draft", draft, "--dtype", "float32", "--quant", "none",
                     "--methods", "ngram", "model", "--questions", str(qfile), "--per-category", "1",
                     "--max-new-tokens", "12", "--out", str(out), "--html", str(path)]) == 0
    page = path.read_text()
    assert page.count('src="data:image/png;base64,') == len(list(out.glob("*.png"))) == 3
    assert all(f"<div><h3>{m}</h3><svg" in page for m in ("ngram", "model")) and "<h3>plain</h3>" not in page
    assert "<th>#mean accepted tokens</th>" in page


@pytest.mark.skipif(platform.system() != "Linux", reason="the rendering test runs Debian's headless Chromium (Linux)")
def test_chromium_renders_the_page(tiny_pair, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: `apt-get install chromium` (.ci/run installs it)"
    target, draft = tiny_pair
    gen = build_generator(target, draft=draft, drafter="model")
    result = gen.generate("the cat sat on the mat", max_new_tokens=80, temperature=1.0, seed=1, trace=True)
    html_path, png = tmp_path / "r.html", tmp_path / "r.png"
    write_html(html_path, generation_html(result, target.tokenizer, title="render", prompt="p", info={}))
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={png}",
                    "--window-size=1200,1600", html_path.as_uri()], check=True, timeout=120, capture_output=True)
    assert png.stat().st_size > 1000
    from PIL import Image
    import numpy as np

    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.float32)
    assert pixels.shape[:2] == (1600, 1200) and pixels.std() > 10  # not one flat colour
    assert len({tuple(p) for p in pixels.reshape(-1, 3)[::97]}) > 20  # text, the token colours and the charts

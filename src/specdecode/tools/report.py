"""A self-contained HTML page of what speculation did: for one request (`generate --html`), every token coloured by
where it came from, acceptance by draft position and each step's drafting and verifying time; for a Spec-Bench run
(`bench --html`), its table, plots and acceptance by position per method. Inline CSS and SVG, no script, no network."""

from __future__ import annotations

import base64
import html
import os
from collections import Counter
from itertools import zip_longest
from pathlib import Path

from specdecode.bench.spec_bench import markdown_table
from specdecode.detokenize import INCOMPLETE
from specdecode.errors import InvalidRequestError
from specdecode.sequence import GenerationResult
from specdecode.trace import KINDS, StepTrace, TokenTrace

EXPLAIN = {"accepted": "drafted, kept by the target", "corrected": "the target's, replacing a rejected draft token",
           "bonus": "the target's, after a draft kept whole", "target": "the target's, in a step that drafted nothing"}
DRAFT, VERIFY = "#e8923a", "#3f6fb5"  # the timeline's colours

CSS = """
body { font: 15px/1.5 system-ui, sans-serif; color: #222; max-width: 1100px; margin: 24px auto; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.chips span { display: inline-block; background: #f1f3f5; border-radius: 4px; padding: 1px 8px; margin: 3px 4px 0 0; }
.text { white-space: pre-wrap; font: 15px/1.9 ui-monospace, monospace; border: 1px solid #ddd; border-radius: 6px;
        padding: 12px; word-break: break-word; }
.tok { border-radius: 2px; box-shadow: inset -1px 0 #fff; } .tok:hover { outline: 2px solid #222; }
.accepted { background: #b9e7c4; } .corrected { background: #f6b2ac; }
.bonus { background: #b8d3f7; } .target { background: #e4e4e4; }
.key { padding: 1px 8px; border-radius: 3px; margin-right: 4px; font-size: 13px; white-space: nowrap; }
.methods { display: flex; flex-wrap: wrap; gap: 8px 40px; } h3 { font-size: 15px; margin: 12px 0 4px; }
.legend { margin: 6px 0; font-size: 13px; color: #555; } .legend > span { margin-right: 16px; }
.swatch { display: inline-block; width: 12px; height: 12px; vertical-align: -1px; margin-right: 4px; }
.scroll { max-height: 480px; overflow-y: auto; border: 1px solid #ddd; border-radius: 6px; }
pre { white-space: pre-wrap; background: #f7f7f7; padding: 10px; border-radius: 6px; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #ddd; padding: 3px 8px; }
td:not(:first-child) { text-align: right; } th { background: #f1f3f5; }
img { max-width: 100%; margin: 8px 0; } svg text { font: 11px system-ui, sans-serif; fill: #333; }
"""


def write_html(path: Path, page: str) -> None:
    try:
        Path(path).write_text(page, encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(f"cannot write the report {path}: {exc.strerror}") from exc


def token_texts(ids: list[int], tokenizer) -> list[str]:
    """Each token's share of the decoded text: what it adds to the decode of the tokens before it. A token that ends
    midway through a character adds nothing; the token that completes it carries the whole character."""
    if tokenizer is None:
        return [f"⟨{i}⟩" for i in ids]
    texts, shown = [], ""
    for i in range(len(ids)):
        full = tokenizer.decode(ids[:i + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if full.endswith(INCOMPLETE) and i + 1 < len(ids):
            texts.append("")
            continue
        texts.append(full[len(os.path.commonprefix([shown, full])):])
        shown = full
    return texts


def generation_html(result: GenerationResult, tokenizer, *, title: str, prompt: str, info: dict) -> str:
    """The page of one request made with trace=True."""
    trace, s = result.trace, result.stats
    assert trace is not None, "the request was made without trace=True"
    texts = token_texts(result.token_ids, tokenizer)
    spans = "".join(f'<span class="tok {t.kind}" title="{_esc(_hover(t, tokenizer))}">{_esc(text)}</span>'
                    for t, text in zip(trace.tokens, texts))
    summary = {"tokens": s.new_tokens, "tok/s": f"{s.tokens_per_second:.2f}",
               "target passes": s.target_forward_passes, "mean accepted length": f"{s.mean_accepted_length:.2f}",
               "acceptance": f"{s.acceptance_rate:.1%}",
               "draft / verify": f"{s.draft_seconds:.3f} s / {s.verify_seconds:.3f} s", **info}
    counts = Counter(t.kind for t in trace.tokens)
    legend = "".join(f'<span><span class="key {k}">{k} {counts[k]}</span>{EXPLAIN[k]}</span>' for k in KINDS)
    body = (f"<h1>{_esc(title)}</h1>{_chips(summary)}"
            f"<details><summary>Prompt ({len(prompt)} characters)</summary><pre>{_esc(prompt)}</pre></details>"
            f"<h2>Output</h2><div class=legend>{legend} (hover a token for its step and probabilities)</div>"
            f'<div class="text">{spans}</div>'
            f"<h2>Acceptance by draft position</h2>{acceptance_svg(s.acceptance_by_position, s.drafted_by_position)}"
            f"<h2>Drafting and verifying, step by step</h2>{timeline_svg(trace.steps)}")
    return _page(title, body)


def bench_html(summary: dict, rows: list[dict], out_dir: Path, *, title: str = "Spec-Bench") -> str:
    """The page of a Spec-Bench run: `summary` as `spec_bench.report` returns it, the rows it summarizes and the
    folder holding its plots."""
    machine, config = summary.get("machine", {}), summary.get("config", {})
    chips = {k: machine[k] for k in ("cpu", "capability", "threads", "torch", "date") if k in machine}
    chips |= {k: config[k] for k in ("target", "draft", "dtype", "quant", "max_new_tokens", "temperature", "repeats")
              if k in config}
    drafted = {m: [sum(c) for c in zip_longest(*(r.get("drafted_by_position", []) for r in rows if r["method"] == m),
                                               fillvalue=0)] for m in summary["methods"]}
    per_method = "".join(f"<div><h3>{_esc(m)}</h3>{acceptance_svg(s['acceptance_by_position'], drafted[m])}</div>"
                         for m, s in summary["methods"].items() if s["acceptance_by_position"])
    written = sorted(Path(out_dir).glob("*.png"), key=lambda p: (p.stat().st_mtime_ns, p.name))  # as write_plots
    plots = "".join(_png(p) for p in written)
    body = (f"<h1>{_esc(title)}</h1>{_chips(chips)}<h2>Results</h2>{_table(markdown_table(summary))}"
            f"<h2>Plots</h2>{plots}<h2>Acceptance by draft position</h2>"
            f"<div class=methods>{per_method or '<p>Nothing was drafted.</p>'}</div>")
    return _page(title, body)


def acceptance_svg(rates: list[float], drafted: list[int]) -> str:
    """A bar per draft position: the share of drafts reaching it whose token there was accepted, and how many."""
    if not rates:
        return "<p>Nothing was drafted.</p>"
    col, h, top, left = 56, 150, 20, 40
    parts = [f'<line x1="{left}" x2="{left + col * len(rates)}" y1="{top + h * (1 - f)}" y2="{top + h * (1 - f)}" '
             f'stroke="#ddd"/><text x="{left - 6}" y="{top + h * (1 - f) + 4}" text-anchor="end">{f:.0%}</text>'
             for f in (0, 0.5, 1)]
    for i, (rate, n) in enumerate(zip(rates, drafted)):
        x, y = left + i * col + 8, top + h * (1 - rate)
        parts.append(f'<rect x="{x}" y="{y}" width="{col - 16}" height="{h * rate}" fill="#57a86b"/>'
                     f'<text x="{x + col / 2 - 8}" y="{y - 5}" text-anchor="middle">{rate:.0%}</text>'
                     f'<text x="{x + col / 2 - 8}" y="{top + h + 15}" text-anchor="middle">{i + 1}</text>'
                     f'<text x="{x + col / 2 - 8}" y="{top + h + 29}" text-anchor="middle" fill="#777">n={n}</text>')
    return (f'<svg width="{left + col * len(rates) + 10}" height="{top + h + 36}" role="img">{"".join(parts)}</svg>'
            '<div class=legend>draft position (bottom: how many drafts reached it)</div>')


def timeline_svg(steps: list[StepTrace]) -> str:
    """A bar per step: its drafting then its verifying, to one scale; accepted / drafted tokens beside it."""
    if not steps:
        return "<p>No decode step.</p>"
    longest = max(s.draft_seconds + s.verify_seconds for s in steps) or 1.0
    row, left, width = 16, 48, 860
    scale = width / longest
    parts = []
    for i, s in enumerate(steps):
        y, d, v = i * row, s.draft_seconds * scale, s.verify_seconds * scale
        hover = (f"step {i + 1}: drafted {s.drafted} (depth {s.depth}), accepted {s.accepted}; draft "
                 f"{1e3 * s.draft_seconds:.2f} ms, verify {1e3 * s.verify_seconds:.2f} ms")
        parts.append(f'<g><title>{hover}</title><text x="{left - 6}" y="{y + 12}" text-anchor="end">{i + 1}</text>'
                     f'<rect x="{left}" y="{y + 2}" width="{d:.1f}" height="{row - 4}" fill="{DRAFT}"/>'
                     f'<rect x="{left + d:.1f}" y="{y + 2}" width="{v:.1f}" height="{row - 4}" fill="{VERIFY}"/>'
                     f'<text x="{left + d + v + 6:.1f}" y="{y + 12}">{s.accepted}/{s.drafted}</text></g>')
    keys = (f'<span><span class="swatch" style="background:{DRAFT}"></span>drafting</span>'
            f'<span><span class="swatch" style="background:{VERIFY}"></span>verifying</span>'
            f"<span>beside each bar: tokens accepted / drafted; the longest step took {1e3 * longest:.2f} ms</span>")
    return (f"<div class=legend>{keys}</div><div class=scroll>"
            f'<svg width="{left + width + 60}" height="{row * len(steps)}" role="img">{"".join(parts)}</svg></div>')


def _hover(t: TokenTrace, tokenizer) -> str:
    lines = [f"step {t.step + 1}, {t.kind}", f"p {t.p:.4f}, q {_prob(t.q)}"]
    if t.rejected is not None:
        text = token_texts([t.rejected], tokenizer)[0]
        lines.append(f"rejected {text!r}: p {_prob(t.rejected_p)}, q {_prob(t.rejected_q)}")
    return "\n".join(lines)


def _prob(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _chips(items: dict) -> str:
    return "<div class=chips>" + "".join(f"<span>{_esc(str(k))}: <b>{_esc(str(v))}</b></span>"
                                         for k, v in items.items()) + "</div>"


def _png(path: Path) -> str:
    return f'<img alt="{_esc(path.stem)}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'


def _table(markdown: str) -> str:
    """`markdown_table`'s table as HTML, the lines after it as paragraphs."""
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("|")]
    head, body = rows[0], rows[2:]  # rows[1] is the |---| line
    cells = "".join("<tr>" + "".join(f"<td>{_esc(c.strip())}</td>" for c in r) + "</tr>" for r in body)
    notes = "".join(f"<p>{_esc(line)}</p>" for line in markdown.splitlines() if line and not line.startswith("|"))
    return ("<table><tr>" + "".join(f"<th>{_esc(c.strip())}</th>" for c in head) + f"</tr>{cells}</table>{notes}")


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
            f"<style>{CSS}</style></head><body>{body}</body></html>\n")

"""PNG plots of a Spec-Bench run: speedup by category, acceptance by draft position, tokens/s per prompt."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def write_plots(rows: list[dict], summary: dict, out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = summary["methods"]
    names = list(methods)
    cats = sorted({c for s in methods.values() for c in s["categories"]})
    paths = []

    fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.9), 4.5))
    width = 0.8 / len(names)
    for i, m in enumerate(names):
        ys = [methods[m]["categories"].get(c, {}).get("speedup", 0.0) for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], ys, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup vs plain (tokens/s ratio)")
    ax.set_title(f"Speedup by category — {title}")
    ax.legend(fontsize=8, ncol=2)
    paths.append(_save(fig, out / "speedup_by_category.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in names:
        acc = methods[m]["acceptance_by_position"]
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=m)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"Acceptance by draft position — {title}")
    if ax.lines:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "acceptance_by_position.png"))

    per_prompt: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["seconds"] > 0:
            per_prompt[r["method"]].append(r["new_tokens"] / r["seconds"])
    fig, ax = plt.subplots(figsize=(max(7, len(names) * 1.1), 4.5))
    ax.boxplot([per_prompt[m] for m in names], tick_labels=names)
    ax.tick_params(axis="x", rotation=30)
    ax.set_ylabel("tokens/s per prompt")
    ax.set_title(f"Tokens/s distribution — {title}")
    paths.append(_save(fig, out / "tokens_per_second.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

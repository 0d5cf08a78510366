"""The user's prompts for `verify` and `tune`: Spec-Bench's, a JSON-lines file or a text file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import InvalidRequestError

SPEC_BENCH = "spec-bench"


@dataclass(frozen=True)
class Prompt:
    name: str  # where it came from: "spec-bench 81 (coding)", "prompts.jsonl:3"
    content: str | list[dict]  # a text, or chat messages [{"role", "content"}]
    chat: bool  # wrap a text in the chat template


def load_prompts(source: str, limit: int | None = None, chat: bool = False) -> list[Prompt]:
    """`spec-bench` (its first turns, round robin over the categories, as chat), or a file: `.jsonl` with one
    object per line ({"prompt": text}, {"messages": [...]} or Spec-Bench's {"turns": [...]}, whose first turn is
    taken), else text with one prompt per line (blank lines skipped). `chat` wraps text prompts of a file in the
    model's chat template. limit: the first N."""
    if limit is not None and limit < 0:
        raise InvalidRequestError(f"--limit must be >= 0 (0: every prompt), got {limit}")
    if source == SPEC_BENCH:
        from specdecode.bench.spec_bench import load_questions

        prompts = [Prompt(f"spec-bench {q.question_id} ({q.category})", q.prompt, True) for q in load_questions()]
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            raise InvalidRequestError(f"{source} is a folder; name a prompts file (or {SPEC_BENCH!r})")
        if not path.is_file():
            raise InvalidRequestError(f"no prompts file at {source} (or name {SPEC_BENCH!r})")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"cannot read the prompts file {source}: {exc}") from exc
        lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
        if path.suffix == ".jsonl":
            prompts = [_json_prompt(f"{source}:{i}", line, chat) for i, line in lines]
        else:
            prompts = [Prompt(f"{source}:{i}", line, chat) for i, line in lines]
    if not prompts:
        raise InvalidRequestError(f"{source} holds no prompts")
    return prompts[:limit] if limit else prompts


def _json_prompt(name: str, line: str, chat: bool) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{name}: not JSON ({exc.msg})") from None
    if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
        messages = row["messages"]
        if all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in messages):
            return Prompt(name, messages, True)
        raise InvalidRequestError(f"{name}: each message needs a string role and content")
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"]:
        return Prompt(name, row["prompt"], chat)
    if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"] and \
            isinstance(row["turns"][0], str):
        return Prompt(name, row["turns"][0], True)
    raise InvalidRequestError(f"{name}: expected an object with \"prompt\" (text), \"messages\" (chat) or "
                              "\"turns\" (Spec-Bench)")

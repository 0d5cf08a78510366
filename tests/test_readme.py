"""The README's commands and examples do not rot: every command parses, the library example runs (on tiny models
here, on the real pair with -m slow), the server example's request is accepted, and CI runs the test command."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import httpx
import pytest

from specdecode import cli
from specdecode.bench.methods import parse_methods
from specdecode.builder import check_drafting
from specdecode.models.catalog import DEFAULT_TARGET
from tests.conftest import AUTH, CHAT, save_tiny, tiny_hf_model, tiny_tokenizer

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def shell_commands() -> list[str]:
    """Each command of the README's bash blocks, continuation lines joined and `&&` chains split."""
    commands = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            commands += [part.strip() for part in line.split("#")[0].split("&&") if part.strip()]
    return commands


def specdecode_argvs() -> list[list[str]]:
    return [shlex.split(c)[1:] for c in shell_commands()
            if c.split()[0] in ("specdecode", ".venv/bin/specdecode")]


def test_every_readme_command_parses():
    argvs = specdecode_argvs()
    assert {argv[0] for argv in argvs} >= {"generate", "bench", "serve"}
    parser = cli.build_parser()
    for argv in argvs:
        args = parser.parse_args(argv)  # exits (fails the test) on an unknown option or value
        if argv[0] == "bench":
            parse_methods(args.methods, args.dtype, args.quant)
        if hasattr(args, "drafter"):
            check_drafting(args.drafter, args.gamma)


def test_every_command_in_the_commands_table_exists():
    named = set(re.findall(r"^\| `specdecode ([a-z-]+)", README, flags=re.M))
    sub = next(a for a in cli.build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert len(named) >= 8 and named <= set(sub.choices)


def test_ci_runs_the_readmes_test_command():
    test_command = next(c for c in shell_commands() if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def _tiny_named_models(tmp_path: Path) -> dict[str, str]:
    """Tiny stand-ins (with a chat template) for the README's catalog names."""
    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    target = save_tiny(tmp_path / "target", tiny_hf_model("qwen2", seed=0), tok)
    draft = save_tiny(tmp_path / "draft", tiny_hf_model("qwen2", seed=1), tok)
    return {"qwen2.5-coder-1.5b-instruct": str(target), "qwen2.5-coder-0.5b-instruct": str(draft)}


def _run_library_example(names: dict[str, str], capsys) -> str:
    [code] = code_blocks("python")
    for name, path in names.items():
        code = code.replace(f'"{name}"', repr(path))
    exec(compile(code, "README.md", "exec"), {})
    return capsys.readouterr().out


def test_the_library_example_runs(tmp_path, capsys):
    out = _run_library_example(_tiny_named_models(tmp_path), capsys)
    assert "'new_tokens': " in out  # the stats dict, printed after the text


@pytest.mark.slow
def test_the_library_example_runs_on_the_real_pair(capsys):
    out = _run_library_example({}, capsys)
    assert "'new_tokens': " in out


def test_the_server_examples_request_is_accepted(server):
    curl = next(b for b in code_blocks("bash") if b.startswith("curl"))
    argv = shlex.split(curl)
    path = re.sub(r"^https?://[^/]+", "", argv[argv.index("-s") + 1])
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == DEFAULT_TARGET  # what `serve` names its default target
    body["model"] = "tiny"  # the fixture's
    reply = httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] is not None

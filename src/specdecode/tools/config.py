"""Config files (TOML): `specdecode tune` writes one, `generate`, `serve` and `bench` read it with `--config FILE`.

A config file's top-level keys are those commands' options, spelled as their destinations (`drafter`, `gamma`,
`quant`, `max_batch`, ...); `--config FILE` stands for those options, placed before the command line's own, so a
flag given on the command line wins. bench turns `drafter` (and `gamma`) into its methods: plain and that drafter.
A table (such as tune's `[tune]` record of what it measured) is read by nobody.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import tomli_w

from specdecode.errors import InvalidRequestError

COMMANDS = ("generate", "serve", "bench")


def read_config(path: Path) -> dict:
    """The settings of a config file (its top-level keys; tables skipped)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the config file {path}: {exc.strerror}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the config file {path} is not valid TOML: {exc}") from exc
    return {k: v for k, v in data.items() if not isinstance(v, dict)}


def write_config(path: Path, settings: dict, record: dict, comment: str) -> None:
    """settings: the options (top level); record: what they were chosen from (the [tune] table); comment: the
    file's first lines."""
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    path.write_text(head + tomli_w.dumps({k: v for k, v in settings.items() if v is not None} | {"tune": record}),
                    encoding="utf-8")


def expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with `--config FILE` replaced by the file's options, put right after the command name."""
    at = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
    if at is None:
        return argv
    if not argv or argv[0] not in COMMANDS:
        raise InvalidRequestError(f"--config is read by {', '.join(COMMANDS)}, given as that command's option")
    if argv[at] == "--config":
        if at + 1 >= len(argv):
            raise InvalidRequestError("--config needs a file")
        path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    else:
        path, rest = argv[at].partition("=")[2], argv[:at] + argv[at + 1:]
    settings = read_config(Path(path).expanduser())
    return rest[:1] + as_flags(_subparser(parser, argv[0]), argv[0], settings, path) + rest[1:]


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def as_flags(parser: argparse.ArgumentParser, command: str, settings: dict, source: str) -> list[str]:
    """The command-line flags that set `settings` on `parser` (a command's)."""
    settings = dict(settings)
    if command == "bench" and "drafter" in settings:
        drafter, gamma = settings.pop("drafter"), settings.pop("gamma", None)
        settings["methods"] = ["plain"] + ([] if drafter == "none" else [f"{drafter}:g{gamma}" if gamma else drafter])
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    flags: list[str] = []
    for key, value in settings.items():
        action = actions.get(key.replace("-", "_"))
        if action is None or key in ("config", "help"):
            raise InvalidRequestError(f"{source}: {key!r} is not an option of `specdecode {command}`")
        option = action.option_strings[-1]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{source}: {key!r} is true or false, got {value!r}")
            flags += [option] if value == isinstance(action, argparse._StoreTrueAction) else []
        elif isinstance(value, list):
            flags += [option, *map(str, value)] if action.nargs in ("+", "*") else \
                [x for v in value for x in (option, str(v))]
        elif isinstance(value, (dict, bool)):
            raise InvalidRequestError(f"{source}: {key!r} takes a value, got {value!r}")
        else:
            flags += [option, str(value)]
    return flags

"""Config files (TOML): `specdecode tune` writes one, `generate`, `serve` and `bench` read it with `--config FILE`.

A config file's top-level keys are those commands' options, spelled as their destinations (`drafter`, `gamma`,
`quant`, `max_batch`, ...); `--config FILE` stands for those options, and an option given on the command line
replaces the file's. A key that only another of the three commands takes is skipped (one file serves all three);
bench turns `drafter` into its methods: plain and that drafter. A table (such as tune's `[tune]` record of what it
measured) is read by nobody.
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
    text = head + tomli_w.dumps({k: v for k, v in settings.items() if v is not None} | {"tune": record})
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(f"cannot write the config file {path}: {exc.strerror}") from exc


def expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with `--config FILE` replaced by the file's options that the command line does not give."""
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    if not argv or argv[0] not in COMMANDS:
        raise InvalidRequestError(f"--config is an option of {', '.join(COMMANDS[:-1])} and {COMMANDS[-1]} only")
    if len(at) > 1:
        raise InvalidRequestError("--config is given more than once; merge the files into one")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            raise InvalidRequestError("--config needs a file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1:]
    settings = read_config(Path(path).expanduser())
    parsers = {c: _subparser(parser, c) for c in COMMANDS}
    return rest[:1] + as_flags(parsers, argv[0], settings, path, given=rest[1:]) + rest[1:]


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("config", "help")}


def as_flags(parsers: dict[str, argparse.ArgumentParser], command: str, settings: dict, source: str,
             given: list[str] | None = None) -> list[str]:
    """The command-line flags that set `settings` for `command` (parsers: each config-reading command's), less the
    options `given` on the command line."""
    settings = {k.replace("-", "_"): v for k, v in settings.items()}
    if command == "bench" and "drafter" in settings:
        drafter = settings.pop("drafter")
        settings["methods"] = ["plain"] + ([] if drafter == "none" else [str(drafter)])
    actions = _options(parsers[command])
    elsewhere = {dest for c, p in parsers.items() if c != command for dest in _options(p)}
    flags: list[str] = []
    for key, value in settings.items():
        action = actions.get(key)
        if action is None:
            if key in elsewhere:
                continue  # another command's option
            raise InvalidRequestError(f"{source}: {key!r} is not an option of `specdecode {command}` (nor of "
                                      f"{', '.join(c for c in COMMANDS if c != command)})")
        if any(g == o or g.startswith(o + "=") for g in given or () for o in action.option_strings):
            continue  # the command line's
        flags += _flags(action, key, value, source)
    return flags


def _flags(action: argparse.Action, key: str, value: object, source: str) -> list[str]:
    option = action.option_strings[-1]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{source}: {key!r} is true or false, got {value!r}")
        return [option] if value == isinstance(action, argparse._StoreTrueAction) else []
    many = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    values = value if isinstance(value, list) and many else [value]
    for v in values:
        _check(action, key, v, source)
    if action.nargs in ("+", "*"):
        return [option, *map(str, values)]
    return [x for v in values for x in (option, str(v))]


def _check(action: argparse.Action, key: str, value: object, source: str) -> None:
    """A value of the option's type and among its choices, else an error naming the file and the key."""
    kind = action.type if isinstance(action.type, type) else str
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is Path:
        kind = str
    if not isinstance(value, kind) or isinstance(value, bool):
        name = {int: "an integer", float: "a number", str: "text"}.get(kind, kind.__name__)
        raise InvalidRequestError(f"{source}: {key!r} must be {name}, got {value!r}")
    if action.choices is not None and value not in action.choices:
        raise InvalidRequestError(f"{source}: {key!r} must be one of {', '.join(map(str, action.choices))}, "
                                  f"got {value!r}")

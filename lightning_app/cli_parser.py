"""The command line's parser: no abbreviated options, and a parse error in a few lines instead of a usage dump.

`--trainer.max_epoch 3` is not taken for `--trainer.max_epochs`: a config that relies on a prefix
match breaks the day another option shares the prefix (argparse's `allow_abbrev`, off here; the
subcommand parsers inherit it in jsonargparse/_subcommands.py). A mistyped option prints

    error: unrecognized arguments: --trainer.max_epoks 3
      did you mean --trainer.max_epochs?
      every option: python main.py fit --help

instead of jsonargparse's 80-line usage text (jsonargparse/_core.py, ArgumentParser.error).
"""
from __future__ import annotations

import difflib
import inspect
import re
import sys

from pytorch_lightning.cli import LightningArgumentParser

from lightning_app import parse_errors

MAX_DETAIL_LINES = 2
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_DOES_NOT_ACCEPT = re.compile(r"does not accept option '([^']+)'")
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def data_option_names() -> list[str]:
    """--data.X for every init arg of the DataModules users pick with --data (subclass mode lists none)."""
    import datamodules

    names: set[str] = set()
    for cls_name in ("ImageDataModule", "ImageFolderDataModule", "LMDBDataModule", "DownscaledDataModule",
                     "DALIDataModule", "StreamingDataModule"):
        try:
            params = inspect.signature(getattr(datamodules, cls_name).__init__).parameters
        except Exception:  # noqa: BLE001 - an optional backend that cannot import offers no names
            params = {}
        names |= {f"--data.{p}" for p in params if p not in ("self", "kwargs")}
    return sorted(names)


def option_names(parser) -> list[str]:
    names = {s for s in getattr(parser, "_option_string_actions", {}) if s.startswith("--") and not s.endswith(".help")}
    return sorted(names | set(data_option_names()))


# names other tools give the same settings: a spelling distance would not find these (model.learning_rate is
# nearer to model.weights than to model.lr)
ALIASES = {"learning_rate": "lr", "wd": "weight_decay", "bs": "batch_size", "epochs": "max_epochs",
           "workers": "num_workers", "img_size": "image_size", "model": "arch"}


def closest(option: str, names: list[str]) -> str | None:
    """The valid option nearest to a mistyped one (a known alias, else difflib's ratio), or None when nothing is
    close."""
    key = option.split("=", 1)[0]
    group, _, leaf = key.rpartition(".")
    if leaf in ALIASES and f"{group}.{ALIASES[leaf]}" in names:
        return f"{group}.{ALIASES[leaf]}"
    same_group = [n for n in names if n.rsplit(".", 1)[0] == key.rsplit(".", 1)[0]]
    for pool in (same_group, names):
        match = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
        if match:
            return match[0]
    return None


def _rejected_key(message: str) -> str | None:
    """The dotted key of an option jsonargparse does not accept, or None."""
    whole = _DOES_NOT_ACCEPT.search(message)
    if whole:
        return whole.group(1)
    rejected, key = _NOT_ACCEPTED.search(message), _PARSER_KEY.search(message)
    return f"{key.group(1)}.{rejected.group(1)}" if rejected and key else None


def short_error(message: str, parser, args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """At most four lines: the error, where useful the closest valid option, and where --help lists them all.
    `args` (the command line) tells which config files were read and whether a value came from one."""
    subcommand = parser.prog.replace(" [options]", "").split()[1:]  # prog is "<argv[0]> [options] fit"
    every_option = f"  every option: python {' '.join(['main.py', *subcommand])} --help"
    missing = parse_errors.missing_config(args)
    if missing:
        return [f"error: {missing}"]
    files = parse_errors.config_files(args, getattr(parser, "default_config_files", None) or ())
    broken = parse_errors.yaml_problem(files)
    if broken:
        return [f"error: {broken}"]
    known = {n[2:] for n in option_names(parser)}
    rejected = _rejected_key(message)
    from_a_file = rejected is not None and not any(a == f"--{rejected}" or a.startswith(f"--{rejected}=") for a in args)
    unknown = parse_errors.unknown_keys_paragraph(files, known) if files else None
    key = parse_errors.setting_key(message) if rejected is None else None  # an unknown key is no bad value
    value = parse_errors.value_paragraph(message, lambda k: parse_errors.source(k, args, files)) if key else None
    if value or (unknown and from_a_file):
        return [f"error: {' '.join(p for p in (value, unknown) if p)}", every_option]
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    unknown: list[str] = []
    if lines and lines[0].startswith("unrecognized arguments:"):
        unknown = [a for a in lines[0].split(":", 1)[1].split() if a.startswith("--")]
        out = [f"error: {lines[0]}"]
    else:
        rejected = _NOT_ACCEPTED.search(message)
        key = _PARSER_KEY.search(message)
        if rejected and key:
            unknown = [f"--{key.group(1)}.{rejected.group(1)}"]
            where = parse_errors.source(unknown[0][2:], args, files)
            out = [f"error: unrecognized argument: {unknown[0]}" if where == "on the command line" else
                   f"error: unknown key {unknown[0][2:]} {where}"]
        else:
            detail = [line for line in lines[1:] if not line.startswith(("Subtypes:", "Errors:", "Given value type"))]
            head = lines[0] if lines else "invalid arguments"
            out = [f"error: {head}" + (f" {detail[0]}" if head.endswith(":") and detail else "")]
    suggestions = [f"{u.split('=', 1)[0]} -> {m}" if len(unknown) > 1 else m
                   for u in unknown[:MAX_DETAIL_LINES]
                   if (m := closest(u, option_names(parser) + parse_errors.init_arg_options(message)))]
    choice = _INVALID_CHOICE.search(message)
    if choice:  # a mistyped subcommand (or any other choice)
        suggestions += difflib.get_close_matches(choice.group(1), re.findall(r"'([^']+)'", choice.group(2)), n=1)
    if suggestions:
        out.append(f"  did you mean {', '.join(suggestions)}?")
    out.append(every_option)
    return out


class ClassifierArgumentParser(LightningArgumentParser):
    """LightningCLI's parser without abbreviations, with short parse errors."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)  # raises: a caller that parses for itself gets the exception
        parser = getattr(ex, "subcommand_parser", None) or self
        try:
            text = "\n".join(short_error(message, parser, list(getattr(self, "args", None) or sys.argv[1:]))) + "\n"
        except Exception:  # noqa: BLE001 - never lose the error itself to a bug in the summary
            text = f"error: {message}\n"
        self._logger.error(message)
        sys.stderr.write(text)
        sys.stderr.flush()
        raise SystemExit(2)

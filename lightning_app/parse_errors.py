"""jsonargparse's parse errors as one paragraph: the setting, the value given, what the setting takes, the nearest
choice, and the config file that set it.

jsonargparse reports a bad value of a `class_path` section (`--data.decode GPU`) as
`Parser key "data": Does not validate against any of the Union subtypes`, with the real reason nested below
(jsonargparse/_typehints.py, adapt_typehints). Its full message holds everything: the inner key, each type the
setting takes (`Expected a typing.Literal['cpu', 'gpu']. Got value: GPU`) and the value. This module reads it
back. A config file's unknown keys and YAML syntax are checked here too, file by file, since jsonargparse names
only the first unknown key and neither the file nor, for YAML, anything but "<unicode string>".
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import yaml

_KEY = re.compile(r'^(\s*)(?:- )?Parser key "([^"]+)":')
_EXPECTED = re.compile(r"Expected a (.+?)(?:\. Got value: (.*))?$")
_GIVEN = re.compile(r"^\s*Given value: (.*)$")
_CLASS = re.compile(r"Expected a dot import path string: (\S+)")
_TYPE_WORDS = {"int": "an integer", "float": "a number", "NoneType": "null", "bool": "true or false",
               "str": "a string", "dict": "a mapping ({key: value})", "list": "a list ([a, b])"}


def _type_words(expected: str) -> tuple[str, list[str]]:
    """('an integer', []) for `<class 'int'>`; ('one of cpu, gpu', ['cpu', 'gpu']) for a Literal."""
    literal = re.fullmatch(r"typing\.Literal\[(.*)\]", expected)
    if literal:
        choices = re.findall(r"'([^']*)'", literal.group(1))
        return "one of " + ", ".join(choices), choices
    name = re.fullmatch(r"<class '(?:[\w.]+\.)?(\w+)'>", expected)
    if name:
        return _TYPE_WORDS.get(name.group(1), name.group(1)), []
    return expected, []


def nearest(value: str, choices: Sequence[str]) -> str | None:
    """The choice a mistyped value most likely meant: the same word in another case, else the closest spelling."""
    same = [c for c in choices if c.lower() == value.lower()]
    if same:
        return same[0]
    match = difflib.get_close_matches(value.lower(), [c.lower() for c in choices], n=1, cutoff=0.5)
    return next((c for c in choices if match and c.lower() == match[0]), None)


def _setting(message: str) -> tuple[str, str | None, list[str]] | None:
    """(the full key, the value given, what it takes) read back from a 'Parser key ...' message, or None."""
    lines = message.splitlines()
    keys = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines) if (m := _KEY.match(line))]
    if not keys:
        return None
    key = ".".join(k for _, _, k in keys)
    start, indent, _ = keys[-1]
    inner = [lines[start].split(":", 1)[1]]
    for line in lines[start + 1:]:  # only what belongs to the innermost key: the lines indented under it
        if len(line) - len(line.lstrip()) <= indent and line.strip():
            break
        inner.append(line)
    takes: list[str] = []
    value = None
    for line in inner:
        text = line.strip().removeprefix("- ")
        if (m := _EXPECTED.match(text)) and not text.startswith("Expected a path"):
            takes.append(m.group(1))
            value = m.group(2) if m.group(2) is not None else value
        elif (m := _GIVEN.match(line)) and value is None:
            value = m.group(1)
    return key, value, takes


def _class_choices(key: str) -> list[str]:
    if key == "data":
        import datamodules

        return [name for name in getattr(datamodules, "__all__", dir(datamodules)) if name.endswith("DataModule")]
    return []


def _class_of(key: str, name: str) -> str | None:
    """The class behind a strategy name (`ddp` -> lightning_app.strategies.ddp.ClusterDDPStrategy), or None."""
    if key != "trainer.strategy":
        return None
    from pytorch_lightning.strategies import StrategyRegistry

    name = name.lower()
    cls = StrategyRegistry[name]["strategy"] if name in StrategyRegistry else None  # not .get(): it builds one
    return f"{cls.__module__}.{cls.__qualname__}" if cls else None


def value_paragraph(message: str, where: Callable[[str], str]) -> str | None:
    """`--data.decode 'GPU' (on the command line) is not a value it takes: cpu, gpu. Did you mean gpu?`, or None
    when the message is not about one setting's value. `where(key)` says where a key's value came from."""
    setting = _setting(message)
    if setting is None:
        return None
    key, value, takes = setting
    unknown_class = _CLASS.search(message)
    init_arg = re.search(r"Given value: NestedArg\(key='([^']+)', val='([^']*)'\)", message)
    if unknown_class and init_arg:  # `--trainer.strategy.timeout_s 60` while --trainer.strategy is a name, `ddp`
        name, arg = unknown_class.group(1), f"{key}.{init_arg.group(1)}"
        return (f"--{arg} {init_arg.group(2)!r} ({where(arg)}) sets an argument of the class --{key} names, "
                f"but --{key} is {name!r}, a name, not a class: name the class first, "
                f"--{key} {_class_of(key, name) or 'package.module.Class'}, then its arguments.")
    if unknown_class:
        choices = _class_choices(key)
        near = nearest(unknown_class.group(1), choices)
        return (f"--{key} {unknown_class.group(1)!r} ({where(key)}) names no class: it takes a class name"
                + (f" ({', '.join(choices)})" if choices else " or a full import path (package.module.Class)")
                + (f". Did you mean {near}?" if near else "."))
    if not takes:
        return None
    words, choices = [], []
    for expected in dict.fromkeys(takes):
        word, its_choices = _type_words(expected)
        words.append(word)
        choices += its_choices
    value = value if value is not None else "?"
    near = nearest(value, choices) if choices else None
    return (f"--{key} {value!r} ({where(key)}) is not a value it takes: it takes {' or '.join(words)}"
            + (f". Did you mean {near}?" if near else "."))


def setting_key(message: str) -> str | None:
    setting = _setting(message)
    return setting[0] if setting else None


# -- config files ------------------------------------------------------------------------------------------
PROJECT_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _config_args(args: Iterable[str]) -> list[str]:
    args = list(args)
    return [args[i + 1] if arg == "--config" else arg.split("=", 1)[1] for i, arg in enumerate(args)
            if (arg == "--config" and i + 1 < len(args)) or arg.startswith("--config=")]


def config_files(args: Iterable[str], defaults: Iterable[str | Path] = ()) -> list[Path]:
    """The config files a command line reads, in order: the parser's defaults, then each --config."""
    files = [Path(f) for f in (*defaults, *_config_args(args))]
    return [f for f in files if f.is_file()]


def missing_config(args: Iterable[str]) -> str | None:
    """`--config FILE: no such file (did you mean NEAREST?)` for the first --config that names no file; the nearest
    among the YAML files beside it and the project's configs/, as the user would type it. (jsonargparse says only
    `Parser key "config": File does not exist: '/abs/path'`.)"""
    for given in _config_args(args):
        path = Path(given).expanduser()
        if path.is_file():
            continue
        beside = path.parent if path.parent.is_dir() else None
        found = {f.resolve() for folder in (beside, PROJECT_CONFIGS) if folder is not None
                 for f in (*folder.rglob("*.yaml"), *folder.rglob("*.yml"))}
        names = [_as_typed(f) for f in sorted(found)]
        match = difflib.get_close_matches(given, names, n=1, cutoff=0.6)
        meant = f" (did you mean {match[0]}?)" if match else ""
        return (f"--config {given}: no such file{meant}. The project's configs are in {_as_typed(PROJECT_CONFIGS)}/; "
                "a relative path is read from the folder the command runs in.")
    return None


def _as_typed(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def yaml_problem(files: Iterable[Path]) -> str | None:
    """`FILE, line L, column C: <what the YAML parser says>` for the first file that is not valid YAML."""
    for file in files:
        try:
            yaml.safe_load(file.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{file}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(file)
            problem = getattr(e, "problem", None) or str(e)
            return (f"{where}: the file is not valid YAML ({problem}). Check the indentation there: each key of a "
                    "section is indented by the same spaces, and a value with ': ' in it is quoted.")
        except OSError:
            continue
    return None


def _dotted_keys(tree: object, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return [prefix] if prefix else []
    keys = []
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key in ("class_path", "init_args", "dict_kwargs"):  # a class_path section: its init args are its keys
            keys += [prefix + ".class_path"] if key == "class_path" else _dotted_keys(value, prefix)
        else:
            keys += _dotted_keys(value, path) if isinstance(value, dict) and value else [path]
    return keys


def unknown_keys(file: Path, known: set[str]) -> list[str]:
    """The keys of a config file no option takes. A key is known when it or a section above it is an option
    (`model.arch_kwargs.conv11.width` is under --model.arch_kwargs, a mapping)."""
    try:
        tree = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError):
        return []
    # an option with no option under it takes a whole value: a mapping (arch_kwargs), a list, a class_path section
    takes_a_tree = {k for k in known if not any(o.startswith(k + ".") for o in known)}
    found = []
    for key in _dotted_keys(tree):
        parts = key.split(".")
        above = {".".join(parts[:n]) for n in range(1, len(parts))}
        if key not in known and not key.endswith(".class_path") and not above & takes_a_tree:
            found.append(key)
    return found


def unknown_keys_paragraph(files: Iterable[Path], known: set[str]) -> str | None:
    """Every unknown key of every config file, each with the option nearest to it, in one paragraph."""
    parts = []
    pool = sorted(known)
    for file in files:
        for key in unknown_keys(file, known):
            group = key.rsplit(".", 1)[0]
            same = [k for k in pool if k.rsplit(".", 1)[0] == group]
            near = next((m[0] for p in (same, pool) if (m := difflib.get_close_matches(key, p, n=1, cutoff=0.6))),
                        None)
            parts.append(f"{key} in {file}" + (f" (did you mean {near}?)" if near else ""))
    if not parts:
        return None
    return (f"Unknown key{'s' if len(parts) > 1 else ''} in the config: {'; '.join(parts)}. No option takes "
            f"{'them' if len(parts) > 1 else 'it'}: fix the spelling or remove {'them' if len(parts) > 1 else 'it'}.")


def source(key: str, args: Sequence[str], files: Sequence[Path]) -> str:
    """Where a setting's value came from: the command line, or the last config file that sets it."""
    flag = f"--{key}"
    if any(a == flag or a.startswith(flag + "=") for a in args):
        return "on the command line"
    section, _, leaf = key.partition(".")
    for file in reversed(files):
        try:
            tree = yaml.safe_load(file.read_text())
        except (OSError, yaml.YAMLError):
            continue
        keys = set(_dotted_keys(tree))
        if key in keys or (leaf and f"{section}.{leaf}" in keys):
            return f"in {file}"
    return "on the command line"



def model_sources(args: Sequence[str] | None, default_config: Path,
                  keys: Iterable[str] = ("optimizer", "lr", "weight_decay")) -> dict[str, str]:
    """{'lr': 'the command line' or the config file that set --model.lr, ...}: for the start-up line that says
    where each of the optimiser's values came from (lightning_app/optimization.py, recipe_line)."""
    args = [a for a in args or () if isinstance(a, str)]
    files = config_files(args, (default_config,))
    return {key: source(f"model.{key}", args, files).removeprefix("on ").removeprefix("in ") for key in keys}


def init_arg_options(message: str) -> list[str]:
    """`--trainer.strategy.timeout_s`, ... for the class a message's `Problem with given class_path 'X'` names: the
    init args of a strategy (or any class_path section) the option names do not list."""
    import importlib
    import inspect

    path, key = re.search(r"Problem with given class_path '([^']+)'", message), _KEY.search(message)
    if not path or not key:
        return []
    module, _, name = path.group(1).rpartition(".")
    try:
        params = inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters
    except Exception:  # noqa: BLE001 - a class that cannot be imported or inspected offers no names
        return []
    return [f"--{key.group(2)}.{p}" for p in params if p not in ("self", "args", "kwargs")]

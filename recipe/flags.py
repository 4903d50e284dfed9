"""
flags.py -- command-line flags generated from config dataclasses by transformers' HfArgumentParser.

    parser = flag_parser([(TrainConfig, {}, "run"), (GRPOConfig, {}, "GRPO")],
                         presets={"tiny": {"steps": 60, "lr": 1e-4}}, description="...")
    args = vars(parser.parse_args(argv))        # every field of every dataclass, by name

Each field becomes `--field-name` (and `--field_name`), typed from its annotation (int, float, str,
bool, Literal choices, Path, `X | None`, list[float]); its --help is the docstring under the field,
its default and the value each preset gives it. A bool gets both `--x` and `--no-x`. A bad flag
prints one line and exits with code 2. config_error turns a config's own ValueError ("lr must be >
0, got 0") into the flag the user typed ("--lr must be > 0, got 0").
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import sys
import typing
from pathlib import Path

from transformers import HfArgumentParser


class InputError(Exception):
    """Bad input from the user (a flag, a data file, a model name): one line, exit code 2, nothing
    written. Raised here, by gsm8k.py's data checks and by checkpoint.py's model loading."""


@contextlib.contextmanager
def as_input_error(*errors: type[Exception]):
    """An error of these types raised inside becomes InputError, with its own one line. WHY: the
    machinery (machinery/lora.py) may not import the recipe, so it raises its own errors."""
    try:
        yield
    except errors as e:
        raise InputError(str(e)) from None


class OneLineParser(HfArgumentParser):
    """HfArgumentParser whose errors are one line ("error: ..."), exit code 2, no usage block."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source (as CleanRL/tyro do)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {a.target.id: b.value.value.strip() for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)}


def flags_view(cls, defaults: dict, title: str, presets: dict[str, dict], choices: dict):
    """A copy of dataclass `cls` for HfArgumentParser: the same fields and resolved types,
    `defaults` over the field defaults, --help from each field's docstring, default and preset
    values (presets: {preset name: {field: value}}), and allowed values for the fields in
    `choices`."""
    docs, types, fields = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        shown = "".join(f"; {p}: {over[f.name]!r}" for p, over in presets.items() if f.name in over)
        own = f.default_factory() if f.default is dataclasses.MISSING else f.default
        meta = {
            "help": f"{docs.get(f.name, '')} (default: {own!r}{shown})".replace("%", "%%")
        }
        if f.name in choices:
            meta["choices"] = choices[f.name]
        meta.update(f.metadata.get("argparse", {}))  # e.g. action="extend" for a repeated flag
        value = defaults.get(f.name, own)
        # WHY: a dataclass refuses a list as a plain default; a factory gives each parse a copy
        default = (dict(default_factory=lambda v=value: list(v)) if isinstance(value, list)
                   else dict(default=value))
        fields.append((f.name, types[f.name], dataclasses.field(metadata=meta, **default)))
    view = dataclasses.make_dataclass(f"{cls.__name__}Flags", fields)
    view._argument_group_name = title  # HfArgumentParser's documented hook for --help sections
    return view


def flag_parser(configs: list[tuple[type, dict, str]], presets: dict[str, dict],
                description: str, choices: dict[str, list] | None = None) -> OneLineParser:
    """One parser for several dataclasses. configs: [(class, defaults, --help section title)];
    presets: {name: {field: value}} over every class's fields, shown in --help;
    choices: {field: allowed values}."""
    views = [flags_view(cls, defaults, title, presets, choices or {})
             for cls, defaults, title in configs]
    parser = OneLineParser(views, formatter_class=argparse.HelpFormatter, description=description)
    for f in (f for view in views for f in dataclasses.fields(view)):
        if f.type is bool and f.default is False:
            # WHY: HfArgumentParser adds --no-X only where the default is True; keep both spellings.
            parser.add_argument(f"--no-{f.name.replace('_', '-')}", f"--no_{f.name}", dest=f.name,
                                action="store_false", default=argparse.SUPPRESS)
    for action in parser._actions:
        # WHY: the hyphenated spelling first, as the README writes flags: --help's usage line and
        #      its list show the first; the underscore spelling still works.
        action.option_strings.sort(key=lambda s: "_" in s)
        if isinstance(action, argparse._StoreFalseAction):
            # NOTE: every --no-X, those added above and HfArgumentParser's own (which would repeat
            #       X's help, "(default: True)" and all), says the one thing it does
            action.help = f"turn --{action.dest.replace('_', '-')} off"
    return parser


def parse_configs(argv, configs, presets: dict, may_change: set[str], saved_state, choices: dict,
                  description: str, preset_for=None) -> list:
    """One instance of each dataclass in `configs` ([(class, state key, --help title)]) from argv.
    Flags override the preset (--preset NAME: {name: {field: value}}, flat over every class's
    fields), which overrides the field defaults. Without --preset: preset_for(--model)'s, else the
    first class's default. --resume DIR: saved_state(DIR)'s settings instead of a preset's, and a
    flag outside `may_change` that differs from them is refused."""
    names = {f.name for cls, _, _ in configs for f in dataclasses.fields(cls)}
    unknown = sorted({k for preset in presets.values() for k in preset} - names)
    if unknown:  # NOTE: a typo in a preset would otherwise be ignored in silence
        raise ValueError(f"a preset sets {unknown}, which no config has")
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # WHY: defaults hang on it
    first.add_argument("--preset", default=None)
    first.add_argument("--model", default="")
    first.add_argument("--resume", default="")
    known = first.parse_known_args(argv)[0]
    known.preset = known.preset or (preset_for(known.model) if preset_for
                                    else configs[0][0].preset)
    state = saved_state(Path(known.resume)) if known.resume else {}
    # WHY by field name, from every saved config: a run saved before a field moved to another
    #     dataclass (gradient_checkpointing into MemoryConfig, say) resumes with its own value,
    #     and a field it never had takes its default.
    flat = {k: v for _, key, _ in configs for k, v in (state.get(key) or {}).items()}
    # WHY "preset": the name the run records
    chosen = flat if state else {**presets.get(known.preset, {}), "preset": known.preset}
    saved = [{f.name: chosen[f.name] for f in dataclasses.fields(cls) if f.name in chosen}
             for cls, _, _ in configs]
    parser = flag_parser([(cls, over, title) for (cls, _, title), over in zip(configs, saved)],
                         presets, description, choices)
    args = vars(parser.parse_args(argv))
    if state:
        refuse_changes({k: v for k, v in args.items() if k in flat}, flat, may_change)
    try:
        return [cls(**{f.name: args[f.name] for f in dataclasses.fields(cls)})
                for cls, _, _ in configs]
    except ValueError as e:
        raise config_error(e) from None


def config_error(e: ValueError) -> InputError:
    """'group_size must be ...' (a config's own check) -> '--group-size must be ...', as typed."""
    field, _, rest = str(e).partition(" ")
    return InputError(f"--{field.replace('_', '-')} {rest}")


def refuse_changes(args: dict, saved: dict, may_change: set[str]):
    """A resumed run keeps the settings it started with (`saved`); only `may_change` may differ."""
    for k, v in args.items():
        if k not in may_change and v != saved.get(k):
            may = ", ".join("--" + n.replace("_", "-") for n in sorted(may_change))
            raise InputError(f"--resume continues a run with the settings it was started with; "
                             f"--{k.replace('_', '-')} was {saved.get(k)!r} there (only {may} may "
                             f"change)")


def run(main, commands: dict, argv=None, stopped: tuple[type[Exception], ...] = ()) -> int:
    """A command line: `commands[argv[0]](argv[1:])` if argv starts with one, else main(argv).
    Bad input (InputError) prints one line and gives exit code 2; a run that cannot go on
    (`stopped`, e.g. checkpoint.TrainingStopped) one line and 1; argparse's own exits pass on."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] and argv[0] in commands:
            commands[argv[0]](argv[1:])
        else:
            main(argv)
    except (InputError, *stopped) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, InputError) else 1
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2), already printed
        return e.code if isinstance(e.code, int) else 2
    return 0

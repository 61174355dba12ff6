"""Command-line flags generated from config dataclasses: every flag is defined once, as a dataclass field.

A config field becomes a flag when it is declared with :func:`flag`::

    @dataclass(frozen=True)
    class ServerConfig(Checked):
        port: int = flag(8000, "TCP port to listen on", check=port_number)

- the default lives in the field (one place); ``--help`` prints it for every flag; a field with no default is a
  required flag;
- the flag name is ``--`` + the field name with ``_`` → ``-`` (``name=`` overrides it);
- ``check`` validates the value in one place: :class:`Checked` runs every field's check in ``__post_init__``, so a
  config built in code is validated exactly like one built from the command line; the CLI turns the
  :class:`ConfigError` into a usage error (exit 2) naming the flag.

Commands build their parser from one or more config classes with :func:`add_flags` and build the configs back
from the parsed namespace with :func:`from_args`; nothing below the command line sees an ``argparse.Namespace``.
Two classes may share a flag (e.g. ``--seed`` seeds the model and the generated catalog): the first class that
declares it defines it, and :func:`from_args` reads it into both.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], str | None]  # returns an error message ("must be >= 1") or None when the value is fine


class UsageError(Exception):
    """A bad argument found after parsing (missing file, unknown preset, no GPU...): the CLI prints
    ``grserve: error: <message>`` on stderr and exits 2."""


class ConfigError(ValueError):
    """A config value failed its check; ``field`` names the field (the CLI shows it as a flag)."""

    def __init__(self, field: str, message: str, flag_name: str | None = None):
        self.field = field
        self.flag_name = flag_name or "--" + field.replace("_", "-")
        super().__init__(f"{self.flag_name}: {message}")


def flag(default: Any = dataclasses.MISSING, help: str = "", *, check: Check | None = None,
         choices: typing.Sequence[Any] | None = None, name: str | None = None, metavar: str | None = None,
         default_factory: Callable[[], Any] | None = None, cli: bool = True) -> Any:
    """A dataclass field that is also a command-line flag (``cli=False``: a checked field with no flag)."""
    meta = {"help": help, "check": check, "choices": tuple(choices) if choices is not None else None,
            "name": name, "metavar": metavar, "cli": cli}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ---- checks --------------------------------------------------------------------------------------------------
def at_least(lo: float) -> Check:
    return lambda v: None if v is None or (v >= lo and not (isinstance(v, float) and math.isinf(v))) \
        else f"must be a finite number >= {lo:g}, got {v}"


positive_int = at_least(1)
non_negative = at_least(0)


def positive(v: float | None) -> str | None:
    return None if v is None or (v > 0 and math.isfinite(v)) else f"must be a finite number > 0, got {v}"


def fraction(v: float | None) -> str | None:
    return None if v is None or 0 <= v <= 1 else f"must be in [0, 1], got {v}"


def port_number(v: int) -> str | None:
    return None if 0 <= v <= 65535 else f"must be in [0, 65535], got {v}"


def device_name(v: str) -> str | None:
    return None if re.fullmatch(r"cpu|cuda(:\d+)?", v) else f"expected cpu, cuda or cuda:N, got {v!r}"


def one_of(*allowed: str) -> Check:
    return lambda v: None if v in allowed else f"must be one of {', '.join(allowed)}, got {v!r}"


def split_commas(text: str, convert: Callable[[str], Any] = str) -> list[Any]:
    """``"16, 64,128"`` → ``[16, 64, 128]`` (empty items dropped); a bad item raises ValueError."""
    return [convert(x.strip()) for x in text.split(",") if x.strip()]


def comma_list(convert: Callable[[str], Any] = str, *, allowed: typing.Collection[Any] | None = None,
               each: Check | None = None) -> Check:
    """Check for a comma-separated list flag: every item converts, is in ``allowed`` and passes ``each``; not empty."""
    def check(text: str | None) -> str | None:
        if text is None:
            return None
        try:
            items = split_commas(text, convert)
        except ValueError:
            return f"expected a comma-separated list, got {text!r}"
        if not items:
            return "must not be empty"
        bad = [x for x in items if allowed is not None and x not in allowed]
        if bad:
            return f"unknown {', '.join(map(str, bad))}; choose from {', '.join(map(str, allowed or ()))}"
        return next((msg for x in items if each is not None and (msg := each(x))), None)

    return check


class Checked:
    """Mixin for config dataclasses: run every field's ``check`` (and ``choices``) after construction."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            meta = f.metadata
            choices = meta.get("choices")
            if choices is not None and value is not None and value not in choices:
                raise ConfigError(f.name, f"must be one of {', '.join(map(str, choices))}, got {value!r}",
                                  _flag_name(f))
            check = meta.get("check")
            if check is not None and (msg := check(value)):
                raise ConfigError(f.name, msg, _flag_name(f))
        self.check()

    def check(self) -> None:
        """Cross-field rules; raise :class:`ConfigError`. Subclasses override."""


# ---- argparse ------------------------------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default, except ``None`` (the help text says what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is argparse.SUPPRESS or action.help is None:
            return action.help
        if "%(default)" in (action.help or ""):
            return action.help
        return (action.help or "") + " (default: %(default)s)"


def _flag_name(f: dataclasses.Field) -> str:
    return "--" + (f.metadata.get("name") or f.name).replace("_", "-")


def _dest(f: dataclasses.Field) -> str:
    return (f.metadata.get("name") or f.name).replace("-", "_")


def _base_type(tp: Any) -> Any:
    """``int | None`` → int; ``Literal['a', 'b']`` → str (with choices); plain types as they are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    if origin is typing.Literal:
        return type(typing.get_args(tp)[0])
    return tp


def _literal_choices(tp: Any) -> tuple | None:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            if (c := _literal_choices(a)) is not None:
                return c
    if origin is typing.Literal:
        return typing.get_args(tp)
    return None


def _argtype(base: Any, f: dataclasses.Field) -> Callable[[str], Any]:
    check = f.metadata.get("check")

    def convert(text: str) -> Any:
        try:
            value = base(text)
        except ValueError:
            kind = {int: "an integer", float: "a number"}.get(base, base.__name__)
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if check is not None and (msg := check(value)):
            raise argparse.ArgumentTypeError(msg)
        return value

    convert.__name__ = getattr(base, "__name__", "value")
    return convert


def _hints(cls: type) -> dict[str, Any]:
    import sys

    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def add_flags(parser: argparse.ArgumentParser | Any, cls: type | Any, *, title: str | None = None,
              skip: typing.Collection[str] = ()) -> None:
    """Add a flag for every :func:`flag` field of dataclass ``cls`` (in an argument group ``title`` if given).
    ``cls`` may be an instance: its values are the flags' defaults (e.g. ``RankingServeConfig().server``, whose
    port differs from the class default); the parent config's ``default_factory`` stays the one place."""
    defaults: dict[str, Any] = {}
    if not isinstance(cls, type):
        defaults = {f.name: getattr(cls, f.name) for f in dataclasses.fields(cls)}
        cls = type(cls)
    target = parser.add_argument_group(title) if title else parser
    existing = {a.dest for a in getattr(parser, "_actions", [])}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "cli" not in meta or not meta["cli"] or f.name in skip or _dest(f) in existing:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
        if f.name in defaults:
            default, required = defaults[f.name], False
        tp = hints[f.name]
        base = _base_type(tp)
        kw: dict[str, Any] = {"dest": _dest(f), "default": default, "help": meta.get("help") or None}
        if required:
            kw["required"] = True
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _argtype(base, f)
            choices = meta.get("choices") or _literal_choices(tp)
            if choices:
                kw["choices"] = choices
            if meta.get("metavar") or not choices:
                kw["metavar"] = meta.get("metavar") or {int: "N", float: "X"}.get(base, "TEXT")
        target.add_argument(_flag_name(f), **kw)


def from_args(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """Build ``cls`` from the parsed flags (fields with no flag keep their defaults); ``overrides`` win."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            kw[f.name] = overrides[f.name]
        elif f.metadata.get("cli") and hasattr(ns, _dest(f)):
            kw[f.name] = getattr(ns, _dest(f))
    return cls(**kw)


def command_parser(sub: Any, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand parser with the house formatter (every default shown); ``description`` may be the command
    module's docstring (its reST ``literal`` quotes are dropped)."""
    return sub.add_parser(name, help=help, description=(description or help).replace("``", ""),
                          formatter_class=HelpFormatter)


def config_command(sub: Any, name: str, help: str, cls: type, run: Callable[[Any], int],
                   description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose flags are the fields of one config class and whose handler is ``run(cls(...flags))``."""
    p = command_parser(sub, name, help, description)
    add_flags(p, cls)
    p.set_defaults(handler=lambda ns: run(from_args(cls, ns)))
    return p

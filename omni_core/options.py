"""Options schemas: what a relay, placement strategy or launcher accepts under ``options:``.

A plugin declares the schema next to the name it registers, so omni validates a config's options
(``omni validate``, and before a pipeline starts) without importing the plugin's code::

    from omni_core.options import positive_int, positive_number

    @omni_core.hookimpl
    def omni_register_relays(register):
        register("acme", "acme_omni.relay:AcmeRelay",
                 capabilities={"devices": ["cpu"], "scopes": ["node"], "priority": 5},
                 options={"slots": positive_int(16, "credits per target"),
                          "timeout": positive_number(30.0, "seconds a put waits for a credit")})

The same schema parses the options at run time (:func:`parse_options`): defaults filled in,
values checked, each error naming its path (``relay.options.slots: expected a positive integer,
got '8'``). This module imports nothing heavy.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from .errors import ConfigError, ConfigIssue


class OptionsError(ConfigError, ValueError):
    """Options that do not fit their schema (a ConfigError, and a ValueError for callers that
    check options as values). The message lists every problem with its path."""

    def _render(self) -> str:
        return "; ".join(str(issue) for issue in self.issues)


#: What an option's ``type`` may be, with the words used for it in messages.
TYPES: dict[str, str] = {
    "int": "an integer",
    "positive_int": "a positive integer",
    "non_negative_int": "a non-negative integer",
    "number": "a number",
    "positive_number": "a positive number",
    "non_negative_number": "a non-negative number",
    "bool": "true or false",
    "str": "a string",
    "choice": "one of the choices",
    "str_list": "a string or a list of strings",
    "mapping": "a mapping",
    "any": "any value",
}


@attrs.frozen
class Option:
    """One option: its ``type`` (a key of :data:`TYPES`), ``default`` (None: no default, the
    option is simply absent), a one-line ``help``, and ``choices`` for ``type="choice"``.

    ``replaced_by``: the option is gone, and this says what replaces it; any value given for it is
    refused with that (``serve.options.openai.allow_local_files: this option was removed: use
    serve.allow_local_files``), so a config written for the old name fails clearly instead of
    being half-honoured."""

    type: str
    default: Any = None
    help: str = ""
    choices: tuple[Any, ...] = ()
    #: ``null`` is a value too (``text_stage: null``: there is none).
    nullable: bool = False
    replaced_by: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"unknown option type {self.type!r}; types: {', '.join(TYPES)}")
        if self.type == "choice" and not self.choices:
            raise ValueError("an option of type 'choice' needs choices=")

    @property
    def expected(self) -> str:
        if self.type == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return TYPES[self.type]

    def problem(self, value: Any) -> str | None:
        """Why ``value`` does not fit (None: it does)."""
        if self.replaced_by is not None:
            return f"this option was removed: {self.replaced_by}"
        if value is None and self.nullable:
            return None
        if _CHECKS[self.type](value) and (self.type != "choice" or value in self.choices):
            return None
        return f"expected {self.expected}{' or null' if self.nullable else ''}, got {value!r}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "default": self.default, "help": self.help}
        if self.choices:
            out["choices"] = list(self.choices)
        if self.nullable:
            out["nullable"] = True
        if self.replaced_by is not None:
            out["replaced_by"] = self.replaced_by
        return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": _is_int,
    "positive_int": lambda v: _is_int(v) and v > 0,
    "non_negative_int": lambda v: _is_int(v) and v >= 0,
    "number": _is_number,
    "positive_number": lambda v: _is_number(v) and v > 0,
    "non_negative_number": lambda v: _is_number(v) and v >= 0,
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "choice": lambda v: True,
    "str_list": lambda v: isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)),
    "mapping": lambda v: isinstance(v, Mapping),
    "any": lambda v: True,
}


def positive_int(default: int | None = None, help: str = "") -> Option:
    return Option("positive_int", default, help)


def positive_number(default: float | None = None, help: str = "") -> Option:
    return Option("positive_number", default, help)


def boolean(default: bool | None = None, help: str = "") -> Option:
    return Option("bool", default, help)


def string(default: str | None = None, help: str = "") -> Option:
    return Option("str", default, help)


def choice(choices: Sequence[Any], default: Any = None, help: str = "") -> Option:
    return Option("choice", default, help, tuple(choices))


#: A whole schema: option name → :class:`Option`.
Schema = Mapping[str, Option]


def as_schema(value: Any) -> dict[str, Option]:
    """A schema from what a plugin passed as ``options=``: a mapping of names to
    :class:`Option` or to mappings of Option's fields (``{"type": "positive_int", "default": 8}``).
    Raises ValueError saying what is wrong."""
    if not isinstance(value, Mapping):
        raise ValueError(f"options= must be a mapping of option names to omni_core.options.Option, got {type(value).__name__}")
    schema: dict[str, Option] = {}
    for name, spec in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"option names must be non-empty strings, got {name!r}")
        if isinstance(spec, Option):
            schema[name] = spec
        elif isinstance(spec, Mapping):
            try:
                fields = dict(spec)
                if "choices" in fields:
                    fields["choices"] = tuple(fields["choices"])
                schema[name] = Option(**fields)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"option {name!r}: {exc}") from None
        else:
            raise ValueError(f"option {name!r} must be an omni_core.options.Option or a mapping, got {type(spec).__name__}")
    return schema


def option_issues(schema: Schema, options: Any, path: str, *, owner: str) -> list[ConfigIssue]:
    """Every problem of ``options`` (a config's ``options:`` mapping at ``path``) against
    ``schema``; ``owner`` names what the options are for in messages (``relay 'shm'``)."""
    if not isinstance(options, Mapping):
        return [ConfigIssue(path, f"expected a mapping of options for {owner}, got {options!r}")]
    issues = []
    for key, value in options.items():
        where = f"{path}.{key}"
        option = schema.get(key)
        if option is None:
            guess = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = f"did you mean {guess[0]!r}?" if guess else (
                f"{owner} takes: {', '.join(schema)}" if schema else f"{owner} takes no options")
            issues.append(ConfigIssue(where, f"unknown option {key!r} for {owner}", hint))
            continue
        problem = option.problem(value)
        if problem:
            default = "" if option.default is None else f" (default {option.default!r})"
            issues.append(ConfigIssue(where, problem + default, option.help or None))
    return issues


def parse_options(schema: Schema, options: Mapping[str, Any] | None, path: str = "options", *,
                  owner: str = "this plugin", ignore_unknown: bool = False) -> dict[str, Any]:
    """``options`` checked against ``schema`` with the defaults filled in; a ConfigError listing
    every problem otherwise (an :class:`OptionsError`). ``ignore_unknown`` drops keys the schema does not know (a relay
    given the options of several relays)."""
    options = dict(options or {})
    if ignore_unknown:
        options = {k: v for k, v in options.items() if k in schema}
    issues = option_issues(schema, options, path, owner=owner)
    if issues:
        raise OptionsError(issues)
    values = {name: option.default for name, option in schema.items() if option.replaced_by is None}
    values.update(options)
    return values


def describe(schema: Schema) -> list[dict[str, Any]]:
    """The schema as rows for docs and ``omni plugins list --json``."""
    return [{"name": name, **option.to_dict()} for name, option in schema.items()]

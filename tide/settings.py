"""What every service's settings share: one frozen pydantic-settings model per service, built once from
`TIDE_*` environment variables by `from_env`, passed explicitly, never mutated.

A model names its variables the pydantic-settings way: `env_prefix` + the field name in upper case
(`TIDE_CONTROLLER_` + `listen`), or the field's `validation_alias` for a variable outside the prefix
(`AliasChoices` for a variable with a fallback: the first one set wins). A blank value (empty or only
spaces) counts as unset. A field whose type is another `TideSettings` (storage) reads its own
variables from the same environment. Field docs come from `Field(description=...)`;
`json_schema_extra=shown_default("...")` shows a default that a factory computes, `NOT_FROM_ENV` marks
a field no variable sets (it is derived, or set only in code).

`from_env(env)` reads `env` (default `os.environ`), asking it only for the model's variables;
constructing a model directly (tests, benchmarks) reads nothing from the environment. Either way a bad
value raises ValueError naming the variable and the value (`TIDE_X='y': must be ...`).

`markdown_table(model)` renders a model's variables (name, type, default, description) as a Markdown
table: docs/configuration.md is generated from the services' models (tools/gen_config_docs.py).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import FrozenInstanceError, dataclass
from types import MappingProxyType, NoneType, UnionType
from typing import Annotated, Any, Self, Union, get_args, get_origin

from pydantic import AfterValidator, AliasChoices, BeforeValidator, Field, StringConstraints, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from tide.resources import parse_cpus

LOG_LEVEL_ENV = "TIDE_LOG_LEVEL"
TARGET_ENV = "TIDE_TARGET"
NOT_FROM_ENV: dict[str, Any] = {"env": False}  # json_schema_extra of a field no variable sets


def shown_default(text: str) -> dict[str, Any]:
    """json_schema_extra of a field whose default is computed (hostname, temp dir): how the docs show it."""
    return {"shown_default": text}


@dataclass(frozen=True)
class Doc:
    """How a type reads in the docs' table (metadata of an `Annotated` type)."""

    type: str


# ------------------------------------------------------------------------------- validators


def check(ok: Callable[[Any], bool], expected: str) -> AfterValidator:
    """A validator that passes values for which `ok` holds and else raises "must be `expected`, got ..."."""

    def validate(value):
        if not ok(value):
            raise ValueError(f"must be {expected}, got {value!r}")
        return value

    validate.expected = expected  # for the docs' type column
    return AfterValidator(validate)


def at_least(low: float) -> AfterValidator:
    return check(lambda v: v >= low, f">= {low}")


def above(low: float) -> AfterValidator:
    return check(lambda v: v > low, f"> {low}")


def finite_at_least(low: float) -> AfterValidator:
    return check(lambda v: low <= v < math.inf, f"finite and >= {low}")


def within(low: float, high: float) -> AfterValidator:
    return check(lambda v: low <= v <= high, f"in [{low}, {high}]")


def one_of(choices: tuple[str, ...]) -> AfterValidator:
    return check(lambda v: v in choices, f"one of {choices}")


def parse_flag(value: Any) -> Any:
    """1/true/yes/on or 0/false/no/off (any case) as a bool; a bool as it is."""
    if not isinstance(value, str):
        return value
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 1 or 0, got {value!r}")


def split_list(value: Any) -> Any:
    """A comma list ("a, b,") as a tuple of its non-empty parts; anything else as it is."""
    if not isinstance(value, str):
        return value
    return tuple(part.strip() for part in value.split(",") if part.strip())


def address(value: str, allow_zero: bool = False) -> str:
    """`value` if it is host:port (port 0 = any free port, only where `allow_zero`)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if allow_zero else 1) <= int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return value


def json_object(value: Any) -> Any:
    """A JSON object (from its text) as a dict; a mapping as it is."""
    if isinstance(value, str):
        value = json.loads(value)  # json.JSONDecodeError is a ValueError
    if not isinstance(value, Mapping):
        raise ValueError("must be a JSON object")
    return value


def _cpus(value: str) -> str:
    parse_cpus(value)  # ValueError when malformed
    return value


# ------------------------------------------------------------------------------ field types

Flag = Annotated[bool, BeforeValidator(parse_flag), Doc("flag: 1/0, true/false, yes/no, on/off")]
Address = Annotated[str, AfterValidator(address), Doc("host:port")]
ListenAddress = Annotated[str, AfterValidator(lambda v: address(v, allow_zero=True)), Doc("host:port (port 0: any)")]
OptionalAddress = Annotated[str, AfterValidator(lambda v: v and address(v)), Doc("host:port or empty")]
AddressList = Annotated[tuple[Address, ...], BeforeValidator(split_list), Doc("comma list of host:port")]
NameSet = Annotated[frozenset[str], BeforeValidator(split_list), Doc("comma list")]
CpuSet = Annotated[str, AfterValidator(_cpus), Doc('CPU ids, e.g. "0-5", "0,2-3"; empty = all')]
Port = Annotated[int, within(0, 65535), Doc("port")]
Seconds = Annotated[float, above(0), Doc("seconds")]
Count = Annotated[int, at_least(1)]
NonNegative = Annotated[int, at_least(0)]
OptionalCount = Annotated[int | None, check(lambda v: v is None or v >= 1, ">= 1")]  # None: derived
JsonObject = Annotated[Mapping[str, Any], BeforeValidator(json_object),
                       AfterValidator(lambda m: MappingProxyType(dict(m))), Doc("JSON object")]  # read-only
LogLevel = Annotated[str, AfterValidator(str.upper), Doc("log level")]
# A secret keeps its value exactly (no stripping) and stays out of repr.
Secret = Annotated[str | None, StringConstraints(strip_whitespace=False), Field(repr=False), Doc("secret")]


def log_level_field() -> Any:
    return Field("INFO", validation_alias=LOG_LEVEL_ENV, description="log level of the JSON logs")


# ----------------------------------------------------------------------------------- models


class TideSettings(BaseSettings):
    """Base of the services' settings: frozen, built by `from_env`; direct construction reads no variable."""

    model_config = SettingsConfigDict(frozen=True, populate_by_name=True, extra="forbid", validate_default=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **_others) -> tuple[PydanticBaseSettingsSource]:
        return (init_settings,)  # the environment comes in through from_env only

    def __init__(self, _tide_origin: Mapping[str, tuple[str, str]] | None = None, **values: Any) -> None:
        """Direct construction (tests, benchmarks) reads no variable: `values` only. A bad value raises
        ValueError naming its variable (`_tide_origin`: where `from_env` read each value)."""
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ValueError(explain(type(self), e, _tide_origin or {})) from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Self:
        """Build from the environment (or `env`); raises ValueError naming the bad variable."""
        source = MappingEnvSource(cls, os.environ if env is None else env)
        values = source()
        return cls(_tide_origin=source.origin, **values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}: settings are never mutated")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}: settings are never mutated")


class ListenHostMixin:
    """Derived property of settings with a `listen` host:port field."""

    @property
    def listen_host(self) -> str:
        """The host of `listen`: where the service's other servers (metrics) listen too."""
        return self.listen.rsplit(":", 1)[0]


class CpuSetMixin:
    """Derived property of settings with a `cpus` field (`CpuSet`)."""

    @property
    def cpu_set(self) -> frozenset[int]:
        """The CPUs of `cpus` (empty: all)."""
        return parse_cpus(self.cpus)


def _nested(info: FieldInfo) -> type[TideSettings] | None:
    t = info.annotation
    return t if isinstance(t, type) and issubclass(t, TideSettings) else None


def env_names(model: type[BaseSettings], name: str) -> tuple[str, ...]:
    """The variables that set field `name` of `model`, first choice first (none for derived fields)."""
    info = model.model_fields[name]
    if _nested(info) or (isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("env") is False):
        return ()
    alias = info.validation_alias
    if isinstance(alias, str):
        return (alias,)
    if isinstance(alias, AliasChoices):
        return tuple(c for c in alias.choices if isinstance(c, str))
    return (f"{model.model_config.get('env_prefix', '')}{name}".upper(),)


class MappingEnvSource(PydanticBaseSettingsSource):
    """A model's variables from `env`, any mapping: it is asked only for those variables (`env.get`)."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]):
        super().__init__(settings_cls)
        self.env = env
        self.origin: dict[str, tuple[str, str]] = {}  # field -> (variable, raw value) it came from

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        for var in env_names(self.settings_cls, field_name):
            raw = self.env.get(var)
            if raw is not None and raw.strip():
                return raw, var, False
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, info in self.settings_cls.model_fields.items():
            if nested := _nested(info):
                values[name] = nested.from_env(self.env)
                continue
            raw, var, _ = self.get_field_value(info, name)
            if raw is not None:
                values[name] = raw
                self.origin[name] = (var, raw)
        return values


def explain(model: type[BaseSettings], error: ValidationError, origin: Mapping[str, tuple[str, str]]) -> str:
    """The errors of `error`, each naming the variable it is about and its value (`origin`: field -> the
    variable and raw value it came from, where `from_env` read it)."""
    by_key = {}
    for name in model.model_fields:
        by_key[name] = name
        by_key.update((alias, name) for alias in env_names(model, name))
    lines = []
    for e in error.errors():
        cause = (e.get("ctx") or {}).get("error")
        msg = str(cause) if e["type"] == "value_error" and cause is not None else e["msg"]
        name = by_key.get(e["loc"][0]) if e["loc"] else None
        if name is None:  # the model's own check (its message names the variables), or an unknown field
            lines.append(f"{e['loc'][0]}: {msg}" if e["loc"] else msg)
            continue
        var, value = origin.get(name) or (" / ".join(env_names(model, name)) or name, e.get("input"))
        lines.append(f"{var}={value!r}: {msg}")
    return "; ".join(lines)


# ------------------------------------------------------------------------------------- docs


def _type_doc(info: FieldInfo) -> str:
    """The field's `Doc` or its Python type in words, then what its `check`s require."""
    docs = [m.type for m in info.metadata if isinstance(m, Doc)]
    t = info.annotation
    if get_origin(t) in (Union, UnionType):
        t = next(a for a in get_args(t) if a is not NoneType)
    names = {bool: "flag", int: "integer", float: "number", str: "string"}
    base = docs[-1] if docs else names.get(t, getattr(t, "__name__", str(t)))
    checks = [m.func.expected for m in info.metadata if isinstance(m, AfterValidator) and hasattr(m.func, "expected")]
    return f"{base} ({'; '.join(checks)})" if checks else base


def _default_doc(info: FieldInfo) -> str:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "shown_default" in extra:
        return str(extra["shown_default"])
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if isinstance(value, tuple | frozenset | set | list):
        value = ",".join(map(str, value))
    elif isinstance(value, Mapping):
        value = json.dumps(dict(value))
    return f"`{value}`" if str(value) else "empty"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown_table(model: type[BaseSettings]) -> str:
    """The variables of `model` as a Markdown table: variable, type, default, description."""
    rows = ["| Variable | Type | Default | Description |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        names = env_names(model, name)
        if not names:
            continue
        variable = f"`{names[0]}`" + "".join(f" (else `{n}`)" for n in names[1:])
        cells = (variable, _type_doc(info), _default_doc(info), info.description or "")
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"


def nested_settings(model: type[BaseSettings]) -> dict[str, type[TideSettings]]:
    """Fields of `model` that are settings of their own (read from the same environment), by name."""
    return {name: t for name, info in model.model_fields.items() if (t := _nested(info))}

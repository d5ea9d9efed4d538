"""Command-line flags generated from config dataclasses: `field_name` -> `--field-name`, with the
default read from `TOKENMILL_FIELD_NAME` when set, and the field's help text. The engine's groups
(EngineConfig's model, cache, scheduler, ...) each become an argument group of flat flags."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(field_name: str) -> str:
    return f"TOKENMILL_{field_name.upper()}"


def _base_type(tp):
    """int | None -> int; int | str | None -> str (parsed later by the dataclass)."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing))  # annotations are strings under `from __future__ import annotations`
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _parse_env(value: str, tp, name: str):
    if tp is bool:
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ConfigError(f"{env_name(name)}={value!r} is not a boolean")
    try:
        return tp(value)
    except ValueError:
        raise ConfigError(f"{env_name(name)}={value!r} is not a valid {tp.__name__}") from None


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (),
                       title: str | None = None) -> None:
    group = parser.add_argument_group(title or cls.__name__, (cls.__doc__ or "").strip() or None)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name.startswith("_"):
            continue
        tp = _base_type(f.type)
        default = f.default
        env = os.environ.get(env_name(f.name))
        if env is not None:
            default = _parse_env(env, tp, f.name)
        help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}; default: {default}]".replace("%", "%%")
        flag = "--" + f.name.replace("_", "-")
        if tp is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=tp, default=default, help=help_text,
                               choices=f.metadata.get("choices"))


def dataclass_from_args(cls, args: argparse.Namespace, **overrides):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False, skip: tuple[str, ...] = ()
                    ) -> None:
    for name, tp in EngineConfig.group_types().items():
        add_dataclass_args(parser, tp, skip=skip, title=f"engine: {name}")
    if positional_model:
        parser.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                            help="Model (same as --model).")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    values = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    values["model"] = getattr(args, "model_pos", None) or args.model
    values.update(overrides)
    return EngineConfig.from_kwargs(**values)

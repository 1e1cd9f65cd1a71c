"""Typed service configuration read from flags and environment variables.

Each service declares one frozen dataclass; every field carries its help text in
``field(metadata={"help": ...})``. A field ``foo_bar`` is set by ``--foo-bar`` or by the
environment variable ``<PREFIX>_FOO_BAR`` (flag wins over environment, environment over the
default). ``validate()`` on the dataclass raises ``ConfigError`` with a message naming the flag.

File paths are made absolute here, once, against the working directory the service was started in:
a field whose name ends in ``_file`` or whose metadata says ``"path": True``. Services hand paths
to child processes that run elsewhere (workers start in the repository root), so a relative
``--tls-cert secrets/engine.pem`` must mean the same file to all of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Sequence, TypeVar

T = TypeVar("T")

# --kv-cache-dtype of the engine and the worker: the KV pool of a --dtype native worker
KV_CACHE_DTYPES = ("auto", "float16", "int8-values")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the flag."""


def _env_name(prefix: str, name: str) -> str:
    return f"{prefix}_{name.upper()}"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"not a boolean: {text!r}")


def load_config(cls: type[T], env_prefix: str, argv: Sequence[str] | None = None, description: str = "") -> T:
    """Build ``cls`` from ``argv`` and the environment; exits with a usage message on bad input."""
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description or cls.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        env = _env_name(env_prefix, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f"{f.metadata.get('help', '')} [env {env}]"
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text + f" (default: {default})")
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text + f" (default: {default!r})")
    ns = parser.parse_args(argv)
    values: dict[str, Any] = {}
    try:
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            raw = getattr(ns, f.name)
            if raw is None:
                raw = os.environ.get(_env_name(env_prefix, f.name))
            if raw is None:
                continue
            values[f.name] = _convert(hints[f.name], raw, f.name)
            if is_path_field(f) and values[f.name]:
                values[f.name] = os.path.abspath(os.path.expanduser(values[f.name]))
        config = cls(**values)
        validate = getattr(config, "validate", None)
        if validate is not None:
            validate()
    except ConfigError as exc:
        parser.error(str(exc))
    return config


def is_path_field(f: dataclasses.Field) -> bool:  # type: ignore[type-arg]
    return f.name.endswith("_file") or bool(f.metadata.get("path"))


def _convert(kind: Any, raw: Any, name: str) -> Any:
    if not isinstance(raw, str):
        return raw
    flag = "--" + name.replace("_", "-")
    try:
        if kind is bool:
            return _parse_bool(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    return raw


def require(condition: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``condition``: the config-time twin of input validation."""
    if not condition:
        raise ConfigError(message)

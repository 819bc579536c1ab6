"""Flags from `Settings`: one per field, its type, bounds and help from the model.

The `serve` and `cluster` commands share them; a setting's default lives in one place
(the model), and a bad value is reported as one line naming the flag and its
environment variable.
"""

from __future__ import annotations

import argparse
import sys
import typing
from typing import Any

from pydantic import ValidationError

from ..settings import CHOICES, ENV_PREFIX, Settings

__all__ = ["add_settings_flags", "settings_from_args", "settings_or_report"]

# older flag names kept working beside the ones built from the Settings fields
_FLAG_ALIASES = {
    "default_ttl_s": ("--ttl-s",),
    "prefill_slots_per_engine": ("--prefill-slots",),
    "template_family": ("--family",),
}
_MIB = 1024 * 1024


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    """One flag per `Settings` field: its type, bounds and help come from the model, so a
    default lives in one place. Flags default to None ("not given"), which leaves the
    field to the environment (`TITO_<FIELD>`) and then to the model's default."""
    g = p.add_argument_group(
        "settings", f"every setting is also an environment variable {ENV_PREFIX}<NAME> (e.g. "
        f"{ENV_PREFIX}MAX_SESSIONS); a flag given here wins over the environment")
    for name, info in Settings.model_fields.items():
        default = info.default
        shown = "" if default is None else f" (default: {default})"
        kw: dict[str, Any] = {"dest": f"setting_{name}", "default": None,
                              "help": (info.description or "") + shown}
        base = next(a for a in getattr(info.annotation, "__args__", (info.annotation,)) if a is not type(None))
        if typing.get_origin(info.annotation) is list:  # e.g. --peers URL --peers URL
            kw.update(action="append", type=base, metavar=name.upper().removesuffix("S"))
        elif base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif getattr(info.annotation, "__origin__", None) is list:  # repeatable: --peers URL --peers URL
            kw.update(action="append", metavar="URL", help=kw["help"] + "; repeat the flag for each")
        else:
            kw["type"] = base
            kw["metavar"] = name.upper()
            if name in CHOICES:
                kw["choices"] = CHOICES[name][1]
                del kw["metavar"]
        g.add_argument(_flag(name), *_FLAG_ALIASES.get(name, ()), **kw)
    g.add_argument("--max-body-mb", type=int, default=None, dest="max_body_mb",
                   help="--max-body-bytes in MiB (the older flag)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The flags given, over the environment, over the model's defaults."""
    given = {name: v for name in Settings.model_fields if (v := getattr(args, f"setting_{name}", None)) is not None}
    mb = getattr(args, "max_body_mb", None)
    if mb is not None:
        if "max_body_bytes" in given:
            raise ValueError("give --max-body-mb or --max-body-bytes, not both")
        given["max_body_bytes"] = mb * _MIB
    return Settings(**given)


def settings_or_report(args: argparse.Namespace, command: str) -> Settings | None:
    """The settings, or None after printing the one-line error (the command exits 2)."""
    try:
        return settings_from_args(args)
    except (ValidationError, ValueError) as exc:
        print(f"session-server {command}: error: {_one_line(exc)}", file=sys.stderr)
        return None


def _one_line(exc: Exception) -> str:
    """A settings error as one line naming the flag and its environment variable."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        field = name if name in Settings.model_fields else name.lower().removeprefix(ENV_PREFIX.lower())
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{_flag(field)} / {ENV_PREFIX}{field.upper()}: {msg}")
    return "; ".join(parts)

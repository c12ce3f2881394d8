"""Reading settings onto a DaemonConfig: TOML tables and `dtfm-peer join` flags, converted to
the field types, checked by the section dataclasses, errors naming the key or the flag.

Every key of every table is a `Setting`: a field of a section dataclass, or of the lower layer's
config that a section embeds (see dtfm.peer.config). The flags are the settings that declare
one; their help and default come from the same place as the key's.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtfm.net import Address, AddressError

from .config import ConfigError, DaemonConfig, lower_layer_error, read_toml

SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(DaemonConfig)[f.name] for f in dataclasses.fields(DaemonConfig)}

# Tables that were renamed: an old file names the new table instead of failing as unknown.
RENAMED_SECTIONS = {
    "control": ("socket", "the local control socket's settings"),
    "trainer": ("plane", "the control plane's settings, with data and torch_threads"),
}


@dataclass(frozen=True)
class Setting:
    """One key of one TOML table; with `flag`, also a command-line option of `join`."""

    section: str
    key: str
    hint: Any  # the field's type
    embedded: bool  # a field of the section's EMBEDDED config, not of the section itself
    flag: str | None = None
    help: str = ""
    metavar: str | None = None
    repeat: bool = False  # a tuple-valued flag given once per element

    @property
    def dest(self) -> str:
        """The argparse destination of the flag."""
        return f"cfg__{self.section}__{self.key}"

    def value(self, config: DaemonConfig) -> Any:
        section = getattr(config, self.section)
        value = section.settings if self.embedded else section
        for name in self.key.split("."):
            value = getattr(value, name)
        return value


def _own_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a section that are keys: those declared with `option()`, or every field
    of a lower layer's config used whole as a section ([transport])."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    declared = [f for f in fields if "help" in f.metadata]
    return declared if declared or hasattr(cls, "EMBEDDED") else fields


def section_settings(section: str) -> dict[str, Setting]:
    """The keys of one table, by name."""
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    out = {}
    for f in _own_fields(cls):
        meta = f.metadata
        out[f.name] = Setting(section, f.name, hints[f.name], False, meta.get("flag"),
                              meta.get("help", ""), meta.get("metavar"), meta.get("repeat", False))
    embedded = getattr(cls, "EMBEDDED", None)
    if embedded is not None:
        flags = {fl.key: fl for fl in getattr(cls, "EMBEDDED_FLAGS", ())}
        skip = set(getattr(cls, "EMBEDDED_SET_BY_SECTION", ()))
        for key, hint in _embedded_keys(embedded):
            if key in skip:
                continue
            if key in out:
                raise TypeError(f"[{section}]: {key} is both a section and an embedded field")
            fl = flags.get(key)
            out[key] = Setting(section, key, hint, True, fl.flag if fl else None, fl.help if fl else "",
                               fl.metavar if fl else None)
    return out


def _embedded_keys(cls: type) -> list[tuple[str, Any]]:
    """(key, type) of every field of an embedded config; a field that is a config dataclass
    itself gives one key per field of it, "outer.NAME"."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            inner = typing.get_type_hints(hint)
            out += [(f"{f.name}.{g.name}", inner[g.name]) for g in dataclasses.fields(hint)]
        else:
            out.append((f.name, hint))
    return out


def flag_settings() -> list[Setting]:
    """Every setting that is also a command-line flag, table by table."""
    return [s for section in SECTIONS for s in section_settings(section).values() if s.flag]


def default_text(setting: Setting) -> str:
    """' (default: X)' for a flag's help, from the default config; empty where none shows."""
    value = setting.value(DaemonConfig.default())
    if value is None or value == () or value == "" or isinstance(value, bool):
        return ""
    return f" (default: {value})"


# ---- converting raw values (TOML or flag text) to field types --------------------------------

def _convert(where: str, hint: Any, value: Any, base_dir: Path | None, *,
             text: bool = False) -> Any:
    """`value` as the field type `hint`; `text=True` also parses numbers given as text (flags)."""
    if text and hint in (int, float) and isinstance(value, str):
        try:
            value = hint(value)
        except ValueError:
            raise ConfigError(f"{where} must be {'an integer' if hint is int else 'a number'}, "
                              f"got {value!r}") from None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(where, inner[0], value, base_dir, text=text)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_convert(f"{where}[{i}]", args[0], v, base_dir) for i, v in enumerate(value))
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    if hint is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where} must be a path, got {value!r}")
        p = Path(value).expanduser()
        return p if p.is_absolute() or base_dir is None else base_dir / p
    if hint is Address:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a \"HOST:PORT\" string, got {value!r}")
        try:
            return Address.parse(value)
        except AddressError as e:
            raise ConfigError(f"{where}: {e}") from None
    raise TypeError(f"{where}: unsupported config field type {hint!r}")


def _apply(section: str, current: Any, changes: dict[Setting, Any]) -> Any:
    """`current` (a section) with typed values set; lower layers' refusals name the keys."""
    own = {s.key: v for s, v in changes.items() if not s.embedded}
    embedded = {s.key: v for s, v in changes.items() if s.embedded}
    try:
        value = dataclasses.replace(current, **own) if own else current
        return value.with_settings(**embedded) if embedded else value
    except ConfigError:
        raise
    except ValueError as e:   # the check of a config class defined in a lower layer
        raise lower_layer_error(section, [*own, *embedded], e) from None


# ---- TOML ------------------------------------------------------------------------------------

def merge(base: DaemonConfig, raw: dict[str, Any], *, base_dir: Path | None = None) -> DaemonConfig:
    """Apply a nested mapping (`{"peer": {"region": "eu"}}`) onto `base`; validated.

    Relative paths resolve against `base_dir` (the config file's folder) when given.
    """
    if not isinstance(raw, dict):
        raise ConfigError("configuration must be a table")
    sections = {}
    for name, table in raw.items():
        if name in RENAMED_SECTIONS and name not in SECTIONS:
            new, what = RENAMED_SECTIONS[name]
            raise ConfigError(f"[{name}] is now [{new}] ({what}): rename the table")
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}]; known: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}] must be a table")
        known = section_settings(name)
        changes = {}
        for key, value in _flatten(table, known).items():
            if key not in known:
                raise ConfigError(f"unknown setting {name}.{key}; known: {', '.join(sorted(known))}")
            changes[known[key]] = _convert(f"{name}.{key}", known[key].hint, value, base_dir)
        sections[name] = _apply(name, getattr(base, name), changes)
    return dataclasses.replace(base, **sections)


def _flatten(table: dict[str, Any], known: dict[str, Setting]) -> dict[str, Any]:
    """The table with the sub-tables of nested configs ([plane.election], or the dotted keys
    `election.lease_s = 1.0`, which TOML reads alike) as "outer.NAME" keys."""
    out = {}
    for key, value in table.items():
        if isinstance(value, dict) and any(k.startswith(f"{key}.") for k in known):
            out.update({f"{key}.{inner}": v for inner, v in value.items()})
        else:
            out[key] = value
    return out


def load_toml(path: Path, base: DaemonConfig | None = None) -> DaemonConfig:
    """Read a TOML config file onto `base` (default profile); ConfigError names the file."""
    base = DaemonConfig.default() if base is None else base
    raw = read_toml(path, "config file")
    try:
        return merge(base, raw, base_dir=path.resolve().parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


# ---- flags -----------------------------------------------------------------------------------

def apply_flags(base: DaemonConfig, namespace: Any) -> DaemonConfig:
    """`base` with the flags given on the command line applied (absent flags keep base's).

    Flag values arrive as text (a list of texts for repeatable flags, True for switches);
    a value that does not parse names the flag, one a section refuses names its key.
    Relative paths stay relative to the working directory.
    """
    changes: dict[str, dict[Setting, Any]] = {}
    for s in flag_settings():
        value = getattr(namespace, s.dest, None)
        if value is not None:
            changes.setdefault(s.section, {})[s] = _convert(s.flag or s.key, s.hint, value, None, text=True)
    sections = {name: _apply(name, getattr(base, name), ch) for name, ch in changes.items()}
    return dataclasses.replace(base, **sections)

"""Settings from a ``--config`` file (YAML, TOML or JSON; flat, or in torchtitan-style sections
such as ``[training]``, see `shardax.train.config.SECTIONS`) or a dict, as a config dataclass.

Values are coerced to the dataclass's field types (`shardax.train.config.coerce`); an unknown
key or a wrongly typed value is a `UsageError` naming the file and the flag.

>>> from shardax.train.config import TrainConfig
>>> from_dict(TrainConfig, {"steps": 10, "batch_size": 8}).batch_size
8
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shardax.errors import UsageError
from shardax.filecheck import parse_json, read_text
from shardax.train.config import SECTIONS, TrainConfig, coerce, hints

__all__ = ["from_dict", "load_file"]


# A settings file is a flat mapping of a few dozen keys: anything larger is not one.
MAX_CONFIG_BYTES = 2**20
# YAML 1.2 core schema floats without a dot (1e-3, 5E+4): YAML 1.1 reads these as strings.
_YAML12_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)$")


def from_dict(cls: type, values: dict[str, Any], where: str = "") -> Any:
    """A ``cls`` (`TrainConfig` or `GenerateConfig`) from a dict such as a parsed config
    file; unknown keys and wrongly typed values are a UsageError prefixed with ``where``.

    >>> from shardax.train.config import GenerateConfig
    >>> from_dict(GenerateConfig, {"out": "runs/a", "max_tokens": 8}).max_tokens
    8
    """
    if not isinstance(values, dict):
        raise UsageError(f"{where}expected a mapping of settings, got {type(values).__name__}")
    types = hints(cls)
    unknown = [k for k in values if k not in types]
    if unknown:
        raise UsageError(f"{where}unknown settings {unknown}; known: {sorted(types)}")
    return cls(**{k: coerce(k, types[k], v, where) for k, v in values.items()})


def load_file(path: str | Path) -> dict[str, Any]:
    """The settings in a ``--config`` file (``.yaml``/``.yml``, ``.toml`` or ``.json``), flat
    or in `shardax.train.config.SECTIONS`, as a flat mapping of field names to values; errors
    are a UsageError naming the file."""
    path = Path(path)
    suffix = path.suffix.lower()
    where = f"--config {path}"
    try:  # a regular file of bounded size: never hang on a FIFO, never read without limit
        text = read_text(path, limit=MAX_CONFIG_BYTES)
    except ValueError as e:
        raise UsageError(f"--config {e}") from None
    try:
        if suffix in (".yaml", ".yml"):
            try:
                import yaml  # optional: PyYAML (extra "train")
            except ImportError:
                raise UsageError(f"{where}: reading YAML needs PyYAML (pip install pyyaml), "
                                 "or write the file as .toml or .json") from None
            values = yaml.load(text, Loader=_yaml_loader(yaml, where))  # a SafeLoader
            values = {} if values is None else values
        elif suffix == ".toml":
            try:
                import tomllib  # optional: the standard library's from Python 3.11
            except ImportError:  # Python 3.10
                import tomli as tomllib
            values = tomllib.loads(text)
        elif suffix == ".json":
            try:  # bounded nesting, no lone surrogates: see shardax.filecheck
                values = parse_json(text, where)
            except ValueError as e:
                raise UsageError(str(e)) from None
        else:
            raise UsageError(f"{where}: unknown file type {suffix!r}; use .yaml, .toml or .json")
    except UsageError:
        raise
    except Exception as e:  # each parser has its own error class
        reason = " ".join(str(e).split())
        raise UsageError(f"{where}: cannot parse it: {reason}") from None
    if not isinstance(values, dict):
        raise UsageError(f"{where}: expected a mapping of settings such as 'steps: 100'")
    return _flatten(values, where)


def _key(key: Any) -> Any:
    return key.replace("-", "_") if isinstance(key, str) else key


def _flatten(values: dict[str, Any], where: str) -> dict[str, Any]:
    """The settings of a flat or sectioned file as one flat mapping: a mapping value is a
    section of `shardax.train.config.SECTIONS` whose keys are `TrainConfig` fields (``data``
    is a section when it is a mapping, the field when it is a list)."""
    fields, flat = hints(TrainConfig), {}
    for name, value in values.items():
        if isinstance(value, dict):
            if name not in SECTIONS:
                raise UsageError(f"{where}: unknown section [{name}]; sections: "
                                 f"{', '.join(SECTIONS)}")
            items = [(_key(k), v, f"[{name}] ") for k, v in value.items()]
        else:
            items = [(_key(name), value, "")]
        for key, v, section in items:
            if section and key not in fields:
                raise UsageError(f"{where}: unknown key {key!r} in section {section.strip()}; "
                                 f"it takes {', '.join(SECTIONS[name])}")
            if key in flat:
                raise UsageError(f"{where}: {section}{key} is set twice")
            flat[key] = v
    return flat


def _yaml_loader(yaml: Any, where: str) -> type:
    """PyYAML's ``SafeLoader`` that refuses aliases (``*name``: a settings file needs none, and
    nested aliases expand exponentially, the "billion laughs" bomb) and reads numbers by YAML
    1.2's rules, so that ``lr: 1e-3`` is the float 0.001 rather than YAML 1.1's string."""

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise UsageError(f"{where}: YAML aliases (*name) are not allowed in a config "
                                 f"file (line {mark.line + 1}); write the value out")
            return super().compose_node(parent, index)

    # After SafeLoader's own int and float resolvers, which still win where they match.
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
    return Loader

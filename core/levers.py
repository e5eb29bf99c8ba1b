"""The lever registry (specs/levers.yaml): one row per environment switch, and reading a
lever's value from an environment (a value outside its row is refused by name)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Mapping

import yaml

from .errors import BadLeverValue, SpecError

LEVERS_YAML = Path(__file__).resolve().parent.parent / "specs" / "levers.yaml"
FIELDS = ("name", "type", "values", "default", "changes", "cost")


@dataclass(frozen=True)
class Lever:
    name: str
    type: str
    values: tuple          # accepted settings (strings)
    default: str
    changes: str           # what it changes
    cost: str              # its measured cost


@lru_cache(maxsize=None)
def levers(path: Path = LEVERS_YAML) -> tuple:
    """The registry rows, in file order."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise SpecError(f"{path}: cannot be read as YAML ({e}).") from None
    if not isinstance(raw, list):
        raise SpecError(f"{path}: expected a list of lever rows")
    out = []
    for i, row in enumerate(raw):
        if not isinstance(row, dict) or set(row) != set(FIELDS):
            got = sorted(row) if isinstance(row, dict) else row
            raise SpecError(f"{path}: row {i}: expected fields {', '.join(FIELDS)}, found {got}")
        values = tuple(str(v) for v in row["values"])
        if str(row["default"]) not in values:
            raise SpecError(f"{path}: {row['name']}: default {row['default']!r} is not among values {list(values)}")
        out.append(Lever(str(row["name"]), str(row["type"]), values, str(row["default"]),
                         " ".join(str(row["changes"]).split()), str(row["cost"])))
    return tuple(out)


def get(name: str) -> Lever:
    for lv in levers():
        if lv.name == name:
            return lv
    raise KeyError(f"no lever {name!r} in {LEVERS_YAML}")


def value(name: str, env: Mapping[str, str]) -> str:
    """The lever's setting in `env` (unset or empty: its default); BadLeverValue otherwise."""
    lv = get(name)
    v = env.get(name)
    if v is None or v == "":
        return lv.default
    if v not in lv.values:
        raise BadLeverValue(f"{name}={v!r} is not a value this lever takes; set it to one of "
                            f"{', '.join(lv.values)} or unset it (default {lv.default}).")
    return v


def flag(name: str, env: Mapping[str, str]) -> bool:
    """A flag lever: True when set to "1"."""
    return value(name, env) == "1"


def format_levers(width: int = 88) -> str:
    """The registry as text for a terminal (`bloomery levers`, `bloomery prepare --help`)."""
    blocks = []
    for lv in levers():
        lines = [f"{lv.name}  ({lv.type}: {' | '.join(lv.values)}; default {lv.default})"]
        for label, text in (("changes", lv.changes), ("cost", lv.cost)):
            lines += textwrap.wrap(text, width, initial_indent=f"  {label}: ",
                                   subsequent_indent=" " * (len(label) + 4))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"

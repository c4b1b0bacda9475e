"""Workload sets: the embedded ones by name, or a JSON file, checked before anything is launched.

A workload file is `{"name": ..., "workloads": [{"name"?, "batch", "prompt", "output"}, ...]}`,
the layout of the platform's public set. Every check raises `UserError` naming the bad value,
because a malformed file must stop the run before any engine process starts.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from fastqwen.errors import UserError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

# Embedded sets, by the name `--workloads` accepts.
NAMED_SETS: dict[str, Path] = {
    "default": DATA_DIR / "cpu_default.json",
    "public": DATA_DIR / "public.json",
}


@dataclass(frozen=True)
class Workload:
    """One fixed shape: `batch` sequences of `prompt` tokens, `output` new tokens each."""

    name: str
    batch: int
    prompt: int
    output: int

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WorkloadSet:
    name: str
    source: str
    workloads: tuple[Workload, ...]


def _positive_int(entry: dict, key: str, where: str) -> int:
    if key not in entry:
        raise UserError(f"{where}: missing field {key!r}")
    value = entry[key]
    # bool is an int subclass in Python; `true` is not a batch size.
    if type(value) is not int:
        raise UserError(f"{where}: {key} must be an integer, got {value!r}")
    if value < 1:
        raise UserError(f"{where}: {key} must be >= 1, got {value}")
    return value


def parse_workloads(data: object, source: str, max_positions: int | None = None) -> WorkloadSet:
    """Check a decoded workload document; `max_positions` bounds prompt + output when given."""
    if not isinstance(data, dict):
        raise UserError(f"workload file {source}: top level must be a JSON object, got {type(data).__name__}")
    entries = data.get("workloads")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"workload file {source}: 'workloads' must be a non-empty list")
    workloads: list[Workload] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"workload file {source}, workload #{i}"
        if not isinstance(entry, dict):
            raise UserError(f"{where}: must be an object, got {entry!r}")
        batch = _positive_int(entry, "batch", where)
        prompt = _positive_int(entry, "prompt", where)
        output = _positive_int(entry, "output", where)
        name = entry.get("name", f"b{batch}-p{prompt}-o{output}")
        if not isinstance(name, str) or not name:
            raise UserError(f"{where}: name must be a non-empty string, got {name!r}")
        if name in seen:
            raise UserError(f"{where}: duplicate workload name {name!r}")
        seen.add(name)
        if max_positions is not None and prompt + output > max_positions:
            raise UserError(
                f"{where} ({name}): prompt {prompt} + output {output} = {prompt + output} exceeds the "
                f"model's max_position_embeddings {max_positions}"
            )
        workloads.append(Workload(name=name, batch=batch, prompt=prompt, output=output))
    set_name = data.get("name", Path(source).stem)
    return WorkloadSet(name=str(set_name), source=source, workloads=tuple(workloads))


def load_workloads(spec: str, max_positions: int | None = None) -> WorkloadSet:
    """Resolve `spec` (an embedded set name or a JSON file path) into a checked workload set."""
    if spec in NAMED_SETS:
        path = NAMED_SETS[spec]
    else:
        path = Path(spec)
        if not path.suffix and not path.exists():
            names = ", ".join(sorted(NAMED_SETS))
            raise UserError(f"unknown workload set {spec!r} (known: {names}; or give a JSON file)")
        if not path.is_file():
            raise UserError(f"workload file {spec} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"workload file {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"workload file {path} cannot be read: {exc}") from None
    return parse_workloads(data, str(path), max_positions)

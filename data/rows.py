"""Training rows in the verl layout, and reading/writing them as JSONL or Parquet with the same columns.

A row: `{"prompt": [{"role", "content"}, ...], "data_source": str, "ability": str,
"reward_model": {"ground_truth": any JSON}, "extra_info": {"index": int, "split": str, ...}}`;
an SFT target lives at `extra_info["target"]`. Rows from a user's verl Parquet files load unchanged:
only `prompt`, `data_source` and `reward_model.ground_truth` are required, other columns are kept as they are."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from data.jsonio import atomic_path, atomic_write_text, check_file, describe, iter_jsonl

ROLES = ("system", "user", "assistant", "tool")
# The column order written to Parquet; any other columns of a user's rows follow in their own order.
COLUMNS = ("prompt", "data_source", "ability", "reward_model", "extra_info")


def make_row(messages: list[dict[str, str]], *, data_source: str, ability: str, ground_truth: str, index: int,
             split: str, **extra_info: Any) -> dict:
    """One row (checked when written); further keyword arguments go to `extra_info` after its index and split."""
    return {"prompt": [dict(message) for message in messages], "data_source": data_source, "ability": ability,
            "reward_model": {"ground_truth": ground_truth},
            "extra_info": {"index": index, "split": split, **extra_info}}


def validate_row(row: Any, where: str) -> None:
    """Raise ValueError naming `where` (file:line or file row N) and the field when `row` is malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object, got {type(row).__name__}")
    if "prompt" not in row:
        raise ValueError(f"{where}: missing field 'prompt'")
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: field 'prompt' must be a non-empty list of messages, got {describe(prompt)}")
    for position, message in enumerate(prompt):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
                message.get("content"), str):
            raise ValueError(f"{where}: field prompt[{position}] must be an object with 'role' (one of {ROLES}) and "
                             f"'content' (a string), got {describe(message)}")
    for key in ("data_source", "ability"):  # verl rows always carry an ability, but nothing here needs it
        if (key in row or key == "data_source") and (not isinstance(row.get(key), str) or not row[key]):
            raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {describe(row.get(key))}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:  # else any JSON, as in verl
        raise ValueError(f"{where}: field 'reward_model' must be an object with a non-null 'ground_truth', "
                         f"got {describe(reward_model)}")
    extra_info = {} if row.get("extra_info") is None else row["extra_info"]
    if not isinstance(extra_info, dict):
        raise ValueError(f"{where}: field 'extra_info' must be an object, got {describe(extra_info)}")
    index = extra_info.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"{where}: field 'extra_info.index' must be an integer, got {describe(index)}")
    target = extra_info.get("target")
    if target is not None and not isinstance(target, (str, list)):  # a list: a multi-turn target (rollout.tools)
        raise ValueError(f"{where}: field 'extra_info.target' must be a string or a list of messages, got "
                         f"{describe(target)}")


def _format_of(path: Path) -> str:
    if path.suffix == ".jsonl":
        return "jsonl"
    if path.suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"{path}: unknown row file type {path.suffix!r}; use .jsonl or .parquet")


def read_rows(path: str | Path) -> list[dict]:
    """All rows of a `.jsonl` or `.parquet` file, each validated; errors name the file and line (or row)."""
    return [row for _, row in numbered_rows(path)]


def numbered_rows(path: str | Path) -> list[tuple[str, dict]]:
    """read_rows with each row's place, "file:line" (JSONL) or "file row N" (Parquet), for later messages."""
    path = Path(path)
    if _format_of(path) == "jsonl":
        numbered = list(iter_jsonl(path))
    else:
        check_file(path)
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
        if not rows:
            raise ValueError(f"{path}: the file has no rows")
        numbered = [(f"{path} row {number}", row) for number, row in enumerate(rows, start=1)]
    for where, row in numbered:
        validate_row(row, where)
    return numbered


def write_rows(rows: list[dict], path: str | Path) -> None:
    """Validate every row, then write them all to `.jsonl` or `.parquet` in one atomic rename. Parquet stores
    `extra_info` as one struct over all rows' keys: a key only some rows have reads back as None in the others."""
    path = Path(path)
    file_format = _format_of(path)
    if not rows:
        raise ValueError(f"{path}: refusing to write an empty row file")
    for number, row in enumerate(rows, start=1):
        validate_row(row, f"row {number} to be written to {path}")
    if file_format == "jsonl":
        atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        return
    names = [name for name in COLUMNS if any(name in row for row in rows)]
    names += sorted({name for row in rows for name in row} - set(COLUMNS))
    try:
        # pa.array infers one struct type over ALL rows (from_pylist would too, but the order is ours).
        table = pa.Table.from_struct_array(pa.array([{name: row.get(name) for name in names} for row in rows]))
        with atomic_path(path) as temporary:
            pq.write_table(table, temporary)
    except pa.ArrowException as error:
        raise ValueError(f"{path}: rows cannot be stored as Parquet columns ({error})") from None

"""Careful JSON input and atomic output: a bad record is reported by its file and line (or array element), and a
failed write leaves no half-written file behind (converters read all their input before writing anything)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

# Far above any prompt a model here can take (~1M tokens of text): a longer line is a corrupt or wrong file.
MAX_LINE_BYTES = 4 * 1024 * 1024


def describe(value: Any) -> str:
    """A value's type and the first 60 characters of its repr, for an error message: `int 4`, `str 'abc'`."""
    return f"{type(value).__name__} {value!r:.60}"


def check_file(path: Path) -> None:
    """FileNotFoundError or ValueError naming the path unless it is a non-empty regular file."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty")


def iter_jsonl(path: str | Path) -> Iterator[tuple[str, dict]]:
    """`(where, object)` for each non-blank line of a JSONL file, `where` being "FILE:LINE" (1-based); ValueError
    naming the file and line for an empty or blank file, binary junk (NUL bytes, invalid UTF-8), a line over
    MAX_LINE_BYTES, invalid JSON or a non-object."""
    path = Path(path)
    check_file(path)
    seen_any = False
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path}:{line_number}"
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{where}: line is {len(raw):,} bytes, over the limit of {MAX_LINE_BYTES:,} "
                                 "(corrupt file, or not JSONL?)")
            if b"\x00" in raw:
                raise ValueError(f"{where}: binary data (NUL byte) where JSON text was expected")
            try:
                text = raw.decode("utf-8-sig")  # -sig: drops a byte-order mark, as some Windows editors write
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: not UTF-8 text (byte {error.start} of the line is "
                                 f"{raw[error.start]:#04x}); is this a binary file?") from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: invalid JSON ({error.msg} at column {error.colno}): "
                                 f"{text.strip()!r:.60}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            seen_any = True
            yield where, record
    if not seen_any:
        raise ValueError(f"{path}: the file has no records (only blank lines)")


def read_json_array(path: str | Path) -> list[tuple[str, dict]]:
    """`(where, object)` per element of a file holding one non-empty JSON array of objects; `where` is
    "FILE element N" (1-based), as read_rows names a Parquet row: a bad record is reported by its place."""
    path = Path(path)
    check_file(path)
    try:
        array = json.loads(path.read_bytes())  # from bytes: UTF-8, with or without a byte-order mark
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: invalid JSON ({error.msg} at column {error.colno})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}); is this a binary file?") from None
    if not isinstance(array, list) or not array:
        raise ValueError(f"{path}: expected a non-empty JSON array of objects, got {describe(array)}")
    records = [(f"{path} element {number}", element) for number, element in enumerate(array, start=1)]
    for where, element in records:
        if not isinstance(element, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(element).__name__}")
    return records


def require(record: dict, key: str, expected: type | tuple[type, ...], where: str) -> Any:
    """`record[key]`, checked to be of the expected type; the error names `where` (file:line) and the key."""
    if key not in record:
        raise ValueError(f"{where}: missing field {key!r}")
    value = record[key]
    types = expected if isinstance(expected, tuple) else (expected,)
    # bool is a subclass of int: a true/false where a number belongs is an error, not 1/0.
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        raise ValueError(f"{where}: field {key!r} must be {' or '.join(t.__name__ for t in types)}, "
                         f"got {describe(value)}")
    return value


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` that replaces it in one rename on success and is removed on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield temporary
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` so that readers see either the old file or the whole new one."""
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


def exit_on_bad_input(status: int = 1) -> Callable[[Callable], Callable]:
    """A command's main(argv) that ends on bad input (ValueError, FileNotFoundError) with `error: MESSAGE` on
    stderr: raised as SystemExit for status 1 (the data commands), else printed and `status` returned (launch's)."""
    def decorate(main: Callable) -> Callable:
        @functools.wraps(main)
        def checked(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except (ValueError, FileNotFoundError) as error:
                if status == 1:
                    raise SystemExit(f"error: {error}") from None
                print(f"error: {error}", file=sys.stderr)
                return status
        return checked
    return decorate

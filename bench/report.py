"""Where a benchmark's numbers go besides the terminal: the JSON file named by its --out."""
from __future__ import annotations

import json
from pathlib import Path


def write_results(path: str | Path, results: dict) -> None:
    """Write `results` to `path` as indented JSON (missing parent directories made) and say so on stdout."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")

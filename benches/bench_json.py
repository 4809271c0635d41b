"""The ``--json PATH`` output every benchmark script shares."""

from __future__ import annotations

import json
from typing import Any


def write_json(path: str | None, data: Any, indent: int = 1) -> None:
    """Writes ``data`` (a benchmark's rows) to ``path`` as JSON; nothing
    when no path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent)

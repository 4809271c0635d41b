"""Small helpers for bytes as text, shared by the CLI, reports and the
Python entry points: rendering them, and reading an argument given as bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int) -> str:
    """``1536`` -> ``'1.50 KiB'``; the same rendering as the Rust core."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024.0
    unit = 0
    while value >= 1024.0 and unit + 1 < len(_UNITS):
        value /= 1024.0
        unit += 1
    if value >= 100:
        return f"{value:.0f} {_UNITS[unit]}"
    if value >= 10:
        return f"{value:.1f} {_UNITS[unit]}"
    return f"{value:.2f} {_UNITS[unit]}"


def byte_count(value: Any, what: str) -> int:
    """`value` as bytes: a positive int, or a size string with its unit
    (``"64GiB"``; the core's one rule, `imp_mem.parse_size`: a string
    without a unit is refused, never read as bytes); else
    `InvalidArgument` naming `what`."""
    from imp_mem import _core
    from imp_mem.errors import InvalidArgument

    if isinstance(value, str):
        try:
            return _core.parse_size(value, what)
        except InvalidArgument as exc:
            number = value.strip()
            if number.isascii() and number.isdigit():
                hint = f"; or pass the int {number} for {number} bytes"
                raise InvalidArgument(f"{exc}{hint}") from None
            raise
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(
            f'{what}: expected bytes (a positive int, or a string such as "64GiB"), got {value!r}'
        )
    return value


def mib(n: int) -> str:
    """Bytes as whole MiB with thousands separators."""
    return f"{n / (1 << 20):,.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned table; the first column left-aligned, the rest right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(len(row))
        ]
        return "  ".join(parts).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)

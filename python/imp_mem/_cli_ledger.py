"""``imp-mem ledger`` (alias ``imp-mem top``): the tenants of each device.

    imp-mem ledger            refreshes every second until interrupted
    imp-mem top --once        prints one table and exits
    imp-mem ledger --json     one JSON document (implies --once)

Every imp-mem process that runs on a device ledger (``Engine(...,
shared=...)``, or ``Backend.attach_ledger``) has a row: its floor (what its
plan always has), cap, committed bytes, KV bytes live, the bytes it asks
the others for, and whether it sleeps. Tenants whose process died are
reaped as the table is read. The tables live in ``$IMP_MEM_LEDGER_DIR``
(default ``/dev/shm/imp-mem-ledger``), or ``--dir``. Ctrl-C ends the
refreshing view (exit status 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from imp_mem._format import human_bytes, table


def register(subparsers: Any) -> None:
    """Adds ``ledger`` and ``top`` (the same command; each its own parser,
    so that ``--help`` shows the name typed) to the ``imp-mem`` command line."""
    for name, help_text in (
        ("ledger", "show the tenants of each device ledger (floor, cap, committed, KV live)"),
        ("top", "the same as ledger"),
    ):
        _add(subparsers, name, help_text)


def _add(subparsers: Any, name: str, help_text: str) -> None:
    p = subparsers.add_parser(
        name,
        help=help_text,
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dir", default=None, help="the ledgers' directory (default: $IMP_MEM_LEDGER_DIR)"
    )
    p.add_argument("--once", action="store_true", help="print once and exit")
    p.add_argument("--json", action="store_true", help="print one JSON document and exit")
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (default 1)"
    )
    p.set_defaults(func=_run)


def snapshot(directory: str | None) -> list[dict[str, Any]]:
    """Every device's ledger: ``{"key", "budget", "tenants": [...]}``."""
    import imp_mem

    out = []
    for key in imp_mem.ledger_devices(directory):
        # The table exists: None takes its budget.
        ledger = imp_mem.DeviceLedger(key, None, directory)
        out.append({"key": key, "budget": ledger.budget, "tenants": ledger.tenants()})
    return out


def render(devices: list[dict[str, Any]], directory: str) -> str:
    """The text ``imp-mem ledger`` prints."""
    if not devices:
        return f"no device ledgers in {directory}"
    parts = []
    for dev in devices:
        tenants = dev["tenants"]
        committed = sum(t["committed"] for t in tenants)
        floors = sum(t["floor"] for t in tenants if t["state"] == "live")
        parts.append(
            f"device {dev['key']}: budget {human_bytes(dev['budget'])}, "
            f"committed {human_bytes(committed)}, floors {human_bytes(floors)}, "
            f"free {human_bytes(max(dev['budget'] - committed, 0))}"
        )
        rows = [
            [
                t["name"],
                t["pid"],
                t["state"],
                human_bytes(t["floor"]),
                human_bytes(t["cap"]),
                human_bytes(t["committed"]),
                human_bytes(t["kv_live"]),
                human_bytes(t["want"]) if t["want"] else "-",
                f"level {t['asleep']}" if t["asleep"] else "no",
            ]
            for t in tenants
        ]
        if rows:
            parts.append(
                table(
                    [
                        "tenant",
                        "pid",
                        "state",
                        "floor",
                        "cap",
                        "committed",
                        "kv live",
                        "wants",
                        "asleep",
                    ],
                    rows,
                )
            )
        else:
            parts.append("  (no tenants)")
    return "\n".join(parts)


def _run(args: argparse.Namespace) -> int:
    import imp_mem

    if not args.interval > 0:
        raise imp_mem.InvalidArgument(f"--interval must be positive, got {args.interval}")
    directory = args.dir if args.dir is not None else imp_mem.ledger_dir()
    if args.dir is not None:
        import os

        if not os.path.exists(args.dir):
            raise imp_mem.InvalidArgument(f"--dir: {args.dir} does not exist")
        if not os.path.isdir(args.dir):
            raise imp_mem.InvalidArgument(f"--dir: {args.dir} is a file, not a directory")
    if args.json:
        print(json.dumps({"dir": directory, "devices": snapshot(args.dir)}, indent=2))
        return 0
    if args.once:
        print(render(snapshot(args.dir), directory))
        return 0
    try:
        while True:
            text = render(snapshot(args.dir), directory)
            # Clear the screen and redraw, as top does.
            sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S  ") + text + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        # Ctrl-C is the documented way out, not an error.
        print()
        return 0

#!/usr/bin/env python3
"""Fails when a tracked file tells the project's history by numbered rounds of work.

The project's history is told by date and issue number ("on 2026-12-05
(issue 25)", "the `boot-fix` run of 2026-12-03"), never by a numbered round
of development work, which a reader of the project never saw. This check
reads every file git tracks (or the paths given on the command line), and
each file's path, and flags the word "session" or "sessions", in any case
and wherever it stands as a word of its own, also glued to a number, a
hyphen or an underscore (as the run logs' old names had it).

Allowed, because they are the word's everyday senses and say so in their
spelling (matched case-insensitively, the flagged word inside the phrase):

- ``scope="session"`` / ``scope='session'``: pytest's fixture scope;
- the word quoted on its own, ``"session"``, ``'session'`` or in backticks:
  a mention of the word (as in this docstring), or a string such as the
  fixture scope above, never a round;
- "HTTP session", "TLS session", "SSH session", "NCCL session",
  "tmux session", "login session", "requests.Session", "aiohttp session",
  "session cookie": the word as a protocol, a terminal or a login uses it.

Files left out, because nobody writes them by hand: ``Cargo.lock``
(cargo's lock file) and trybuild's expected compiler output
(``tests/ui/*.stderr``). Binary files (a NUL byte in their first 8 KiB, or
not UTF-8) are skipped; their paths are still checked.

Usage: ``python3 scripts/check_history.py [PATH ...]`` from the repository
root. With no paths it checks ``git ls-files``. Each offence is printed as
``path:line: text``; the exit status is 1 when any is found, else 0.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

# The word, spelled in two halves so that this file passes its own check.
W = "ses" + "sions?"

# The word itself, not inside a longer word ("ClientSession" is a class
# name, not a round); digits, hyphens and underscores around it still
# count, so the word glued to a number is caught.
WORD = re.compile(rf"(?<![a-z]){W}(?![a-z])", re.IGNORECASE)

# Everyday senses. Each pattern must cover the flagged word for it to pass.
ALLOWED = [
    re.compile(p, re.IGNORECASE)
    for p in (
        rf"""scope\s*=\s*["']{W}["']""",
        rf"""["'`]{W}["'`]""",
        rf"\b(?:https?|tls|ssl|ssh|nccl|tmux|login|aiohttp)\s+{W}\b",
        rf"\brequests\.{W}\b",
        rf"\b{W}\s+cookies?\b",
    )
]

# Generated files: written by a tool, never by hand.
GENERATED = [
    re.compile(r"(^|/)Cargo\.lock$"),
    re.compile(r"(^|/)tests/ui/[^/]+\.stderr$"),
]


def offences_in_line(line: str) -> bool:
    """True when the line names "session" outside every allowed phrase."""
    allowed_spans = [m.span() for p in ALLOWED for m in p.finditer(line)]
    for m in WORD.finditer(line):
        start, end = m.span()
        if not any(a <= start and end <= b for a, b in allowed_spans):
            return True
    return False


def is_generated(path: str) -> bool:
    """True for the files the docstring leaves out (written by a tool)."""
    return any(p.search(path.replace("\\", "/")) for p in GENERATED)


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary or unreadable file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def check(paths: Iterable[str], root: Path) -> Iterator[str]:
    """Yield ``path:line: text`` for every offence in the given paths."""
    for rel in paths:
        if offences_in_line(rel):
            yield f"{rel}:0: (the file's path) {rel}"
        if is_generated(rel):
            continue
        text = read_text(root / rel)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if offences_in_line(line):
                yield f"{rel}:{number}: {line.strip()}"


def tracked_files(root: Path) -> list[str]:
    """Every file git tracks under root."""
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True
    ).stdout
    return [p for p in out.decode("utf-8").split("\0") if p]


def main(argv: list[str]) -> int:
    root = Path.cwd()
    paths = argv or tracked_files(root)
    found = list(check(paths, root))
    for line in found:
        print(line)
    if found:
        print(
            f"{len(found)} line(s) number a round of work: name the date and the issue "
            "instead (see scripts/check_history.py's docstring for the allowed senses)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

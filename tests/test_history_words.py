"""scripts/check_history.py: a numbered round of work is refused, the word's everyday senses pass.

Each test runs the check as CI does (a separate interpreter, the exit
status and the printed lines read back) on a small tree of its own, so the
outcome never depends on the state of the repository's files. The word the
check flags is spelled in halves here, so that this file passes it too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_history.py"
WORD = "ses" + "sion"


def run_check(root: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *paths],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )


def write(root: Path, rel: str, text: str) -> str:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return rel


def test_a_numbered_round_is_reported_with_its_file_line_and_text(tmp_path: Path) -> None:
    offending = f"as measured in {WORD} 28 on the H200"
    rel = write(tmp_path, "docs/notes.md", f"# Notes\n\nThe figure,\n{offending}.\n")
    clean = write(tmp_path, "docs/clean.md", "Measured on 2026-12-05 (issue 25).\n")

    result = run_check(tmp_path, rel, clean)

    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"docs/notes.md:4: {offending}."]
    assert "name the date and the issue" in result.stderr


@pytest.mark.parametrize(
    "line",
    [
        f"the twelfth {WORD}: the first H200 runs",
        f"{WORD.capitalize()} 7, GPU run 3",
        f"docs/gpu-runs/2026-12-03-{WORD}19.log",
        f"a figure of the {WORD}-21 log",
        f"this {WORD}'s device time",
        f"two {WORD}s of work",
        f"{WORD.upper()} 5",
    ],
)
def test_every_spelling_of_a_round_is_caught(tmp_path: Path, line: str) -> None:
    rel = write(tmp_path, "a.txt", line + "\n")
    result = run_check(tmp_path, rel)
    assert result.returncode == 1
    assert result.stdout.strip() == f"a.txt:1: {line}"


def test_the_everyday_senses_pass(tmp_path: Path) -> None:
    lines = [
        f'@pytest.fixture(scope="{WORD}")',
        f"@pytest.fixture(scope='{WORD}')",
        f'the word "{WORD}" is flagged',
        f"an HTTP {WORD} to the registry, an NCCL {WORD}, a tmux {WORD}",
        f"the login {WORD} and its {WORD} cookie",
        f"s = requests.{WORD.capitalize()}()",
        f"async with aiohttp.Client{WORD.capitalize()}() as client:",
        "a round of the benchmark (not a round of work)",
    ]
    rel = write(tmp_path, "ok.py", "\n".join(lines) + "\n")
    result = run_check(tmp_path, rel)
    assert result.returncode == 0, result.stdout
    assert result.stdout == ""


def test_an_allowed_phrase_does_not_cover_a_round_on_the_same_line(tmp_path: Path) -> None:
    line = f'scope="{WORD}" was added in {WORD} 9'
    rel = write(tmp_path, "conftest.py", line + "\n")
    result = run_check(tmp_path, rel)
    assert result.returncode == 1
    assert result.stdout.strip() == f"conftest.py:1: {line}"


def test_generated_and_binary_files_are_left_out_but_their_paths_are_not(tmp_path: Path) -> None:
    lock = write(tmp_path, "Cargo.lock", f"# {WORD} 3 wrote this lock\n")
    ui = write(tmp_path, "crates/x/tests/ui/bad.stderr", f"error: {WORD} 4\n")
    binary = tmp_path / f"docs/figures/shared_gpu_{WORD}19.png"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\0\0" + f"{WORD} 19".encode())
    rel_binary = binary.relative_to(tmp_path).as_posix()

    result = run_check(tmp_path, lock, ui, rel_binary)

    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"{rel_binary}:0: (the file's path) {rel_binary}"]


@pytest.mark.skipif(shutil.which("git") is None, reason="the no-argument mode asks git")
def test_without_paths_it_checks_every_tracked_file_and_only_those(tmp_path: Path) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    tracked = write(tmp_path, "README.md", f"Built in {WORD} 1.\n")
    write(tmp_path, "untracked.md", f"Built in {WORD} 2.\n")
    subprocess.run([*git, "add", tracked], cwd=tmp_path, check=True)

    result = run_check(tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"README.md:1: Built in {WORD} 1."]

    write(tmp_path, "README.md", "Built on 2026-11-30 (issues 2-6).\n")
    assert run_check(tmp_path).returncode == 0

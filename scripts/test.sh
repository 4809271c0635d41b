#!/usr/bin/env bash
# The whole test suite: what CI (.ci/run) and the README run.
#
# Builds the wheel into a fresh virtual environment, then: cargo fmt --check,
# cargo clippy -D warnings, the Rust tests, ruff, the history check
# (scripts/check_history.py), and pytest. Needs Rust, Python 3.11+ and PyPI;
# installs everything else itself.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${IMP_MEM_VENV:-.venv-test}

step() { printf '\n==> %s\n' "$*"; }

step "virtual environment ($VENV)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q \
    "maturin>=1.5,<2" "pytest>=7" "hypothesis>=6.100" "numpy>=1.22" "ruff==0.17.6" \
    "msgpack>=1.0" "msgspec>=0.18" "pyzmq>=25" "prometheus_client>=0.17" \
    "transformers>=4.46" "matplotlib>=3.5" "mypy>=1.18"
# torch runs the reference engine, tensor parallelism (gloo), model swap,
# sleep / wake / weight updates and the torch hooks on the CPU. The wheel
# the registry serves is the CUDA build (about 3 GiB with its NVIDIA
# libraries, some minutes to fetch), and it runs on a CPU. Set
# IMP_MEM_SKIP_TORCH=1 to skip it locally: those modules are then skipped.
if [ "${IMP_MEM_SKIP_TORCH:-0}" != "1" ]; then
    step "torch (CPU tests of the engine; IMP_MEM_SKIP_TORCH=1 skips)"
    "$VENV/bin/python" -m pip install -q "torch==2.15.0" "safetensors>=0.4"
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "Rust tests"
# The binding crate is a Python extension (it links against no libpython), so
# it is tested through pytest below.
cargo test --workspace --exclude imp-mem-py

step "build and install the wheel"
rm -rf target/wheels-test
"$VENV/bin/maturin" build --release --out target/wheels-test
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps target/wheels-test/*.whl

step "ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .

step "history told by date and issue (scripts/check_history.py)"
"$VENV/bin/python" scripts/check_history.py

step "stubtest (the stubs are true)"
# The allowlist names only pyo3's __new__ constructors, its generated
# __all__, and the stubs' own type aliases.
VENV_PYTHON="$(cd "$VENV/bin" && pwd)/python"
(cd tests && "$VENV_PYTHON" -m mypy.stubtest imp_mem._core --allowlist stubtest_allowlist.txt)

step "pytest"
# From the tests folder so the installed wheel, not python/, is imported.
"$VENV/bin/python" -m pytest -p no:cacheprovider tests "$@"

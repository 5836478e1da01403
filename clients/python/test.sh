#!/usr/bin/env bash
# The Python client's tests: strict type checking, then pytest against a running server with the
# extension installed (LEDGER_TEST_HOST, LEDGER_TEST_PORT; user postgres; each test makes its own
# database). pgrx-tests/test.sh calls it; LEDGER_PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")"
py=${LEDGER_PYTHON:-/opt/ledger-venv/bin/python}
: "${LEDGER_TEST_HOST:?}" "${LEDGER_TEST_PORT:?}"
"$py" -m mypy --strict src tests examples bench
PYTHONPATH=src "$py" -m pytest -q -p no:cacheprovider "$@"

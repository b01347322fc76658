#!/usr/bin/env bash
# other-pythons.sh: the C extensions built for every other CPython from 3.12 on
# that this machine has (pyenv's, or those named in KVWIRE_PYTHONS), under the
# tests of their version-dependent code: the native int reads follow CPython's
# own int layout, which changed in 3.12, so each layout runs its tests. Part of
# `make test`. A machine with no such interpreter says so and passes; one that
# has one and fails, fails. Venvs are cached in .venv-py3.N (about 20 s each
# the first time), the build and tests take about 40 s per interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

found=()
if [ -n "${KVWIRE_PYTHONS:-}" ]; then
    read -r -a found <<<"$KVWIRE_PYTHONS"
else
    # The newest patch release of each minor version from 3.12 on.
    for minor in 12 13 14; do
        py="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3."$minor".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)"
        [ -n "$py" ] && found+=("$py")
    done
fi
if [ ${#found[@]} -eq 0 ]; then
    echo "other-pythons: no CPython 3.12+ found (pyenv or KVWIRE_PYTHONS): the 3.11 layout alone was tested"
    exit 0
fi

TESTS=(tests/publisher/test_packed_ints.py tests/publisher/test_collector.py
       tests/publisher/test_native_sender.py tests/prefix_index/test_native.py
       tests/prefix_index/test_apply_payload.py tests/wire)
for py in "${found[@]}"; do
    ver="$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    venv=".venv-py$ver"
    if [ ! -f "$venv/.installed" ]; then
        "$py" -m venv "$venv"
        "$venv/bin/python" -m pip install -q "setuptools>=77" pyzmq msgspec sortedcontainers numpy \
            pytest pytest-timeout hypothesis
        touch "$venv/.installed"
    fi
    # A copy of the tracked tree: its extensions built for this interpreter, the checkout's left alone.
    work="$(mktemp -d)"
    git ls-files -z kvwire tests pyproject.toml | xargs -0 cp --parents -t "$work"
    (cd "$work" && "$ROOT/$venv/bin/python" -c "import setuptools; setuptools.setup()" build_ext --inplace -q \
        >build.log 2>&1) || { cat "$work/build.log"; rm -rf "$work"; exit 1; }
    echo "other-pythons: CPython $("$py" -c 'import platform; print(platform.python_version())')"
    (cd "$work" && PYTHONPATH=. "$ROOT/$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}") \
        || { rm -rf "$work"; exit 1; }
    rm -rf "$work"
done

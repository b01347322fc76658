#!/usr/bin/env bash
# other-pythons.sh: the C extensions built for every other CPython from 3.12 on
# that this machine has (pyenv's, or those named in KVWIRE_PYTHONS), under the
# tests of their version-dependent code: the native int reads follow CPython's
# own int layout, which changed in 3.12, so each layout runs its tests. Part of
# `make test`. A machine with no such interpreter says so and passes; one that
# has one and fails, fails. Venvs are cached in ~/.cache/kvwire/venv-py3.N
# (KVWIRE_CACHE; outside the checkout, so a fresh clone reuses them: about a
# minute each the first time); each build and its tests take about 40 s, the
# interpreters side by side. Properties take 30% of their examples here
# (tests/budget.py): the main run gives them all to the same code.
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

# One interpreter: its venv (cached), the tracked tree copied, built for it, tested.
check() {
    local py="$1" ver venv work
    ver="$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    venv="${KVWIRE_CACHE:-$HOME/.cache/kvwire}/venv-py$ver"
    if [ ! -f "$venv/.installed" ]; then
        if ! { "$py" -m venv "$venv" && "$venv/bin/python" -m pip install -q "setuptools>=77" pyzmq \
                msgspec sortedcontainers numpy pytest pytest-timeout hypothesis; }; then
            echo "other-pythons: SKIPPED CPython $ver: its venv could not be installed (pip's reason above)"
            return 0
        fi
        touch "$venv/.installed"
    fi
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    git ls-files -z kvwire tests pyproject.toml | xargs -0 cp --parents -t "$work"
    cd "$work"
    "$venv/bin/python" -c "import setuptools; setuptools.setup()" build_ext --inplace -q >build.log 2>&1 \
        || { cat build.log; echo "other-pythons: CPython $ver: the build failed"; return 1; }
    echo "other-pythons: CPython $("$py" -c 'import platform; print(platform.python_version())')"
    KVWIRE_EXAMPLES_SCALE=0.3 PYTHONPATH=. "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
}

# Side by side (a core each), each one's output printed whole when it ends.
logs="$(mktemp -d)"
pids=()
for i in "${!found[@]}"; do
    (check "${found[$i]}") >"$logs/$i" 2>&1 &
    pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || status=1
    grep -v "^WARNING: Location" "$logs/$i" || true
done
rm -rf "$logs"
exit $status

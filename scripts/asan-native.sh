#!/usr/bin/env bash
# asan-native.sh PYTHON: rebuild the C extensions with AddressSanitizer and
# UBSan in place, run the tests that drive them (hypothesis feeds them random
# bytes; the publisher's native sender thread runs under the publisher's tests)
# and the short fuzz campaign (a live subscriber fed junk frames), then
# restore the optimised builds. Any memory error aborts the run. `make test`
# runs it first (about 3 min on a 2-core machine). The slowest properties take
# 20% of their examples here (KVWIRE_EXAMPLES_SCALE, tests/budget.py): these
# builds run 3-5x slower, and the main run gives the optimised build them all.
set -euo pipefail
PY="${1:-.venv/bin/python}"
cd "$(dirname "$0")/.."
INC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
SUFFIX="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
SAVE="$(mktemp -d)"
trap 'for m in wire/_pack wire/_scan prefix_index/_core publisher/_sender publisher/_mirror subscriber/_recv; do cp "$SAVE/$(basename $m)$SUFFIX" "kvwire/$m$SUFFIX"; done; rm -rf "$SAVE"' EXIT
for m in wire/_pack wire/_scan prefix_index/_core publisher/_sender publisher/_mirror subscriber/_recv; do
    cp "kvwire/$m$SUFFIX" "$SAVE/"
    # the module's sources as pyproject.toml lists them (one file, or a folder's worth)
    SRC="$("$PY" -c 'import sys, tomllib; m = "kvwire." + sys.argv[1].replace("/", ".")
print(" ".join(next(e["sources"] for e in tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["ext-modules"] if e["name"] == m)))' "$m")"
    # shellcheck disable=SC2086
    gcc -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined \
        -fPIC -shared -I"$INC" $SRC -o "kvwire/$m$SUFFIX"
done
KVWIRE_EXAMPLES_SCALE=0.2 LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONMALLOC=malloc \
    "$PY" -m pytest -q -p no:cacheprovider -n "${JOBS:-2}" tests/publisher/test_packed_ints.py \
    tests/publisher/test_collector.py tests/publisher/test_native_sender.py \
    tests/publisher/test_publisher.py tests/publisher/test_epoch_heartbeat.py \
    tests/publisher/test_snapshot.py tests/publisher/test_native_mirror.py \
    tests/publisher/test_payload_memory.py tests/publisher/test_sender_bursts.py \
    tests/publisher/test_native_replies.py tests/publisher/test_replay_bytes.py tests/wire tests/prefix_index \
    tests/subscriber/test_receive.py tests/subscriber/test_transport_heartbeats.py \
    tests/subscriber/test_check_batch.py tests/subscriber/test_stream_payloads.py \
    tests/integrations/test_native_engine.py \
    "tests/fuzz/test_fuzz_short.py::test_subscriber_and_replay_socket_survive_junk_and_legit_rank_ends_exact"

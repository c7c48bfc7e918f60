#!/usr/bin/env bash
# The one command on the GPU machine (docs/gpu.md), run from the project root with $OUT set:
#
#   bash benchmarks/gpu_one_command.sh           # tests, kernels, compress, decode: ~8.5 of the 10 minutes
#   bash benchmarks/gpu_one_command.sh --tuner   # the second command: the tuner alone, bf16 first
#   OUT=/tmp/o bash benchmarks/gpu_one_command.sh --smoke   # the same steps on a CPU (tests/test_gpu_suite.py)
#
# 1. installs the carried wheels (.whl/, made here by `make gpu-wheels`: the runtime dependencies the GPU
#    machine lacks) into a private folder put on PYTHONPATH, then rana itself, offline and editable;
# 2. writes $OUT/env.txt: the GPU, the versions that matter, the commit, what pip check says;
# 3. runs benchmarks/gpu_suite.py with --deadline DEADLINE (default 480 s) under a hard timeout 25 s
#    later (SIGTERM: the suite still writes its summary; SIGKILL 10 s after that), its output also in
#    $OUT/console.log. Installs (~15 s) + 480 + the guard + packing leave more than 60 s of the 600 s a
#    command may take;
# 4. packs everything the suite wrote into $OUT/gpu_results.tgz, beside gpu_suite.md and, when the tuner
#    ran, the tuned gemv_configs.json: at most 5 files under $OUT (the machine returns at most 8).
#
# --smoke checks the installs without making them (pip --dry-run: the wheels against the machine's
# Python 3.12 on x86-64 Linux, rana's editable build offline) and runs the suite with --smoke.
# Exit code: the suite's (0 when no section failed), or 3 when an install fails.
set -uo pipefail

SMOKE=0
SECTIONS=()
for arg in "$@"; do
    case "$arg" in
        --smoke) SMOKE=1 ;;
        --tuner) SECTIONS=(--only tuner) ;;
        *) echo "usage: $0 [--smoke] [--tuner]" >&2; exit 2 ;;
    esac
done
: "${OUT:?set OUT to the folder whose files come back}"
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-480}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
mkdir -p "$OUT"
RESULTS=$(mktemp -d)
SITE=$(mktemp -d)

# what the GPU machine runs: CPython 3.12 on x86-64 Linux (the platforms `make gpu-wheels` downloads for)
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform any)
if [ "$SMOKE" = 1 ]; then
    DRY=(--dry-run)
    DONE="checked (dry run)"
    SUITE_FLAGS=(--smoke)
else
    DRY=()
    DONE=installed
    SUITE_FLAGS=()
    TARGET=()  # on the machine itself pip reads its own Python and platform
fi

wheels=(.whl/*.whl)
if [ -e "${wheels[0]}" ]; then
    "$PY" -m pip install -q "${DRY[@]}" --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${TARGET[@]}" "${wheels[@]}" || { echo "[one command] installing .whl/ FAILED" >&2; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "[one command] ${#wheels[@]} carried wheels $DONE: ${wheels[*]##*/}"
else
    echo "[one command] no .whl/ (make gpu-wheels): datasets and gguf stay absent; the suite does not need them"
fi
"$PY" -m pip install -q "${DRY[@]}" --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
    || { echo "[one command] installing rana FAILED" >&2; exit 3; }

COMMIT=${RANA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo "unknown: no .git here (set RANA_COMMIT)")}
export RANA_COMMIT="$COMMIT"
{
    echo "commit: $COMMIT"
    nvidia-smi || echo "nvidia-smi: not available"
    "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|accelerate|peft|numpy|setuptools|pyarrow|fsspec|typer|rana) '
    echo "carried (PYTHONPATH): $(ls "$SITE" 2>/dev/null | tr '\n' ' ')"
    "$PY" -m pip check 2>&1 | head -n 40
} > "$OUT/env.txt" 2>&1

timeout -k 10 $((DEADLINE + 25)) "$PY" benchmarks/gpu_suite.py "${SUITE_FLAGS[@]}" "${SECTIONS[@]}" \
    --deadline "$DEADLINE" --results "$RESULTS" 2>&1 | tee "$OUT/console.log"
rc=${PIPESTATUS[0]}

tar czf "$OUT/gpu_results.tgz" -C "$RESULTS" .
if [ "$(stat -c %s "$OUT/gpu_results.tgz")" -gt $((15 * 1024 * 1024)) ]; then  # a file over 16 MiB never comes back
    echo "[one command] the tarball is over 15 MiB: packed again without gpu_suite_logs/" | tee -a "$OUT/console.log"
    tar czf "$OUT/gpu_results.tgz" -C "$RESULTS" --exclude ./gpu_suite_logs .
fi
for f in gpu_suite.md gemv_configs.json; do
    if [ -f "$RESULTS/$f" ]; then cp "$RESULTS/$f" "$OUT/"; fi
done
ls -la "$OUT"
exit "$rc"

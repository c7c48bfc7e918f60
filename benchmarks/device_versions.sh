#!/usr/bin/env bash
# The GPU path's CPU tests under the GPU machine's own versions: `make test-device-versions`.
#
# rana is developed on torch 2.13, but the GPU machine it is measured on has Python 3.12, torch 2.11.0,
# triton 3.6.0, transformers 5.17.0, accelerate 1.15.0 and numpy 2.5, no network, and is lent for
# 15 minutes at a time: an import or an API those versions lack must fail here, not there. This builds
# a venv of its own with those versions (torch 2.11 is published only as its CUDA build, ~3 GB with its
# nvidia-* packages on first use; it imports and runs on a CPU), installs rana into it the way the
# device does (offline-style: --no-deps --no-build-isolation), and runs, in this order:
#
#   1. tests/test_triton_codegen.py: every kernel specialization regenerated as inductor does and
#      compiled for sm_90, and torch's mutation analysis of each kernel;
#   2. the collection of every `-m cuda` test with the interpreter off, under the device's package set
#      (no datasets, gguf, lm-eval: a test module that imports one at top level fails here);
#   3. the Triton interpreter tests (kernels, int8 and expert kernels, grouped decode, the decode ops,
#      the GPU suite's --smoke) and the one command (benchmarks/gpu_one_command.sh) with --smoke.
#      triton 3.6's interpreter turns a 1-element array into an int, which numpy >= 2.4 refuses (the
#      device's numpy 2.5 included), so this step runs under the newest numpy before that
#      (INTERPRETER_NUMPY); the GPU itself never interprets.
#
#   bash benchmarks/device_versions.sh                 # builds .venv-device on first use
#   bash benchmarks/device_versions.sh -x -k int8      # extra arguments go to every pytest run
#   DEVICE_VENV=/tmp/dv PYTHON=python3.12 bash benchmarks/device_versions.sh
#
# The venv is rebuilt when the pins below change; delete it to start over. Exit status: 0 when every
# step passed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${DEVICE_VENV:-.venv-device}
# the device runs Python 3.12: the first of these that runs (a pyenv shim of a version not selected
# does not), else python3
pick_python() {
    local candidates=(python3.12) c
    if command -v pyenv >/dev/null; then candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12); fi
    for c in "${candidates[@]}" python3; do
        if "$c" -c "" 2>/dev/null; then command -v "$c"; return; fi
    done
}
PYTHON=${PYTHON:-$(pick_python)}
# what the GPU machine has (docs/gpu.md); like it, no datasets, gguf or lm-eval
PINS=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0
      tokenizers==0.23.2 huggingface_hub==1.33.0 peft psutil rich typer pyarrow pytest setuptools wheel)
# numpy: the device's 2.5.2 where this Python has it (3.12+), else the newest of the same (>= 2.4) kind
DEVICE_NUMPY=${DEVICE_NUMPY:-$("$PYTHON" -c 'import sys; print("numpy==2.5.2" if sys.version_info >= (3, 12) else "numpy>=2.4")')}
INTERPRETER_NUMPY=${INTERPRETER_NUMPY:-numpy<2.4}

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1
PY="$VENV/bin/python"
STAMP="$VENV/.device-pins"
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfE "$@")
export RANA_DEVICE_VERSIONS=1  # tests/test_gpu_suite.py: the whole one command --smoke runs here, not in make test

build_venv() {
    local want
    want="$("$PYTHON" -V 2>&1) ${PINS[*]} $DEVICE_NUMPY"
    if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
        echo "== $VENV: $(cat "$STAMP")"
        return
    fi
    echo "== building $VENV ($want)"
    "$PYTHON" -m venv "$VENV"
    echo '*' > "$VENV/.gitignore"  # never committed, whatever the project's .gitignore says
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "${PINS[@]}" "$DEVICE_NUMPY"
    # as on the device: the installed packages are kept, rana's own dependencies are not fetched
    "$PY" -m pip install -q --no-deps --no-build-isolation -e .
    echo "$want" > "$STAMP"
}

use_numpy() {  # installs the numpy spec given unless the one there already satisfies it
    "$PY" - "$1" <<'EOF' || "$PY" -m pip install -q "$1"
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
sys.exit(0 if Requirement(sys.argv[1]).specifier.contains(version("numpy")) else 1)
EOF
}

versions() {
    "$PY" - <<'EOF'
import importlib.metadata as md, sys
names = ("torch", "triton", "transformers", "accelerate", "numpy", "peft", "safetensors", "tokenizers")
print("== Python", sys.version.split()[0] + ",", ", ".join(f"{n} {md.version(n)}" for n in names))
EOF
}

FAILED=()
step() {  # step NAME COMMAND...: runs it, records a failure, goes on
    local name=$1
    shift
    echo
    echo "== $name"
    if "$@"; then echo "== $name: pass"; else echo "== $name: FAIL"; FAILED+=("$name"); fi
}

build_venv
use_numpy "$DEVICE_NUMPY"
versions
step "codegen (sm_90, torch's mutation analysis)" "${PYTEST[@]}" tests/test_triton_codegen.py
step "every -m cuda test collects without the interpreter" \
    env TRITON_INTERPRET=0 "${PYTEST[@]}" -m cuda --collect-only tests/

use_numpy "$INTERPRETER_NUMPY"
versions
step "Triton interpreter tests" env TRITON_INTERPRET=1 "${PYTEST[@]}" \
    tests/test_kernels.py tests/test_int8_kernels.py tests/test_decode_groups.py tests/test_decode_ops.py \
    tests/test_cuda_kernels.py tests/test_gpu_decode.py tests/test_bench_kernels_gpu.py \
    tests/test_decode_harness.py tests/test_gpu_suite.py
step "the expert and W8A8 Triton routes under the interpreter" env TRITON_INTERPRET=1 "${PYTEST[@]}" \
    tests/test_moe.py tests/test_w8a8.py -k interpreter
if [[ -f benchmarks/gpu_one_command.sh ]]; then
    one_command_smoke() {  # the GPU machine's one command (docs/gpu.md), --smoke, with this venv's Python
        local out rc=0
        out=$(mktemp -d)
        OUT="$out" PYTHON="$PY" bash benchmarks/gpu_one_command.sh --smoke || rc=$?
        echo "\$OUT:"; ls -l "$out"
        [[ $rc == 0 && -n "$(ls -A "$out")" ]] || rc=1
        rm -rf "$out"
        return "$rc"
    }
    step "the one command, --smoke" one_command_smoke
fi
use_numpy "$DEVICE_NUMPY"  # leave the venv as the device has it

echo
if ((${#FAILED[@]})); then
    printf '== FAILED: %s\n' "${FAILED[@]}"
    exit 1
fi
echo "== every step passed under the device's versions"

#!/usr/bin/env bash
# Every GPU measurement issue 45's targets need, in one command for a short GPU lease:
#
#     bash benchmarks/gpu_session.sh                      # every part
#     bash benchmarks/gpu_session.sh resnet_strict memory # these parts alone
#
# Each part runs under its own time limit, in the order the targets matter, and writes
# $OUT/<part>.txt (the device tool brings back what is under $OUT: at most 8 files); the
# whole run stops starting parts once GPU_SESSION_SECONDS (default 460) have passed, so it ends
# inside an 8-minute lease. The last lines printed are every part's `target:` lines and exit
# status, also in $OUT/summary.txt. Without a GPU every part says its rows were left out, in
# seconds: run it here before a lease, and anything that does not need a GPU fails here.
#
# The parts: settings (the GPU, versions, both sides' precision defaults, then cuDNN's
# convolutions against im2col: errors and times, tests/cudnn_check.py); dispatch (x + 1
# against an empty launch: engine.py --gpu); resnet_strict and resnet_tf32 (ResNet-18 steps at
# batch 16 and 128 against PyTorch eager, each precision in a process of its own); gpt_16bit
# (the small GPT at 12 × 768, sequence 1024, batch 8, in float16 and bfloat16); replay (a hybridized
# forward replayed as a CUDA graph: wall time against GPU time, launches per call); memory
# (a ResNet-18 step's peak: d2lperf's ledger beside torch.cuda.max_memory_allocated).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
BUDGET=${GPU_SESSION_SECONDS:-460}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
# The cuDNN frontend carried as a wheel (.gpu-wheels/, from `tests/gpu_check.py
# --fetch-wheels`), unpacked and put on PYTHONPATH, and cuDNN's runtime where pip put it for
# PyTorch on LD_LIBRARY_PATH: without them every convolution on the GPU is im2col.
eval "$("$PYTHON" tests/gpu_check.py --environment)"
export PYTHONUNBUFFERED=1
START=$SECONDS
STATUS=() PARTS=()
WANTED=" $* "

# part NAME SECONDS COMMAND...: run COMMAND under `timeout` (at most what the budget has
# left), its output to the terminal and to $OUT/NAME.txt.
part() {
    local name=$1 limit=$2 left=$((BUDGET - (SECONDS - START)))
    shift 2
    [[ $WANTED == "  " || $WANTED == *" $name "* ]] || return 0
    if ((left < 15)); then
        echo "== $name: not run, the session's $BUDGET s are spent" | tee "$OUT/$name.txt"
        STATUS+=("$name: not run (budget spent)")
        return
    fi
    ((limit > left)) && limit=$left
    PARTS+=("$OUT/$name.txt")
    echo "== $name (at most $limit s): $*" | tee "$OUT/$name.txt"
    local began=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
    local status=${PIPESTATUS[0]}
    local note="exit $status"
    ((status == 124 || status == 137)) && note="stopped at its $limit s limit"
    STATUS+=("$name: $note, $((SECONDS - began)) s")
}

# The machine, the tree and both sides' precision defaults, for the record.
settings() {
    git log -1 --format='tree: %h %s' 2>/dev/null || echo 'tree: no git here'
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,\
temperature.gpu,utilization.gpu --format=csv 2>&1
    echo "cores: $(nproc)"
    "$PYTHON" -c 'import platform, numpy; print("Python", platform.python_version(),
                                                "NumPy", numpy.__version__)'
    "$PYTHON" -c 'import cupy; print("CuPy", cupy.__version__)' 2>&1 | tail -1
    "$PYTHON" benchmarks/precision.py
}
export -f settings
export PYTHON

part settings 130 bash -c 'settings && "$PYTHON" tests/cudnn_check.py'
part dispatch 45 "$PYTHON" benchmarks/engine.py --gpu
part resnet_strict 110 "$PYTHON" benchmarks/training.py gpu_resnet --precision strict
part gpt_16bit 140 "$PYTHON" benchmarks/training.py gpu_gpt
part replay 90 "$PYTHON" benchmarks/hybridize.py --gpu --calls 100 --repeats 5 --batches 1 64
part memory 45 "$PYTHON" benchmarks/training.py gpu_memory
part resnet_tf32 90 "$PYTHON" benchmarks/training.py gpu_resnet --precision tf32

{
    echo "== summary, $((SECONDS - START)) s in all"
    grep -h '^target' "${PARTS[@]}"
    printf '%s\n' "${STATUS[@]}"
} | tee "$OUT/summary.txt"

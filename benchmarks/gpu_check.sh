#!/usr/bin/env bash
# The whole GPU check in one run, on a machine with a CUDA GPU and torch, triton and transformers
# installed (nothing is downloaded): the kernel tests with Triton compiled for the device (fp32, fp16,
# bf16, fp8 pages, windows, softcap, sinks, GQA, chunked local, in-flight rows), CUDA graphs of decode
# steps (tests/test_cuda_graphs.py: every zoo family's replay equal to its eager step bit for bit, fp32
# and bf16, no host sync in the replay path), the zoo's token-exact greedy tests on CUDA in fp32 (decode
# steps as CUDA graphs, the default there), benchmarks/attention_gpu.py (with the decode kernel's
# bandwidth against a device copy), benchmarks/compile_startup.py and benchmarks/throughput_gpu.py. Logs go
# to OUT_DIR, one per part, and a summary.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]       (default: gpu_check/; $OUT where that is set)
#
# Wheels in .whl/ (say, a newer transformers than the machine has) are installed to /tmp/site first.
# Each part has a time limit, so that one slow part cannot take the others' time; set PARTS to run
# some of them, in the order given. The default (issue 46, within 9 minutes on an H200): "startup"
# (benchmarks/compile_startup.py: patch() of the Gemma-3-1B shape, compiled, cold and warm caches) and
# "throughput" (Gemma-3-1B and Llama-3.2-1B shapes, the mixed workload: hybridkv's defaults, compile=False,
# and transformers' static-cache compiled generate). Also: "kernels graphs zoo attention", and
# "profile" (where a decode step's time goes, benchmarks/profile_gpu_step.py, PROFILE_ARGS); THROUGHPUT_ARGS
# for throughput_gpu.py's arguments, and KERNELS_SECONDS, GRAPHS_SECONDS, ... for a part's limit.
set -u -o pipefail
out=${1:-${OUT:-gpu_check}}
mkdir -p "$out"
parts=${PARTS:-startup throughput}
throughput_args=${THROUGHPUT_ARGS:---models gemma3,llama --workloads mixed --requests 128 --systems hybridkv,hybridkv_nocompile,generate_static}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 ||
    { echo "install failed:"; tail -20 "$out/install.log"; exit 1; }
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} | tee "$out/summary.txt"

run_part() { # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s; $(grep -E '(passed|failed|error)' "$out/$name.log" | tail -1)" |
        tee -a "$out/summary.txt"
}

gpu_tests=(env HYBRIDKV_TEST_ON_GPU=1 python3 -m pytest -q -p no:cacheprovider -n 8)
for part in $parts; do
    case $part in
    kernels) run_part kernels "${KERNELS_SECONDS:-180}" "${gpu_tests[@]}" tests/test_kernels_attention.py tests/test_kernels_in_flight.py \
        tests/test_kernels_fp8.py tests/test_kernels_backend.py ;;
    graphs) run_part graphs "${GRAPHS_SECONDS:-240}" "${gpu_tests[@]}" tests/test_cuda_graphs.py ;;
    zoo) run_part zoo "${ZOO_SECONDS:-170}" "${gpu_tests[@]}" tests/test_patch_equivalence.py -k "default_settings or chunked_prefill or prefix_cache" ;;
    attention) run_part attention "${ATTENTION_SECONDS:-60}" python3 benchmarks/attention_gpu.py ;;
    startup) run_part startup "${STARTUP_SECONDS:-150}" python3 benchmarks/compile_startup.py --model gemma3_1b ;;
    throughput) run_part throughput "${THROUGHPUT_SECONDS:-360}" python3 benchmarks/throughput_gpu.py $throughput_args ;;
    profile) run_part profile "${PROFILE_SECONDS:-120}" python3 benchmarks/profile_gpu_step.py ${PROFILE_ARGS:-} ;;
    *) echo "unknown part $part" ;;
    esac
done
for log in "$out"/*.log; do
    echo "== $log (tail)"
    tail -25 "$log"
done

#!/usr/bin/env bash
# The whole GPU check in one run, on a machine with a CUDA GPU and torch, triton and transformers
# installed (nothing is downloaded). Logs go to OUT_DIR, one per part, and a summary.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]       (default: gpu_check/; $OUT where that is set)
#
# Wheels in .whl/ are installed to /tmp/site first: py-spy for the "hoststacks" part (get it with
# `pip download py-spy --no-deps --only-binary=:all: -d .whl`; .whl/ is ignored by git, so the device tool
# must carry it), or a newer transformers than the machine has. Each part has a time limit, so that one slow
# part cannot take the others' time; set PARTS to run some of them, in the order given.
#
# The default (issues 47 and 49, meant for one call of at most 9 minutes on an H200; no GPU has run it yet, so the
# limits are estimates):
#   tests47     the split-KV decode kernel compiled for the device (tests/test_kernels_split.py) and the
#               async-scheduling twin-engine test on CUDA (graphs, pinned copies; tests/test_async_scheduling.py)
#   attention   benchmarks/attention_gpu.py: the kernels against SDPA, the decode kernel's bandwidth, and split-KV
#               decode at 64 x 2,048 tokens by the profiler's kernel time against a device copy
#   profile     benchmarks/profile_gpu_step.py (PROFILE_ARGS, default the Gemma-3-1B shape at 64 running): a
#               decode step's wall time, the GPU's busy share of it, host time by part
#   latent      issue 49: tests/test_latent_attention.py on the device (the Triton decode kernel for latent attention
#               against the torch path, DeepSeek-V2 on the Triton backend against generate), the latent families'
#               CUDA graphs (tests/test_cuda_graphs.py: replay against the eager step bit for bit) and
#               benchmarks/latent_attention.py --speed-only --device cuda (decode against generate, absorbed and expanded)
#   throughput  benchmarks/throughput_gpu.py (THROUGHPUT_ARGS): Gemma-3-1B and Llama-3.2-1B shapes, 128 mixed
#               prompts; hybridkv's defaults, async_scheduling=False, transformers' static-cache compiled
#               generate and its plain generate (the two baselines' bf16 agreement is the yardstick)
# Other parts: "speculative" (issue 50: tests/test_speculative.py on the device and benchmarks/speculative.py --device
# cuda, which first trains its 12-layer copy model on the device), "hoststacks" (py-spy over the profile's steps without the torch profiler, summarised by
# benchmarks/host_profile.py --every-step), "kernels graphs zoo" (the kernel, CUDA-graph and zoo tests on the device), "startup"
# (benchmarks/compile_startup.py, issue 46), "rl" (issue 51: benchmarks/rl_rollouts.py --device cuda, GRPO's
# generation time through hybridkv, transformers' continuous batching and generate; needs trl and datasets with
# their dependencies in .whl/: `pip download trl -d .whl`), "lora" (issue 65: LoRA's Triton kernels on the device,
# tests/test_triton_lora.py and tests/test_lora.py's tests through the kernels, then benchmarks/multi_lora.py --device
# cuda where the checkout's script takes --device; else a line says it was skipped), "sleep" (issue 63: sleep levels 1
# and 2 giving back the weights of a model LLM(model=path) loaded on the GPU, and the graphs captured again when both
# the weights and the KV cache are awake: tests/test_vllm_entrypoints.py), "pooling" (issue 63: benchmarks/pooling.py on
# the device, the GPU's default batch budget of 8,192 tokens against transformers' forward). KERNELS_SECONDS, GRAPHS_SECONDS,
# ... set a part's limit.
set -u -o pipefail
out=${1:-${OUT:-gpu_check}}
mkdir -p "$out"
parts=${PARTS:-tests47 latent attention profile throughput}
throughput_args=${THROUGHPUT_ARGS:---models gemma3,llama --workloads mixed --requests 128 --systems hybridkv,hybridkv_sync,generate_static,generate}
profile_args=${PROFILE_ARGS:---model gemma3 --running 64}
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
    tests47) run_part tests47 "${TESTS47_SECONDS:-90}" "${gpu_tests[@]}" tests/test_kernels_split.py tests/test_async_scheduling.py ;;
    kernels) run_part kernels "${KERNELS_SECONDS:-180}" "${gpu_tests[@]}" tests/test_kernels_attention.py tests/test_kernels_in_flight.py \
        tests/test_kernels_fp8.py tests/test_kernels_backend.py ;;
    graphs) run_part graphs "${GRAPHS_SECONDS:-240}" "${gpu_tests[@]}" tests/test_cuda_graphs.py ;;
    zoo) run_part zoo "${ZOO_SECONDS:-170}" "${gpu_tests[@]}" tests/test_patch_equivalence.py -k "default_settings or chunked_prefill or prefix_cache" ;;
    latent) run_part latent "${LATENT_SECONDS:-100}" bash -c "env HYBRIDKV_TEST_ON_GPU=1 python3 -m pytest -q \
        -p no:cacheprovider -n 4 tests/test_latent_attention.py && env HYBRIDKV_TEST_ON_GPU=1 python3 -m pytest -q \
        -p no:cacheprovider -n 4 tests/test_cuda_graphs.py -k 'latent or deepseek or minicpm3' && python3 benchmarks/latent_attention.py --speed-only \
        --device cuda --requests 32" ;;
    speculative) run_part speculative "${SPECULATIVE_SECONDS:-150}" bash -c "env HYBRIDKV_TEST_ON_GPU=1 python3 -m \
        pytest -q -p no:cacheprovider -n 4 tests/test_speculative.py && python3 benchmarks/speculative.py --device cuda \
        --cache /tmp/hybridkv-bench --rounds 3" ;;
    sleep) run_part sleep "${SLEEP_SECONDS:-60}" "${gpu_tests[@]}" tests/test_vllm_entrypoints.py -k "sleep or wake or reload" ;;
    pooling) run_part pooling "${POOLING_SECONDS:-90}" python3 benchmarks/pooling.py --device cuda --prompts 512 --hidden 1024 \
        --layers 8 --repeats 3 ;;
    rl) run_part rl "${RL_SECONDS:-150}" python3 benchmarks/rl_rollouts.py --device cuda --prompts 16 --new 128 ;;
    lora) run_part lora "${LORA_SECONDS:-150}" bash -c "env HYBRIDKV_TEST_ON_GPU=1 python3 -m pytest -q -p no:cacheprovider \
        -n 4 tests/test_triton_lora.py tests/test_lora.py -k 'triton or kernels' && if grep -qs -- '\"--device\"' \
        benchmarks/multi_lora.py; then python3 benchmarks/multi_lora.py --device cuda; else echo 'lora benchmark skipped: \
        benchmarks/multi_lora.py is missing or takes no --device in this checkout'; fi" ;;
    attention) run_part attention "${ATTENTION_SECONDS:-50}" python3 benchmarks/attention_gpu.py --repeats 20 ;;
    startup) run_part startup "${STARTUP_SECONDS:-150}" python3 benchmarks/compile_startup.py --model gemma3_1b ;;
    throughput) run_part throughput "${THROUGHPUT_SECONDS:-240}" python3 benchmarks/throughput_gpu.py $throughput_args ;;
    profile) run_part profile "${PROFILE_SECONDS:-70}" python3 benchmarks/profile_gpu_step.py $profile_args ;;
    hoststacks) run_part hoststacks "${HOSTSTACKS_SECONDS:-60}" bash -c "/tmp/site/bin/py-spy record --rate 500 \
        --format raw -o '$out/host_stacks.txt' -- python3 benchmarks/profile_gpu_step.py $profile_args --steps-only \
        --steps 200 && python3 benchmarks/host_profile.py --aggregate '$out/host_stacks.txt' --every-step" ;;
    *) echo "unknown part $part" ;;
    esac
done
for log in "$out"/*.log; do
    echo "== $log (tail)"
    tail -25 "$log"
done

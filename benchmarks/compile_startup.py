"""How long a user waits for compiled tokens: `patch(compile=True)` to the first tokens, cold and warm.

For a tiny Gemma 3 (fp32, random weights, on the CPU) of each depth in --layers, or with --model a published
shape on the GPU (`gemma3_1b`, `llama_1b` from benchmarks/throughput_gpu.py, bf16, where `patch` also captures
CUDA graphs of the decode buckets), in fresh processes:

* cold: empty hybridkv and inductor caches (`HYBRIDKV_CACHE_DIR`, `TORCHINDUCTOR_CACHE_DIR` in a new temporary
  folder): the forward is traced, split and its distinct pieces compiled;
* warm: a second process on the same caches: the program is loaded from disk;
* eager: `compile=False`, for scale;

each the seconds from `patch()` to the first generate's end (4 prompts, 8 new tokens), with the time its trace
and its compile took (the engine's stats). Prints the ratios the issue asks for: the deepest model's cold time
over the shallowest's, and each depth's warm time over its cold one.

    python benchmarks/compile_startup.py                 # 6 and 26 layers: about 2 minutes on 2 CPU cores
    python benchmarks/compile_startup.py --layers 6,26 --repeats 2
    python benchmarks/compile_startup.py --model gemma3_1b        # on a GPU (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent(
    """
    import json, sys, time, torch
    import hybridkv
    from hybridkv import SamplingParams
    from hybridkv.tiny import tiny_model
    torch.set_num_threads(int(sys.argv[3]))
    if sys.argv[4] == "tiny":
        model = tiny_model("gemma3", num_hidden_layers=int(sys.argv[1]))
        settings = dict(max_model_len=256, block_size=8)
    else:
        sys.path.insert(0, sys.argv[5])
        from throughput_gpu import MODELS
        model = MODELS[sys.argv[4].removesuffix("_1b")]()
        settings = dict(max_model_len=4096, max_num_seqs=128)
    prompts = [[1, 2, 3, 4, 5, 6, 7], list(range(10, 40)), [7], list(range(50, 120))]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    start = time.perf_counter()
    llm = hybridkv.patch(model, compile=sys.argv[2] == "1", use_tqdm=False, **settings)
    sync()
    patched = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    sync()
    stats = llm.stats()
    print(json.dumps({
        "seconds": time.perf_counter() - start, "patch": patched - start, "from": stats["compiled_from"],
        "trace": stats["compile_trace_seconds"], "compile": stats["compile_seconds"],
        "load": stats["compile_load_seconds"],
    }))
    """
)


def run(layers: int, compiled: bool, cache: str, threads: int, model: str) -> dict:
    env = {**os.environ, "HYBRIDKV_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor")}
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(layers), "1" if compiled else "0", str(threads), model, here],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="6,26")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--model", default="tiny", choices=["tiny", "gemma3_1b", "llama_1b"])
    args = parser.parse_args()
    depths = [int(x) for x in args.layers.split(",")] if args.model == "tiny" else [0]
    cold: dict[int, list[float]] = {d: [] for d in depths}
    warm: dict[int, list[float]] = {d: [] for d in depths}
    for repeat in range(args.repeats):
        for layers in depths:
            cache = tempfile.mkdtemp(prefix="hybridkv-startup-")
            first = run(layers, True, cache, args.threads, args.model)
            second = run(layers, True, cache, args.threads, args.model)
            eager = run(layers, False, cache, args.threads, args.model)
            assert first["from"] == "traced" and second["from"] == "disk", (first, second)
            cold[layers].append(first["seconds"])
            warm[layers].append(second["seconds"])
            print(
                f"{args.model} repeat {repeat} layers {layers:3}: cold {first['seconds']:6.1f} s (patch "
                f"{first['patch']:.1f}: trace {first['trace']:.1f}, compile {first['compile']:.1f}), warm "
                f"{second['seconds']:5.1f} s (patch {second['patch']:.1f}: load {second['load']:.1f}), eager "
                f"{eager['seconds']:5.1f} s (patch {eager['patch']:.1f})",
                flush=True,
            )
    if args.model != "tiny":
        return
    shallow, deep = min(depths), max(depths)
    median = {d: (statistics.median(cold[d]), statistics.median(warm[d])) for d in depths}
    print(f"\ncold, {deep} layers / {shallow} layers: {median[deep][0] / median[shallow][0]:.2f}x (target <= 1.5x)")
    for layers in depths:
        print(f"warm / cold, {layers} layers: {median[layers][1] / median[layers][0]:.2f}x (target <= 0.2x)")


if __name__ == "__main__":
    main()

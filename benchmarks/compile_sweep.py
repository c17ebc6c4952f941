"""Every zoo family (tests/model_zoo.py) compiled: are compiled tokens eager tokens, and what does compiling cost?

For each family without state layers: greedy tokens (fp32, 8 new tokens, prompts of 7, 33 and 70 random ids)
with `compile=False`, then with `compile=True` (traced, split at attention, distinct pieces compiled by
inductor; hybridkv/execution/compilation.py) in a fresh cache directory. Each family ends as one of:

* exact: every compiled token equal to eager's;
* differ: a token differs (the first differing request, index and eager's top-2 logit gap are printed: inductor
  may sum in another order, a near tie can flip);
* cannot compile: patch with compile=True raised ValueError (the cause is printed);
* error: any other exception.

with the seconds tracing and compiling took and the pieces (distinct/all).

    python benchmarks/compile_sweep.py                       # every family: about 20 minutes on 2 CPU cores
    python benchmarks/compile_sweep.py --families llama,gemma3_text --json /tmp/compile_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import hybridkv
from hybridkv import SamplingParams

from model_zoo import STATE, ZOO

PARAMS = SamplingParams(temperature=0, max_tokens=8)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (length,), generator=generator).tolist() for length in (7, 33, 70)]


def sweep_one(name: str) -> dict[str, object]:
    model = ZOO[name]()
    batch = prompts()
    eager = hybridkv.patch(model, block_size=8, max_model_len=256, compile=False)
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, PARAMS, use_tqdm=False)]
    hybridkv.unpatch(model)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = hybridkv.patch(model, block_size=8, max_model_len=256, compile=True, use_tqdm=False)
    except ValueError as exc:
        return {"result": "cannot compile", "why": str(exc).splitlines()[0][:300]}
    seconds = time.perf_counter() - start
    stats = llm.stats()
    program = llm.core.runner.compiled.program
    pieces = sum(1 for call in program.spec.calls if hasattr(call, "piece"))
    got = [o.outputs[0].token_ids for o in llm.generate(batch, PARAMS, use_tqdm=False)]
    hybridkv.unpatch(model)
    row: dict[str, object] = {
        "patch_seconds": round(seconds, 1),
        "trace_seconds": round(stats["compile_trace_seconds"], 1),
        "compile_seconds": round(stats["compile_seconds"], 1),
        "pieces": f"{len(program.pieces)}/{pieces}",
    }
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            first = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            row.update(result="differ", request=index, token=first)
            return row
    row["result"] = "exact"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="", help="comma-separated zoo names (default: every one)")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    names = args.families.split(",") if args.families else sorted(ZOO.keys() - STATE.keys())
    os.environ["HYBRIDKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="hybridkv-sweep-")
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    rows = {}
    for name in names:
        try:
            rows[name] = sweep_one(name)
        except Exception as exc:
            rows[name] = {"result": "error", "why": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        print(f"{name:28} {json.dumps(rows[name])}", flush=True)
    counts: dict[str, int] = {}
    for row in rows.values():
        counts[str(row["result"])] = counts.get(str(row["result"]), 0) + 1
    print("summary:", json.dumps(counts))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

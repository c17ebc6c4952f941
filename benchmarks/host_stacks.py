"""Where the host's time goes, from py-spy's raw (collapsed) stacks: the functions with the most samples on top
of the stack (self) and anywhere in it (inclusive), as shares of the samples inside `LLMEngine.step`.

    py-spy record --rate 500 --format raw -o stacks.txt -- python benchmarks/profile_gpu_step.py --steps-only
    python benchmarks/host_stacks.py stacks.txt [--top 25]

benchmarks/gpu_check.sh's "hoststacks" part runs both on the GPU machine (py-spy comes as a wheel in .whl/).
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stacks")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--within", default="step (hybridkv/engine.py", help="count only stacks through this frame")
    args = parser.parse_args()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.stacks) as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or args.within not in stack:
                continue
            samples = int(count)
            frames = stack.split(";")
            total += samples
            own[frames[-1]] += samples
            for frame in set(frames):
                inclusive[frame] += samples
    if not total:
        raise SystemExit(f"no stack passes through {args.within!r}")
    print(f"{total} samples inside {args.within!r}")
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"\n{title}:")
        for frame, samples in counter.most_common(args.top):
            print(f"  {samples / total:6.1%}  {frame}")


if __name__ == "__main__":
    main()

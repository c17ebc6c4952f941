"""What a Python function costs a step when it is entered cold: after a forward has evicted its code and data.

An engine step's host work runs between two forwards, and a forward reads megabytes of weights and activations: the
step meets its own functions' code objects, frames and data in no cache. This times, after a 64 MiB read that does
the same eviction, a call that enters no Python function (`time.perf_counter`), one trivial Python function, a chain of
eight trivial functions each calling the next (eight code objects), and the same eight calls warm; and, warm, a loop
of about 100 bytecodes. Printed: medians over the repeats and what each cold function adds.

    python benchmarks/cold_calls.py [--repeats 400]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def f0() -> None:
    return None


def f1() -> None:
    return f0()


def f2() -> None:
    return f1()


def f3() -> None:
    return f2()


def f4() -> None:
    return f3()


def f5() -> None:
    return f4()


def f6() -> None:
    return f5()


def f7() -> None:
    return f6()


def loop() -> int:
    """About 100 bytecodes: 12 rounds of a few additions."""
    total = 0
    for index in range(12):
        total += index + 1
    return total


def median_seconds(call, evict: np.ndarray | None, repeats: int) -> float:
    """The median time of `call`, after reading all of `evict` (None: warm, the call made just before)."""
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.sum()
        else:
            call()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=400)
    args = parser.parse_args()
    evict = np.ones(64 * 2**20 // 8)
    figures = {
        "a C call (time.perf_counter), cold": median_seconds(time.perf_counter, evict, args.repeats),
        "one Python function, cold": median_seconds(f0, evict, args.repeats),
        "eight Python functions in a chain, cold": median_seconds(f7, evict, args.repeats),
        "eight Python functions in a chain, warm": median_seconds(f7, None, args.repeats),
        "about 100 bytecodes in one function, warm": median_seconds(loop, None, args.repeats),
    }
    for what, seconds in figures.items():
        print(f"{what:<45} {seconds * 1e6:7.2f} us")
    c_call = figures["a C call (time.perf_counter), cold"]
    chain = figures["eight Python functions in a chain, cold"]
    print(f"each cold Python function adds about {(chain - c_call) / 8 * 1e6:.2f} us")


if __name__ == "__main__":
    main()

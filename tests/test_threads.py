"""The torch threads an engine's steps run with (hybridkv/execution/cpu_threads.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

import hybridkv
from hybridkv.execution.cpu_threads import SAMPLE_SECONDS, StepThreads, read_proc_stat, threads_for
from hybridkv.kernels import cpu_decode
from hybridkv.tiny import tiny_model


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("num_cores", "others", "cap", "expected"),
    [(2, 0.0, 2, 2), (2, 0.3, 2, 2), (2, 1.0, 2, 1), (2, 2.0, 2, 1), (8, 2.6, 8, 5), (8, 0.0, 4, 4), (16, 0.2, 16, 16)],
)
def test_steps_get_the_cores_other_processes_leave(num_cores, others, cap, expected):
    assert threads_for(num_cores, others, cap) == expected


class FakeMachine:
    """/proc/stat as a script: every reading adds `others` busy cores (and this process's `ours`)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = self.ours_seconds = 0.0
        self.others = 0.0
        self.ours = 1.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.busy += (self.others + self.ours) * seconds
        self.ours_seconds += self.ours * seconds

    def read(self):
        return self.busy, self.ours_seconds


def _threads_in_a_step(threads: StepThreads) -> int:
    with threads:
        return torch.get_num_threads()


def test_auto_drops_to_the_free_cores_and_comes_back(two_torch_threads):
    machine = FakeMachine()
    threads = StepThreads("auto", read=machine.read, clock=lambda: machine.now)
    threads.num_cores = 2
    assert _threads_in_a_step(threads) == 2
    machine.others = 1.0  # a neighbour spins on one core
    machine.advance(SAMPLE_SECONDS)
    assert _threads_in_a_step(threads) == 1
    assert threads.others_busy_cores == pytest.approx(1.0)
    assert torch.get_num_threads() == 2  # torch's own setting between steps
    machine.others = 0.0
    machine.advance(SAMPLE_SECONDS / 2)
    assert _threads_in_a_step(threads) == 1  # not sampled again yet
    machine.advance(SAMPLE_SECONDS)
    assert _threads_in_a_step(threads) == 2


def test_this_process_own_cpu_time_is_not_counted_as_a_neighbour(two_torch_threads):
    machine = FakeMachine()
    machine.ours = 2.0
    threads = StepThreads("auto", read=machine.read, clock=lambda: machine.now)
    threads.num_cores = 2
    machine.advance(SAMPLE_SECONDS)
    assert _threads_in_a_step(threads) == 2
    assert threads.others_busy_cores == pytest.approx(0.0)


def test_auto_without_proc_stat_keeps_torchs_count(two_torch_threads):
    threads = StepThreads("auto", read=lambda: None, clock=iter(range(100)).__next__)
    assert [_threads_in_a_step(threads) for _ in range(3)] == [2, 2, 2]


def test_a_count_fixes_the_steps_threads_and_none_leaves_torch_alone(two_torch_threads):
    assert _threads_in_a_step(StepThreads(1)) == 1
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert _threads_in_a_step(StepThreads(None)) == 1


def test_the_engine_runs_its_forward_on_the_configured_threads(two_torch_threads):
    model = tiny_model("gemma3")
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    llm = hybridkv.patch(model, cpu_threads=1)
    seen.clear()  # the probe forward of patch
    llm.generate([[5, 6, 7, 8]], hybridkv.SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
    assert llm.stats()["step_threads"] == 1
    assert llm.stats()["cpu_decode_kernel"] is cpu_decode.available() is True  # this machine has a compiler
    hybridkv.unpatch(model)


@pytest.mark.parametrize(("value", "error"), [("many", ValueError), (0, ValueError), (1.5, TypeError)])
def test_cpu_threads_must_be_auto_a_count_or_none(value, error):
    with pytest.raises(error, match="cpu_threads"):
        hybridkv.EngineConfig(cpu_threads=value)


def test_proc_stat_readings_grow_with_time():
    first = read_proc_stat()
    assert first is not None  # Linux
    sum(i * i for i in range(200_000))
    second = read_proc_stat()
    assert second[0] >= first[0] and second[1] >= first[1]


def test_serve_takes_cpu_threads_as_auto_or_a_count():
    from hybridkv.engine.arg_utils import cpu_threads_flag

    assert cpu_threads_flag("auto") == "auto"
    assert cpu_threads_flag("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="'auto' or a thread count"):
        cpu_threads_flag("many")

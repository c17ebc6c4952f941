import subprocess
import sys


def test_demo_runs_and_reports_memory_and_prefix_hits():
    result = subprocess.run(
        [sys.executable, "-m", "hybridkv", "demo", "--requests", "3"], capture_output=True, text=True, check=True
    )
    assert "groups: 7 of 4 layers, 2 padding slots" in result.stdout
    assert "req-1:" in result.stdout and "1024 from the prefix cache" in result.stdout
    assert "prefix cache: 2048 of" in result.stdout

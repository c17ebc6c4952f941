"""A `hybridkv serve` started as a subprocess by a test: waiting until it answers."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_for_health(process: subprocess.Popen, port: int, seconds: float) -> None:
    """Return once the server on 127.0.0.1:`port` answers /health with 200; fail with the end of its output if the
    process exits first, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, (process.stdout or process.stderr).read()[-4000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the server did not start within {seconds:g} s"
        time.sleep(0.2)

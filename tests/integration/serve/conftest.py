"""Fixtures for HTTP tests: real servers on loopback, each in its own subprocess.

``launch_server(*flags, harness=False)`` starts ``rlt-server serve`` (or the test harness, which is
the same CLI plus a test-only feature) on a free 127.0.0.1 port and waits for ``/health``;
teardown sends SIGTERM and waits. ``tiny_server`` is one shared server per test session (per
xdist worker) on a tiny random checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, argv: list[str], logdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stdout_path = logdir / f"server-{self.port}.out"
        self.stderr_path = logdir / f"server-{self.port}.err"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        self._out = open(self.stdout_path, "w")
        self._err = open(self.stderr_path, "w")
        self.proc = subprocess.Popen([*argv, "--port", str(self.port)], stdout=self._out, stderr=self._err, env=env)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.stderr[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.stderr[-4000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
        self._err.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def launch_server(tmp_path_factory):
    started: list[ServerProcess] = []
    logdir = tmp_path_factory.mktemp("serverlogs")

    def launch(*flags: str, harness: bool = False, wait: bool = True) -> ServerProcess:
        entry = [sys.executable, str(HERE / "harness.py")] if harness else [sys.executable, "-m", "rlt_server.cli"]
        server = ServerProcess([*entry, "serve", *flags], logdir)
        started.append(server)
        return server.wait_ready() if wait else server

    yield launch
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    return tiny_checkpoint(seed=11, thinking=True)


#: engine flags of the shared server; tests computing offline references use the same
TINY_ENGINE = dict(num_kv_blocks=4096, max_num_seqs=64)


@pytest.fixture(scope="session")
def tiny_server(launch_server, tiny_model):
    return launch_server("--model", str(tiny_model), "--served-model-name", "tiny", "--dtype", "float32",
                         "--num-kv-blocks", str(TINY_ENGINE["num_kv_blocks"]),
                         "--max-num-seqs", str(TINY_ENGINE["max_num_seqs"]), "--max-body-bytes", "65536",
                         "--log-level", "warning")


def scrape(url: str) -> dict[str, float]:
    """``GET /metrics`` as {sample line without value: value}."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def wait_for(pred, timeout: float = 20.0, interval: float = 0.05):
    """Poll ``pred()`` until it returns a truthy value (returned) or the deadline passes (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return None


def word_prompt(i: int) -> str:
    """The ``i``-th prompt of the load tests: 1-7 words of a small vocabulary, then ``i``."""
    words = ["loop", "depth", "token", "the", "fox", "batch", "exit", "gate"]
    return " ".join(words[(i + k) % len(words)] for k in range(1 + i % 7)) + f" {i}"

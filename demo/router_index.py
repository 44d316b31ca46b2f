"""A real router index for the tests and the demo: Dynamo's standalone KV indexer
(``python -m dynamo.indexer``, PyPI ``ai-dynamo-runtime``), run from its own small venv
(``.venv-router``, made by scripts/setup.sh: it pins a pydantic older than vLLM's),
subscribed to one engine's KV-events publisher, and asked over HTTP (``POST /query``).
Stopped by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from testsupport.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
ROUTER_PYTHON = Path(os.environ.get("LMCTL_ROUTER_PYTHON", str(ROOT / ".venv-router" / "bin" / "python")))



class Indexer:
    """``python -m dynamo.indexer`` on a free loopback HTTP port, subscribed to worker
    ``worker_id`` at ``zmq`` (the engine binds it; the indexer may start first)."""

    def __init__(self, folder: Path, zmq: str, block_size: int, model_name: str = "m", worker_id: int = 1) -> None:
        if not ROUTER_PYTHON.exists():
            raise RuntimeError(f"{ROUTER_PYTHON} is missing: run scripts/setup.sh (it makes .venv-router with "
                               "ai-dynamo-runtime)")
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.model_name = model_name
        self.worker_id = worker_id
        self.log_path = folder / f"indexer-{self.port}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        env = {**os.environ, "NO_COLOR": "1"}
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [str(ROUTER_PYTHON), "-m", "dynamo.indexer", "--port", str(self.port), "--block-size", str(block_size),
             "--workers", f"{worker_id}={zmq}", "--model-name", model_name, "--threads", "1"],
            stdout=log, stderr=log, env=env)
        log.close()
        self._wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the indexer exited: {self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    pass
                # its ZMQ listener connects right after the HTTP server is up
                if "ZMQ listener ready" in self.log_path.read_text(errors="replace"):
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError("the indexer did not start")

    def query(self, tokens: list[int], lora_name: str | None = None) -> dict[str, Any]:
        """The indexer's answer for a prompt: ``{"instances": {"1": {"longest_matched": n,
        "gpu": .., "cpu": .., "disk": ..}}}``."""
        body: dict[str, Any] = {"token_ids": tokens, "model_name": self.model_name}
        if lora_name is not None:
            body["lora_name"] = lora_name
        req = urllib.request.Request(self.url + "/query", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def matched(self, tokens: list[int], lora_name: str | None = None) -> int:
        """Tokens of ``tokens`` the indexer says this worker holds (0: none)."""
        inst = self.query(tokens, lora_name).get("instances", {}).get(str(self.worker_id))
        return int(inst["longest_matched"]) if inst else 0

    def wait_matched(self, tokens: list[int], want: int, lora_name: str | None = None, timeout: float = 15) -> int:
        """``matched`` once it equals ``want`` (events arrive asynchronously), or its last
        value after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        got = self.matched(tokens, lora_name)
        while got != want and time.monotonic() < end:
            time.sleep(0.1)
            got = self.matched(tokens, lora_name)
        return got

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

"""``vllm serve`` (vLLM's OpenAI-compatible server, ``vllm.entrypoints.openai.api_server``) as
a process of its own on a free loopback port, with lmctl's connector on a store or without it;
its log in a file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .connector import connector_config
from .lmctl import env_with_path
from .ports import free_port

# vLLM's own log at INFO on the server's stdout (its log file), whatever this process's
# environment says: a script imported before (the demo, a benchmark) may have quietened it.
SERVER_LOGGING = {"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_LEVEL": "INFO",
                  "VLLM_LOGGING_STREAM": "ext://sys.stdout"}


def server_env(work: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: this process's, with this checkout on PYTHONPATH, the engine
    core in its own process, vLLM's IPC files in ``work``, vLLM's log as ``SERVER_LOGGING``
    says; then ``env``."""
    full = env_with_path()
    full.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in its own process
    full["TMPDIR"] = str(work)
    full.update(SERVER_LOGGING)
    full.update(env or {})
    return full


class VllmServer:
    """``vllm serve MODEL`` (float32, eager, no prefix caching: the engine computes what lmctl
    does not load) with the connector on ``store`` (None: no connector) and its ``settings``;
    the engine core in its own process, as in production. ``args``: more of the server's
    options; ``env``: more of its environment. Its log is ``work/server-PORT.log``."""

    def __init__(self, model: str | Path, store: str | Path | None, work: Path, *, max_len: int = 2048,
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None, **settings: Any) -> None:
        self.port = free_port()
        self.model = str(model)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", str(max_len),
               "--no-enable-prefix-caching", "--enforce-eager", *args]
        if store is not None:
            cmd += ["--kv-transfer-config", json.dumps(connector_config(store, **settings))]
        full = server_env(work, env)
        self.log_path = work / f"server-{self.port}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, env=full, stdout=self._log, stderr=subprocess.STDOUT, text=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 240) -> None:
        """Until ``/health`` answers; an error with the log's tail when the server exits or
        does not start in time."""
        end = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("the vLLM server exited:\n" + self.log()[-4000:]) from None
                if time.time() > end:
                    raise RuntimeError("the vLLM server did not start:\n" + self.log()[-4000:]) from None
                time.sleep(0.5)

    def complete(self, prompt: list[int] | str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
        """POST /v1/completions (greedy); the reply."""
        data = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           **body}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}")
            out: dict[str, Any] = json.load(r)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


__all__ = ["VllmServer"]

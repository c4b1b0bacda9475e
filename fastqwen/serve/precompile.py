"""A server start's Triton kernels compiled in parallel beside its weight load.

On an empty Triton cache a start compiles its kernels one after another as it first launches them
(Qwen3.5-4B: ~140 s of its ~152 s to ready, docs/SERVING.md). `scripts/precompile.py` runs the
same start over meta tensors, records every launch's specialization and compiles them all at once
into Triton's cache. The server runs it in a subprocess (the capture patches process-wide state)
as it starts loading, and waits for it before its slots launch anything. On a warm cache the
subprocess finds every kernel there and costs its capture. Not run where nothing compiles: no CUDA
GPU, the torch op set (FASTQWEN_BACKEND=torch), Triton's interpreter.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "precompile.py"
# a precompile still running then is stopped; the start compiles what is left itself
WAIT_S = 600.0
SPECULATION = ("off", "ngram", "auto")


def wanted() -> bool:
    """Whether this process's engine compiles Triton kernels for a GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("FASTQWEN_BACKEND") == "torch":
        return False
    if not SCRIPT.is_file():
        return False
    import torch

    return torch.cuda.is_available()


def command(model_dir: str, max_batch: int | None, max_model_len: int | None, block_size: int | None,
            speculation: str | None, speculative_tokens: int | None) -> list[str]:
    """scripts/precompile.py's arguments for a server of these settings, as the server resolves
    them: max_model_len None 4096, both capped at the config's max_position_embeddings; max_batch
    None the most slots the server may plan, 64; speculation None FASTQWEN_SPECULATION, else off."""
    from fastqwen.checkpoint import read_config

    length = max_model_len or 4096
    limit = read_config(model_dir).get("max_position_embeddings")
    if isinstance(limit, int) and limit > 0:
        length = min(length, limit)
    mode = speculation or os.environ.get("FASTQWEN_SPECULATION") or "off"
    return [sys.executable, str(SCRIPT), "--model", str(model_dir), "--max-batch", str(max_batch or 64),
            "--max-model-len", str(length), "--block-size", str(block_size or 0),
            "--speculation", mode if mode in SPECULATION else "off",
            "--speculative-tokens", str(speculative_tokens or 4)]


class Precompile:
    """One precompile subprocess: start() it, then wait() for it before the kernels launch."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.began = time.monotonic()
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=str(SCRIPT.parents[1]))

    @classmethod
    def start(cls, model_dir: str, max_batch: int | None, max_model_len: int | None, block_size: int | None,
              speculation: str | None, speculative_tokens: int | None) -> Precompile | None:
        """The subprocess for a server of these settings, or None where nothing compiles (wanted) or
        the config cannot be read (the engine's load then says why)."""
        if not wanted():
            return None
        try:
            argv = command(model_dir, max_batch, max_model_len, block_size, speculation, speculative_tokens)
        except Exception:  # noqa: BLE001 - the engine's own load reports a bad checkpoint
            return None
        return cls(argv)

    def wait(self, timeout: float = WAIT_S) -> str:
        """Block until the subprocess ends (stopped after `timeout` seconds); what it did, in a line."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return f"kernel precompile stopped after {timeout:.0f} s; the start compiles the rest"
        self.log.seek(0)
        lines = [line.strip() for line in self.log.read().splitlines() if line.strip()]
        self.log.close()
        summary = "; ".join(line for line in lines if line.startswith(("captured", "compiled")))
        took = f"{time.monotonic() - self.began:.1f} s"
        if code != 0:
            tail = lines[-1] if lines else "no output"
            return f"kernel precompile exited {code} after {took} ({summary or tail}); the start compiles the rest"
        return f"kernels precompiled in {took} ({summary})"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if not self.log.closed:
            self.log.close()

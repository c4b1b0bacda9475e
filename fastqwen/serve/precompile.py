"""A server start's Triton kernels compiled in parallel beside its weight load.

On an empty Triton cache a start compiles its kernels one after another as it first launches them
(Qwen3.5-4B: ~140 s of its ~152 s to ready, docs/SERVING.md). `scripts/precompile.py` runs the
same start over meta tensors, records every launch's specialization and compiles them all at once
into Triton's cache. The server runs it in a subprocess (the capture patches process-wide state)
as it starts loading, and waits for it before its slots launch anything. Not run where nothing
compiles: no CUDA GPU, the torch op set (FASTQWEN_BACKEND=torch), Triton's interpreter.

A precompile that compiled every kernel leaves a stamp in the cache (stamp_path): a name made of
everything the kernels depend on (the engine's and the capture's sources, the checkpoint's
config, the server's settings, Triton's version, the GPU architecture, the engine's variables).
A start that finds its stamp runs no subprocess at all: the capture alone costs seconds (~8 s for
Qwen3.5-4B on an H100). A stamp written where the image is built, without a GPU (`--target
sm_90`), serves every start on that architecture with the same settings.
"""
from __future__ import annotations

import hashlib
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
# the engine's variables that change which kernels a start launches
KERNEL_ENV = ("FASTQWEN_BACKEND", "FASTQWEN_EXACT_DECODE", "FASTQWEN_NO_PDL", "FASTQWEN_SPECULATION")
STAMPS = "fastqwen-precompiled"   # the stamps' folder in Triton's cache


def cache_dir() -> pathlib.Path:
    """Triton's cache folder, as Triton resolves it: TRITON_CACHE_DIR, else ~/.triton/cache."""
    return pathlib.Path(os.environ.get("TRITON_CACHE_DIR") or pathlib.Path.home() / ".triton" / "cache")


def sources() -> list[pathlib.Path]:
    """The files whose text decides the kernels and their specializations: the engine's and the
    capture's."""
    root = SCRIPT.parents[1]
    return [p for p in sorted((root / "engine").rglob("*.py")) + [SCRIPT, SCRIPT.parent / "compile_kernels.py"]
            if p.is_file()]


def stamp_path(cache: pathlib.Path, model_dir: str, settings: list[str], triton_version: str, arch: int) -> pathlib.Path:
    """Where a precompile of these settings (settings()) leaves its stamp."""
    root, digest = SCRIPT.parents[1], hashlib.sha256()
    for part in (triton_version, f"sm_{arch}", " ".join(settings),
                 " ".join(f"{name}={os.environ.get(name, '')}" for name in KERNEL_ENV)):
        digest.update(part.encode() + b"\0")
    digest.update((pathlib.Path(model_dir) / "config.json").read_bytes() + b"\0")
    for path in sources():
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return cache / STAMPS / f"{digest.hexdigest()[:32]}.json"


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
    """scripts/precompile.py's command line for a server of these settings (settings())."""
    return _script(model_dir) + settings(model_dir, max_batch, max_model_len, block_size, speculation,
                                         speculative_tokens)


def _script(model_dir: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--model", str(model_dir)]


def settings(model_dir: str, max_batch: int | None, max_model_len: int | None, block_size: int | None,
             speculation: str | None, speculative_tokens: int | None) -> list[str]:
    """scripts/precompile.py's arguments after the model for a server of these settings, as the
    server resolves them (the stamp's name is made of them): max_model_len None 4096, both capped
    at the config's max_position_embeddings; max_batch None the most slots the server may plan, 64;
    speculation None FASTQWEN_SPECULATION, else off."""
    from fastqwen.checkpoint import read_config

    length = max_model_len or 4096
    limit = read_config(model_dir).get("max_position_embeddings")
    if isinstance(limit, int) and limit > 0:
        length = min(length, limit)
    mode = speculation or os.environ.get("FASTQWEN_SPECULATION") or "off"
    return ["--max-batch", str(max_batch or 64), "--max-model-len", str(length), "--block-size", str(block_size or 0),
            "--speculation", mode if mode in SPECULATION else "off", "--speculative-tokens", str(speculative_tokens or 4)]


def found_stamp(model_dir: str, settings: list[str]) -> pathlib.Path | None:
    """This GPU's stamp for these settings where the cache holds it, else None."""
    import torch
    import triton

    major, minor = torch.cuda.get_device_capability()
    stamp = stamp_path(cache_dir(), model_dir, settings, triton.__version__, major * 10 + minor)
    return stamp if stamp.is_file() else None


class Precompile:
    """One precompile subprocess: start() it, then wait() for it before the kernels launch. With
    `stamp` (a stamp found in the cache) there is none: every kernel is compiled already."""

    def __init__(self, argv: list[str], stamp: pathlib.Path | None = None):
        self.argv, self.stamp = argv, stamp
        self.began = time.monotonic()
        self.log = self.proc = None
        if stamp is None:
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
            resolved = settings(model_dir, max_batch, max_model_len, block_size, speculation, speculative_tokens)
        except Exception:  # noqa: BLE001 - the engine's own load reports a bad checkpoint
            return None
        try:
            stamp = found_stamp(model_dir, resolved)
        except Exception:  # noqa: BLE001 - no stamp to go by: the precompile runs
            stamp = None
        return cls(_script(model_dir) + resolved, stamp)

    def wait(self, timeout: float = WAIT_S) -> str:
        """Block until the subprocess ends (stopped after `timeout` seconds); what it did, in a line."""
        if self.proc is None:
            return f"kernels precompiled already (stamp {self.stamp})"
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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.log is not None and not self.log.closed:
            self.log.close()

"""The engine-side harness: one fresh process per engine and workload, as the platform runs it.

Run as `python -m fastqwen.judge.child --engine DIR --model DIR --cmd-fd R --evt-fd W`. It puts
the engine folder first on `sys.path`, imports `engine` as a top-level module, builds
`Engine(model_path)`, then serves `generate` commands from the trusted parent. Commands arrive
and events leave over two dedicated pipes, never over stdout/stderr, which belong to the engine
(the parent sends both to a log file). Each yielded step is checked and forwarded the moment it
is produced, because the parent timestamps its arrival: nothing here may batch or delay steps.

Commands: prompts (staged, answered by ready), go (runs generate on the staged prompts), exit.
Events (one JSON object per line): loaded, ready, step, done, error. After an error the process exits:
the workload has failed and a broken engine is not trusted with another call.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback

from fastqwen.judge.gates import PENDING_LIMIT_MS

TRACEBACK_LINES = 12


class Channel:
    def __init__(self, cmd_fd: int, evt_fd: int):
        self._cmd = os.fdopen(cmd_fd, "r", encoding="utf-8")
        self._evt = os.fdopen(evt_fd, "w", encoding="utf-8")

    def send(self, event: dict) -> None:
        self._evt.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._evt.flush()

    def receive(self) -> dict | None:
        line = self._cmd.readline()
        return json.loads(line) if line else None


def _traceback_tail() -> str:
    lines = traceback.format_exc().rstrip().splitlines()
    return "\n".join(lines[-TRACEBACK_LINES:])


def _torch_if_loaded():
    # Only look at CUDA when the engine brought torch in; never initialize it on its behalf.
    return sys.modules.get("torch")


_NVML_READY: list[bool] = []  # nvmlInit once per process


def _nvml_process_bytes() -> int | None:
    """This process's GPU memory as NVML sees it (None without pynvml or inside a PID namespace)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        if not _NVML_READY:
            pynvml.nvmlInit()
            _NVML_READY.append(True)
        total = 0
        found = False
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    total += int(proc.usedGpuMemory)
                    found = True
        return total if found else None
    except pynvml.NVMLError:
        return None


def memory_snapshot() -> dict:
    """Peak figures so far: CPU RSS always; on CUDA the torch reserved peak, device total, NVML."""
    # ru_maxrss is in KiB on Linux.
    snap: dict = {"cpu_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    torch = _torch_if_loaded()
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        snap["cuda_max_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        snap["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        snap["cuda_device_total_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
        snap["nvml_process_bytes"] = _nvml_process_bytes()
    return snap


def pending_gpu_work() -> dict | None:
    """Is the GPU still busy right after the last yield? None when CUDA was never used."""
    torch = _torch_if_loaded()
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    stream_idle = bool(torch.cuda.current_stream().query())
    start = time.perf_counter()
    # synchronize() waits for every stream of the device, so work queued on an engine's own
    # stream shows up in the wait even when the current stream is idle.
    torch.cuda.synchronize()
    sync_ms = (time.perf_counter() - start) * 1e3
    return {"stream_idle": stream_idle, "sync_ms": sync_ms, "flagged": sync_ms > PENDING_LIMIT_MS}


def describe(engine: object) -> dict | None:
    """What the engine says it runs (its optional `describe()`: a flat dict, e.g. the model family
    and the op backend), for the report; strings of at most 200 characters, at most 20 keys.
    An engine without it, or one whose describe() fails, reports nothing."""
    fn = getattr(engine, "describe", None)
    if not callable(fn):
        return None
    try:
        info = fn()
    except Exception:  # noqa: BLE001 - a report detail must not fail the run
        return {"error": _traceback_tail()[-200:]}
    if not isinstance(info, dict):
        return {"error": f"describe() returned {type(info).__name__}, not a dict"}
    return {str(k)[:200]: str(v)[:200] for k, v in list(info.items())[:20]}


def spec_stats(engine: object) -> dict | None:
    """The engine's speculation figures for the call that just ended (its optional `spec_stats()`:
    drafted, accepted, verify passes, ...): numbers, small tables of numbers (e.g. verifies by
    width) and short strings only; None without it or when it fails (a report detail must not
    fail the run)."""
    fn = getattr(engine, "spec_stats", None)
    if not callable(fn):
        return None
    try:
        info = fn()
    except Exception:  # noqa: BLE001
        return None
    if not isinstance(info, dict):
        return None
    def value(v):
        if isinstance(v, (int, float)) or v is None:
            return v
        if isinstance(v, dict) and len(v) <= 16 and all(isinstance(x, (int, float)) for x in v.values()):
            return {str(k)[:20]: x for k, x in v.items()}
        return str(v)[:60]

    return {str(k)[:60]: value(v) for k, v in list(info.items())[:20]}


def _check_step(step: object, index: int) -> str | None:
    if type(step) is not list:
        return f"step {index}: yielded {type(step).__module__}.{type(step).__qualname__}, not a plain list"
    for j, token in enumerate(step):
        # bool is a subclass of int; a numpy or torch integer is not a Python int.
        if type(token) is not int:
            return (f"step {index}: element {j} is {type(token).__module__}.{type(token).__qualname__} "
                    f"({token!r}), not a plain int")
    return None


def serve_generate(engine: object, channel: Channel, input_ids: list[list[int]], max_new_tokens: int) -> bool:
    """Run one generate call, forwarding steps as they come. Returns False after an error."""
    count = 0
    try:
        for step in engine.generate(input_ids, max_new_tokens):
            problem = _check_step(step, count)
            if problem is None and count >= max_new_tokens:
                problem = f"yielded more than max_new_tokens={max_new_tokens} steps"
            if problem is not None:
                channel.send({"ev": "error", "kind": "bad_yield", "detail": problem})
                return False
            channel.send({"ev": "step", "tokens": step})
            count += 1
    except Exception:  # noqa: BLE001 - any engine exception is the engine's failure, reported verbatim
        channel.send({"ev": "error", "kind": "raised", "detail": _traceback_tail(), "step": count})
        traceback.print_exc()
        return False
    channel.send({"ev": "done", "steps": count, "pending": pending_gpu_work(), "memory": memory_snapshot(),
                  "spec_stats": spec_stats(engine)})
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--cmd-fd", type=int, required=True)
    parser.add_argument("--evt-fd", type=int, required=True)
    args = parser.parse_args(argv)
    channel = Channel(args.cmd_fd, args.evt_fd)

    engine_dir = os.path.abspath(args.engine)
    # The platform imports `engine` as a top-level module with the folder first on sys.path;
    # the current directory must not shadow it.
    sys.path[:] = [engine_dir] + [p for p in sys.path if p not in ("", os.getcwd(), engine_dir)]
    start = time.perf_counter()
    try:
        import engine as engine_module  # noqa: PLC0415 - the import is what is being judged

        engine = engine_module.Engine(args.model)
    except (Exception, SystemExit):  # noqa: BLE001 - a failed load is the engine's failure
        channel.send({"ev": "error", "kind": "raised", "detail": _traceback_tail(), "where": "load"})
        traceback.print_exc()
        return 1
    channel.send({"ev": "loaded", "load_s": time.perf_counter() - start, "memory": memory_snapshot(),
                  "engine_file": getattr(engine_module, "__file__", None), "describe": describe(engine)})

    # Two steps per generation: the prompts arrive and are decoded first ("prompts" -> "ready");
    # the parent starts its clock only when it sends "go", so decoding a large prompt payload
    # here is never counted against the engine's TTFT.
    staged: dict | None = None
    while True:
        command = channel.receive()
        cmd = None if command is None else command.get("cmd")
        if cmd is None or cmd == "exit":
            return 0
        if cmd == "prompts":
            staged = command
            channel.send({"ev": "ready"})
        elif cmd == "go" and staged is not None:
            input_ids, max_new_tokens = staged["input_ids"], int(staged["max_new_tokens"])
            staged = None
            if not serve_generate(engine, channel, input_ids, max_new_tokens):
                return 1
        else:
            channel.send({"ev": "error", "kind": "harness", "detail": f"unexpected command {command!r}"})
            return 3

if __name__ == "__main__":
    sys.exit(main())

"""The trusted parent's handle on one engine process: launch, pipes, timed generation, teardown.

Steps are timestamped here, with `time.perf_counter()` in the parent, the moment the bytes of
the step arrive from the child: the engine's own clock is never trusted. Every way an engine can
fail (raise, hang, die, yield the wrong thing) becomes a `ChildFailure` carrying the gate code,
and the process group is killed so nothing of it survives into the next measurement.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

EXIT_GRACE_S = 10.0
LOG_TAIL_LINES = 20


class ChildFailure(Exception):
    """The engine failed a generation or its load; `code` is the gate code to record."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class _Timeout(Exception):
    pass


class _EOF(Exception):
    pass


class EventReader:
    """Newline-delimited JSON events from the child, each stamped with its arrival time."""

    def __init__(self, fd: int):
        self.fd = fd
        self._buffer = b""
        self._ready: deque[tuple[float, bytes]] = deque()

    def next(self, deadline: float) -> tuple[dict, float]:
        while not self._ready:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise _Timeout()
            readable, _, _ = select.select([self.fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(self.fd, 1 << 20)
            # Stamp before parsing: the arrival, not our bookkeeping, is what is timed.
            arrived = time.perf_counter()
            if not chunk:
                raise _EOF()
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            self._ready.extend((arrived, line) for line in lines)
        arrived, line = self._ready.popleft()
        try:
            return json.loads(line), arrived
        except json.JSONDecodeError:
            raise ChildFailure("candidate_error", f"harness pipe corrupted: {line[:80]!r}") from None

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class Generation:
    """One timed generate call: send time, each step's arrival, the tokens, the child's 'done' report."""

    send_t: float
    arrivals: list[float]
    steps: list[list[int]]
    done: dict = field(default_factory=dict)


class EngineProcess:
    """A fresh `python -m fastqwen.judge.child` for one engine folder and one workload."""

    def __init__(self, label: str, engine_dir: Path, model_dir: Path, env: dict[str, str], log_path: Path):
        self.label = label
        self.log_path = log_path
        cmd_r, cmd_w = os.pipe()
        evt_r, evt_w = os.pipe()
        self._log = open(log_path, "wb")
        argv = [sys.executable, "-m", "fastqwen.judge.child", "--engine", str(engine_dir), "--model",
                str(model_dir), "--cmd-fd", str(cmd_r), "--evt-fd", str(evt_w)]
        self.started = time.perf_counter()
        # A session of its own: on timeout the whole group (any helpers the engine spawned) is killed.
        self.proc = subprocess.Popen(argv, pass_fds=(cmd_r, evt_w), stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)
        os.close(cmd_r)
        os.close(evt_w)
        self._cmd_w: int | None = cmd_w
        self._events = EventReader(evt_r)
        self.memory: dict = {}
        self.describe: dict | None = None   # the engine's own describe(), when it has one
        self.loaded_t: float | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def wait_loaded(self, deadline: float, budget_s: float) -> dict:
        """Block until `Engine(model_path)` returned; raises ChildFailure on error, death or timeout."""
        event, arrived = self._next(deadline, during="load", timeout_detail=f"not loaded within {budget_s:.0f} s")
        if event.get("ev") != "loaded":
            raise self._fail_event(event, during="load")
        self.loaded_t = arrived
        self.memory = event.get("memory", {})
        self.describe = event.get("describe")
        return event

    def generate(self, prompts: list[list[int]], max_new_tokens: int, deadline: float, timeout_detail: str,
                 vocab_size: int) -> Generation:
        """Send one generate command and time its stream; checks count, length and id range."""
        batch = len(prompts)
        payload = (json.dumps({"cmd": "prompts", "input_ids": prompts, "max_new_tokens": max_new_tokens},
                              separators=(",", ":")) + "\n").encode()
        self._write(payload)
        event, _ = self._next(deadline, during="prompt delivery", timeout_detail=timeout_detail)
        if event.get("ev") != "ready":
            raise self._fail_event(event, during="prompt delivery")
        # The clock starts at "go": the engine is handed the already-decoded prompts at once.
        send_t = time.perf_counter()
        self._write(b'{"cmd":"go"}\n')
        gen = Generation(send_t=send_t, arrivals=[], steps=[])
        while True:
            event, arrived = self._next(deadline, during=f"step {len(gen.steps)}", timeout_detail=timeout_detail)
            kind = event.get("ev")
            if kind == "step":
                tokens = event["tokens"]
                index = len(gen.steps)
                if len(tokens) != batch:
                    raise self._kill_with("candidate_error", f"step {index}: {len(tokens)} tokens for a batch of {batch}")
                out_of_range = [t for t in tokens if not 0 <= t < vocab_size]
                if out_of_range:
                    raise self._kill_with("candidate_error",
                                          f"step {index}: token id {out_of_range[0]} outside the vocabulary [0, {vocab_size})")
                gen.arrivals.append(arrived)
                gen.steps.append(tokens)
            elif kind == "done":
                gen.done = event
                self.memory = event.get("memory", self.memory)
                if len(gen.steps) != max_new_tokens:
                    raise self._kill_with("candidate_error",
                                          f"yielded {len(gen.steps)} steps, expected max_new_tokens={max_new_tokens}")
                return gen
            else:
                raise self._fail_event(event, during=f"step {len(gen.steps)}")

    def stop(self) -> int | None:
        """End the process (politely, then by force) and wait until it and its group are gone."""
        if self._cmd_w is not None:
            if self.proc.poll() is None:
                try:
                    os.write(self._cmd_w, b'{"cmd":"exit"}\n')
                except OSError:
                    pass  # already gone; the kill below is harmless
            os.close(self._cmd_w)
            self._cmd_w = None
        try:
            self.proc.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group()
        self.proc.wait()
        if not self._log.closed:
            self._events.close()
            self._log.close()
        return self.proc.returncode

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    # -- internals -------------------------------------------------------------------------
    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _kill_with(self, code: str, detail: str) -> ChildFailure:
        self._kill_group()
        self.proc.wait()
        return ChildFailure(code, detail)

    def _write(self, payload: bytes) -> None:
        view = memoryview(payload)
        try:
            while view:
                written = os.write(self._cmd_w, view)
                view = view[written:]
        except BrokenPipeError:
            raise self._died("before the command was sent") from None

    def _next(self, deadline: float, during: str, timeout_detail: str) -> tuple[dict, float]:
        try:
            return self._events.next(deadline)
        except _Timeout:
            raise self._kill_with("timeout", f"{timeout_detail} (during {during})") from None
        except _EOF:
            raise self._died(f"during {during}") from None

    def _died(self, when: str) -> ChildFailure:
        try:
            code = self.proc.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            self._kill_group()
            code = self.proc.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        self._kill_group()
        return ChildFailure("candidate_error", f"engine process died {when} ({how}); last output: {self.log_tail(5)!r}")

    def _fail_event(self, event: dict, during: str) -> ChildFailure:
        kind = event.get("kind")
        detail = event.get("detail", repr(event))
        if kind == "raised":
            where = "while loading" if event.get("where") == "load" else f"at step {event.get('step', '?')}"
            return self._kill_with("candidate_error", f"engine raised {where}:\n{detail}")
        if kind == "bad_yield":
            return self._kill_with("candidate_error", detail)
        return self._kill_with("harness_error", f"unexpected event during {during}: {detail}")

"""A verify's exact GDN rows (engine/fqkernels/gdn_exact_step.py's fused_rows): where a row's time goes.

One GDN layer at Qwen3.5-4B's heads (--key-heads / --value-heads / --head-dim), --batch sequences,
a verify of --rows rows starting at each chunk row of --starts (the chunk's earlier rows made
first by one-row steps on seeded inputs; a start within --rows of 64 crosses the chunk's close):
- `graph`: the launch's microseconds as the engine runs it (one CUDA graph, no stamps);
- one launch with the phase stamps (fused_rows(stamps=...): after a barrier, each program's cycle
  counter and the global timer at each phase's end): for each phase of gdn_exact_step.PHASES, the
  median over the programs of its cycles a row, and in microseconds at the clock the stamps'
  timer gives (the launch's timer span over its cycle span); a row `row` for the whole row; rows
  `row_r` for row r of the verify alone (the solve deepens and the close lands on one row);
- every stamped output, state and chunk row equal to an unstamped launch's from the same start
  (`same_bits`: the stamps change no bit).
The stamps need a GPU: without one the entry stops with an error naming it.
"""
from __future__ import annotations

import argparse
import statistics

from bench.runner import BenchError, Column, engine_on_path, gpu_visible, positive_int, time_graph

COLUMNS = [Column("start", width=5), Column("rows", width=4), Column("part", width=10, left=True),
           Column("cycles", fmt="{:.0f}"), Column("us", fmt="{:.2f}"), Column("share", fmt="{:.2f}", width=6),
           Column("same_bits", "same", width=5)]


def start_list(text: str) -> list[int]:
    """"0,24,57" -> [0, 24, 57]: chunk rows, 0-63."""
    try:
        out = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        out = []
    if not out or any(s < 0 or s > 63 for s in out):
        raise argparse.ArgumentTypeError(f"--starts wants chunk rows 0-63, comma-separated, got {text!r}")
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences (default 1)")
    parser.add_argument("--rows", type=positive_int, default=7, help="a verify's rows: drafts + 1 (default 7)")
    parser.add_argument("--starts", type=start_list, default=[0, 24, 57],
                        help="the chunk rows the verify starts at (default 0,24,57: 57 crosses the close)")
    parser.add_argument("--key-heads", type=positive_int, default=16, help="q / k heads (default 16)")
    parser.add_argument("--value-heads", type=positive_int, default=32, help="value heads (default 32)")
    parser.add_argument("--head-dim", type=positive_int, default=128, help="Dk = Dv (default 128)")
    parser.add_argument("--reps", type=positive_int, default=15, help="timed graph replays (default 15)")


def phase_times(stamps) -> dict:
    """From stamps [programs, rows, len(PHASES) + 1, 2] (int64: cycles, ns) -> {part: (median cycles
    over the programs, of the mean over the rows)} for each phase, "row" for the whole row and
    "row_r" for row r alone, plus "ns_per_cycle": the launch's timer span over its cycle span
    (summed over the programs, each program's own clock)."""
    from fqkernels.gdn_exact_step import PHASES

    s = stamps.double()
    cycles, timer = s[..., 0], s[..., 1]
    d = cycles[:, :, 1:] - cycles[:, :, :-1]                          # [programs, rows, phases]
    out = {name: statistics.median(d[:, :, i].mean(1).tolist()) for i, name in enumerate(PHASES)}
    row = cycles[:, :, -1] - cycles[:, :, 0]
    out["row"] = statistics.median(row.mean(1).tolist())
    for r in range(row.shape[1]):
        out[f"row_{r}"] = statistics.median(row[:, r].tolist())
    span_cycles = (cycles[:, -1, -1] - cycles[:, 0, 0]).sum().item()
    span_ns = (timer[:, -1, -1] - timer[:, 0, 0]).sum().item()
    out["ns_per_cycle"] = span_ns / span_cycles if span_cycles > 0 else float("nan")
    return out


def _snapshot(state, rows) -> list:
    """Copies of the state and of every chunk-row buffer (ChunkRows.ROW_AXES' order)."""
    return [state.clone()] + [getattr(rows, name).clone() for name, _ in rows.ROW_AXES]


def _restore(state, rows, saved: list) -> None:
    for dst, src in zip([state] + [getattr(rows, name) for name, _ in rows.ROW_AXES], saved):
        dst.copy_(src)


def run(args, report) -> None:
    if not gpu_visible():
        raise BenchError("gdn-rows: the phase stamps read a GPU's clocks (fused_rows(stamps=...)); no GPU is visible")
    engine_on_path()
    import torch

    from fqkernels import gdn_exact_step as step

    B, T, Hk, Hv, D = args.batch, args.rows, args.key_heads, args.value_heads, args.head_dim
    if Hv % Hk:
        raise BenchError(f"gdn-rows: --value-heads {Hv} is not a multiple of --key-heads {Hk}")
    dev = torch.device("cuda")
    if step.grid_plan("auto", "auto", B * Hv, dev)[0] != "merged" or T == 1:
        raise BenchError(f"gdn-rows: {T} rows of {B} x {Hv} heads run a launch a row (fused_rows' other form): "
                         f"nothing to stamp")
    gen = torch.Generator(device=dev).manual_seed(B * 1000 + T)
    n = 64 + T
    q, k = (torch.randn(B, n, Hk, D, generator=gen, device=dev).bfloat16() for _ in range(2))
    v = torch.randn(B, n, Hv, D, generator=gen, device=dev).bfloat16()
    g = -torch.nn.functional.softplus(torch.randn(B, n, Hv, generator=gen, device=dev)) * 0.1
    beta = torch.rand(B, n, Hv, generator=gen, device=dev).bfloat16()
    state0 = torch.randn(B, Hv, D, D, generator=gen, device=dev) * 0.1
    for start in args.starts:
        rows, state = step.ChunkRows(B, Hv, D, D, dev), state0.clone()
        for i in range(start):                                # the chunk's rows before the verify
            pos = torch.full((B,), i, dtype=torch.int64, device=dev)
            step.fused_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], pos, state, rows)
        pos = torch.full((B,), start, dtype=torch.int64, device=dev)
        inputs = [x[:, start:start + T].transpose(0, 1) for x in (q, k, v, g, beta)]    # [T, B, ...]
        saved = _snapshot(state, rows)

        def launch(stamps=None):
            return step.fused_rows(*inputs, pos, state, rows, stamps=stamps)

        us = time_graph(lambda _: launch(), [None], reps=args.reps)
        _restore(state, rows, saved)
        plain = launch()
        after = _snapshot(state, rows)
        _restore(state, rows, saved)
        stamps = torch.zeros((B * Hv, T, len(step.PHASES) + 1, 2), dtype=torch.int64, device=dev)
        stamped = launch(stamps)
        torch.cuda.synchronize()
        same = torch.equal(plain, stamped) and all(map(torch.equal, after, _snapshot(state, rows)))
        times = phase_times(stamps.cpu())
        ns = times.pop("ns_per_cycle")
        report.add({"start": start, "rows": T, "part": "graph", "cycles": None, "us": us, "share": None,
                    "same_bits": same, "ns_per_cycle": ns})
        for part, cycles in times.items():
            share = cycles / times["row"] if part in step.PHASES else None
            report.add({"start": start, "rows": T, "part": part, "cycles": cycles, "us": cycles * ns / 1e3,
                        "share": share, "same_bits": same})

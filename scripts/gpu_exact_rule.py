"""The GDN chunked rule in the reference's order (fqkernels/gdn_exact.py) on a GPU: is it the
reference's (gdn.delta_rule_chunked_reference) bit for bit, and what does it cost against the
reference's ops and the fast kernels (gdn.chunked_prefill), each as one CUDA graph, per layer,
at the public shapes' prompts (32 value heads of 128, as the 4B's GDN layers)? Also the exact
rule's two kernels alone.

    python scripts/gpu_exact_rule.py [--shapes 1x512,4x2048,16x512] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from fqkernels import gdn, gdn_exact  # noqa: E402
from gpu_rule_bits_probe import inputs  # noqa: E402


def graphed_us(fn, reps: int = 20) -> float:
    """Median microseconds of one replay of fn captured as a CUDA graph (after a warm-up run)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times = sorted(times[2:])
    return round(times[len(times) // 2], 1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x512,4x2048,16x512")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {"torch": torch.__version__, "heads": args.heads, "shapes": {}}
    H = args.heads
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        r = {}
        try:
            with torch.inference_mode():
                q, k, v, g, beta = inputs(B, T, H, dev, seed=B + T)
                s0 = torch.randn(B, H, 128, 128, device=dev) * 0.05
                ref = gdn.delta_rule_chunked_reference(q, k, v, g, beta, state=s0, capture=T // 128)
                got = gdn_exact.delta_rule_chunked_exact(q, k, v, g, beta, state=s0, capture=T // 128)
                same = {name: bool(torch.equal(a, b)) for name, a, b in zip(("out", "state", "captured"), got, ref)}
                differ = {name: float((a != b).float().mean()) for name, a, b in zip(("out", "state", "captured"), got, ref)}
                r.update({"bit_equal": same, "fraction_differing": differ})
                state = torch.empty_like(s0)
                r["us_reference"] = graphed_us(lambda: gdn.delta_rule_chunked_reference(q, k, v, g, beta))
                r["us_exact"] = graphed_us(lambda: gdn_exact.delta_rule_chunked_exact(q, k, v, g, beta))
                r["us_fast"] = graphed_us(lambda: gdn.chunked_prefill(q, k, v, g, beta, state_out=state))
                # the exact rule's two kernels alone, on its own intermediate shapes
                C, n = gdn.CHUNK, T // gdn.CHUNK
                L = torch.randn(B * H * n, C, C, device=dev) * 0.05
                rhs = torch.randn(B * H * n, C, 256, device=dev)
                r["us_solve"] = graphed_us(lambda: gdn_exact.solve_unit_lower(L, rhs))
                u = torch.randn(B * H, n, C, 128, device=dev)
                attn = torch.randn(B * H, n, C, C, device=dev) * 0.05
                carry = torch.rand(B * H, n, device=dev)
                st = torch.zeros(B * H, 128, 128, device=dev)
                for bv in (32, 64):
                    try:
                        r[f"us_recurrence_bv{bv}"] = graphed_us(
                            lambda bv=bv: gdn_exact.recurrence(u, u, u, u, attn, carry, st, block_v=bv))
                    except Exception as exc:  # noqa: BLE001 - e.g. 64 columns past shared memory
                        r[f"us_recurrence_bv{bv}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        except Exception as exc:  # noqa: BLE001 - one shape failing: the rest still run
            r["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        report["shapes"][shape] = r
        print(shape, r, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

"""The GDN chunked rule in the reference's order (fqkernels/gdn_exact.py) on a GPU: is it the
reference's (gdn.delta_rule_chunked_reference) bit for bit, and what does it cost against the
reference's ops and the fast kernels (gdn.chunked_prefill), each as one CUDA graph, per layer,
at the public shapes' prompts (32 value heads of 128, as the 4B's GDN layers)? Also the exact
rule's two kernels alone at several launch shapes and forms, each against torch's ops bit for bit.

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
from gpu_rule_bits_probe import graphed_us, inputs  # noqa: E402


# launch shapes tried for the two kernels (each checked bit for bit against torch's ops, then timed):
# the solve's (form, right-hand-side columns a program, warps) and the chunk loop's (form, value columns a
# program, warps, k_slice: the sliced form's slice of each product's inner dimension); the exact rule
# itself runs its defaults. Session 20's first sweep (the fused and split forms) is in
# results/h200-2026-12-02/session20/run1; the split form's best (32, 8) stays as the reference here.
SOLVE_VARIANTS = [("masked", 32, 2), ("scratch", 32, 2), ("scratch", 32, 4), ("scratch", 64, 4), ("scratch", 16, 1),
                  ("scratch", 64, 8)]
LOOP_VARIANTS = [("split", 32, 8, 16), ("sliced", 32, 8, 16), ("sliced", 32, 4, 16), ("sliced", 32, 8, 32),
                 ("sliced", 16, 4, 16), ("sliced", 16, 2, 16), ("sliced", 64, 8, 16), ("sliced", 64, 4, 32)]


# the whole rule on the forms session 20 built, at the launch shapes it first tried (the defaults since
# session 21 are these forms at other shapes: us_exact), with the systems on Triton too (chunk_systems)
NEW_SOLVE = {"form": "scratch", "block_n": 32, "num_warps": 2}
NEW_LOOP = {"form": "sliced", "block_v": 32, "num_warps": 8, "k_slice": 16}


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
                # the whole rule on NEW_SOLVE, NEW_LOOP and the systems on Triton
                got = gdn_exact.delta_rule_chunked_exact(q, k, v, g, beta, state=s0, capture=T // 128, solve=NEW_SOLVE,
                                                         loop=NEW_LOOP, systems="triton")
                r["bit_equal_new_forms"] = {name: bool(torch.equal(a, b))
                                            for name, a, b in zip(("out", "state", "captured"), got, ref)}
                r["us_exact_new_forms"] = graphed_us(lambda: gdn_exact.delta_rule_chunked_exact(
                    q, k, v, g, beta, solve=NEW_SOLVE, loop=NEW_LOOP, systems="triton"))
                # the pieces before the solve: torch's ops, and with the systems by chunk_systems
                r["us_pieces_torch"] = graphed_us(lambda: gdn.chunked_pieces(q, k, v, g, beta))
                r["us_pieces_triton"] = graphed_us(lambda: gdn.chunked_pieces(q, k, v, g, beta,
                                                                             systems=gdn_exact.chunk_systems))
                r["us_fast"] = graphed_us(lambda: gdn.chunked_prefill(q, k, v, g, beta, state_out=state))
                # the exact rule's two kernels alone, on its own intermediate shapes
                C, n = gdn.CHUNK, T // gdn.CHUNK
                L = torch.randn(B * H * n, C, C, device=dev) * 0.05
                rhs = torch.randn(B * H * n, C, 256, device=dev)
                want = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
                for form, bn, warps in SOLVE_VARIANTS:
                    name = f"solve_{form}_bn{bn}_w{warps}"
                    try:
                        got = gdn_exact.solve_unit_lower(L, rhs, bn, warps, form=form)
                        r[name] = {"bit_equal": bool(torch.equal(got, want)), "us": graphed_us(
                            lambda form=form, bn=bn, warps=warps: gdn_exact.solve_unit_lower(L, rhs, bn, warps,
                                                                                             form=form))}
                    except Exception as exc:  # noqa: BLE001 - e.g. past shared memory
                        r[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                u, w, qd, kd = (torch.randn(B * H, n, C, 128, device=dev) * 0.1 for _ in range(4))
                attn = torch.randn(B * H, n, C, C, device=dev) * 0.05
                carry = torch.rand(B * H, n, device=dev)
                st = torch.randn(B * H, 128, 128, device=dev) * 0.05
                want_out, want_state = gdn_exact.recurrence_reference(u, w, qd, kd, attn, carry, st)
                for form, bv, warps, ks in LOOP_VARIANTS:
                    name = f"loop_{form}_bv{bv}_w{warps}" + (f"_ks{ks}" if form == "sliced" else "")
                    try:
                        state = st.clone()
                        out = gdn_exact.recurrence(u, w, qd, kd, attn, carry, state, block_v=bv, form=form,
                                                   num_warps=warps, k_slice=ks)
                        same = bool(torch.equal(out, want_out) and torch.equal(state, want_state))
                        state = st.clone()
                        r[name] = {"bit_equal": same, "us": graphed_us(
                            lambda form=form, bv=bv, warps=warps, ks=ks: gdn_exact.recurrence(
                                u, w, qd, kd, attn, carry, state, block_v=bv, form=form, num_warps=warps,
                                k_slice=ks))}
                    except Exception as exc:  # noqa: BLE001 - e.g. past shared memory
                        r[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
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

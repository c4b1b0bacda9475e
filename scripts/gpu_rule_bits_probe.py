"""Can a Triton kernel give the GDN reference's bits? Issue 12's noise: the engine's extra logit
distance to the full forward is all made by its prompt pass's chunked rule, whose bits are not
the reference's (gdn.delta_rule_chunked_reference: the torch ops Transformers 5.17 runs; with
that rule on the reference's ops the engine's prompt pass gives the full forward's bits,
session 18). A rule in Triton with the reference's bits needs each of its pieces' order of
operations. This probe runs each piece on the GPU as the reference calls it (TF32 off, its
shapes and strides) and against it Triton kernels of known order, and reports per piece and
candidate the fraction of elements bit-equal and the largest difference.

Pieces (the 4B's heads: Dk = Dv = 128, chunks of 64; B x T and heads from --shape):
  sum128     (x * x).sum(-1) over Dk fp32 (l2_normalize)      ascending adds, tl.sum, torch's reduce
                                                                order as read from its source (emulated)
  rsqrt      torch.rsqrt                                        tl.rsqrt, libdevice rsqrt
  exp        torch.exp on log decays                            tl.exp, libdevice exp
  cumsum64   g.cumsum(3) within a chunk                         ascending adds, tl.cumsum, torch's
                                                                Sklansky scan as read (emulated)
  mm_kkt     (k * beta) @ k^T        [64, 128] x [128, 64]      ascending FMA, two halves, tl.dot ieee
  mm_ws      w[:, :, c] @ S          [64, 128] x [128, 128]     the same
  mm_av      attn[:, :, c] @ v_new   [64, 64] x [64, 128]       the same
  mm_ktv     k[:, :, c]^T @ v_new    [128, 64] x [64, 128]      the same
  trsm       solve_triangular(unit lower [64, 64], [64, 128])   forward substitution, ascending j,
                                                                with FMA and with rounded products

    python scripts/gpu_rule_bits_probe.py [--shape 4x2048] [--heads 32] [--seed 0] [--out PATH]

Writes {piece: {candidate: {"equal": fraction, "max_abs": float}}} as JSON (a candidate that
fails to compile or run: None and its error) and prints a table; on a GPU also each piece's torch
op timed and the whole reference rule, eager and as one CUDA graph (what a rule built from the
reference's own ops would cost).
On the CPU the candidates run under TRITON_INTERPRET=1 (their logic; the bits are the GPU's).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
from fqkernels import gdn  # noqa: E402

try:                                   # Triton >= 3.2
    from triton.language.extra import libdevice
except ImportError:                    # pragma: no cover - Triton 3.1
    libdevice = tl.math

C = gdn.CHUNK


# ------------------------------------------------------------------ candidates (Triton)
@triton.jit
def _row_scan_kernel(x_ptr, out_ptr, R, N: tl.constexpr, BR: tl.constexpr, MODE: tl.constexpr):
    """Rows of N fp32 values, BR rows a program. MODE 0: each row's sum by ascending adds from
    0 (out [R]); 1: tl.sum (out [R]); 2: the running sums by ascending adds (out [R, N]);
    3: tl.cumsum (out [R, N])."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < R
    if MODE == 0 or MODE == 2:
        acc = tl.zeros([BR], dtype=tl.float32)
        for j in range(N):
            acc = acc + tl.load(x_ptr + rows * N + j, mask=ok, other=0.0)
            if MODE == 2:
                tl.store(out_ptr + rows * N + j, acc, mask=ok)
        if MODE == 0:
            tl.store(out_ptr + rows, acc, mask=ok)
    else:
        cols = tl.arange(0, N)
        x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=ok[:, None], other=0.0)
        if MODE == 1:
            tl.store(out_ptr + rows, tl.sum(x, axis=1), mask=ok)
        else:
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], tl.cumsum(x, axis=1), mask=ok[:, None])


@triton.jit
def _unary_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, OP: tl.constexpr):
    """OP 0: tl.exp, 1: libdevice.exp, 2: tl.rsqrt, 3: libdevice.rsqrt."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=1.0)
    if OP == 0:
        y = tl.exp(x)
    elif OP == 1:
        y = libdevice.exp(x)
    elif OP == 2:
        y = tl.rsqrt(x)
    else:
        y = libdevice.rsqrt(x)
    tl.store(out_ptr + i, y, mask=i < n)


@triton.jit
def _bmm_kernel(a_ptr, b_ptr, c_ptr, sab, sam, sak, sbb, sbk, sbn, M: tl.constexpr, N: tl.constexpr,
                K: tl.constexpr, MODE: tl.constexpr):
    """C[b] = A[b] @ B[b] (fp32, any strides; C contiguous [M, N]), one program a batch entry.
    MODE 0: ascending k, acc = fma(a, b, acc) from 0; 1: the two halves of k so, then added;
    2: tl.dot with input_precision "ieee"."""
    pid = tl.program_id(0)
    m, n = tl.arange(0, M), tl.arange(0, N)
    a_base, b_base = a_ptr + pid * sab, b_ptr + pid * sbb
    if MODE == 2:
        k = tl.arange(0, K)
        a = tl.load(a_base + m[:, None] * sam + k[None, :] * sak)
        b = tl.load(b_base + k[:, None] * sbk + n[None, :] * sbn)
        acc = tl.dot(a, b, input_precision="ieee")
    elif MODE == 0:
        acc = tl.zeros([M, N], dtype=tl.float32)
        for kk in range(K):
            acc = tl.fma(tl.load(a_base + m * sam + kk * sak)[:, None], tl.load(b_base + kk * sbk + n * sbn)[None, :],
                         acc)
    else:
        lo = tl.zeros([M, N], dtype=tl.float32)
        hi = tl.zeros([M, N], dtype=tl.float32)
        for kk in range(K // 2):
            lo = tl.fma(tl.load(a_base + m * sam + kk * sak)[:, None], tl.load(b_base + kk * sbk + n * sbn)[None, :],
                        lo)
            k2 = kk + K // 2
            hi = tl.fma(tl.load(a_base + m * sam + k2 * sak)[:, None], tl.load(b_base + k2 * sbk + n * sbn)[None, :],
                        hi)
        acc = lo + hi
    tl.store(c_ptr + pid * M * N + m[:, None] * N + n[None, :], acc)


@triton.jit
def _trsm_kernel(l_ptr, b_ptr, x_ptr, M: tl.constexpr, N: tl.constexpr, FMA: tl.constexpr):
    """X[p] = L[p]^-1 B[p], L unit lower [M, M], B [M, N] (contiguous fp32), one program a batch
    entry, by forward substitution: for each column j ascending, every row i > j takes
    L[i, j] x_j off (FMA: one rounding; else the product rounded first), so each x_i is
    b_i less its terms in ascending j."""
    pid = tl.program_id(0)
    m, n = tl.arange(0, M), tl.arange(0, N)
    x = tl.load(b_ptr + pid * M * N + m[:, None] * N + n[None, :])
    for j in range(M - 1):
        xj = tl.sum(tl.where(m[:, None] == j, x, 0.0), axis=0)                  # row j (final now)
        lj = tl.load(l_ptr + pid * M * M + m * M + j, mask=m > j, other=0.0)     # column j below the diagonal
        if FMA:
            x = tl.fma(-lj[:, None], xj[None, :], x)
        else:
            x = x - lj[:, None] * xj[None, :]
    tl.store(x_ptr + pid * M * N + m[:, None] * N + n[None, :], x)


# ------------------------------------------------------------------ the probe
def _compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    ref, got = ref.float().reshape(-1), got.float().reshape(-1)
    same = (ref == got) | (ref.isnan() & got.isnan())
    return {"equal": float(same.float().mean()), "max_abs": float((ref - got).abs().nan_to_num(0.0).max())}


def _rows(kernel_mode: int, x: torch.Tensor, scan: bool) -> torch.Tensor:
    R, N = x.shape
    out = torch.empty_like(x) if scan else torch.empty(R, dtype=x.dtype, device=x.device)
    _row_scan_kernel[(triton.cdiv(R, 128),)](x, out, R, N=N, BR=128, MODE=kernel_mode)
    return out


def _unary(op: int, x: torch.Tensor) -> torch.Tensor:
    flat = x.contiguous().reshape(-1)
    out = torch.empty_like(flat)
    _unary_kernel[(triton.cdiv(flat.numel(), 1024),)](flat, out, flat.numel(), BLOCK=1024, OP=op)
    return out.view_as(x)


def _bmm(a: torch.Tensor, b: torch.Tensor, mode: int) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] over the flattened batch (each a view with one batch stride)."""
    lead = a.shape[:-2]
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    a3, b3 = a.reshape(-1, M, K), b.reshape(-1, K, N)
    out = torch.empty((a3.shape[0], M, N), dtype=torch.float32, device=a.device)
    _bmm_kernel[(a3.shape[0],)](a3, b3, out, a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1),
                                b3.stride(2), M=M, N=N, K=K, MODE=mode, num_warps=8)
    return out.view(*lead, M, N)


def _trsm(L: torch.Tensor, B: torch.Tensor, fma: bool) -> torch.Tensor:
    M, N = B.shape[-2], B.shape[-1]
    l3, b3 = L.reshape(-1, M, M).contiguous(), B.reshape(-1, M, N).contiguous()
    out = torch.empty_like(b3)
    _trsm_kernel[(l3.shape[0],)](l3, b3, out, M=M, N=N, FMA=fma, num_warps=8)
    return out.view(B.shape)


def reference_pieces(q, k, v, g, beta):
    """The reference's chain (gdn.delta_rule_chunked_reference from a zero state, T a multiple
    of the chunk) with each piece's inputs and torch's output kept: {piece: (inputs, output)},
    and the reference's (out, state) as it computes them from those pieces."""
    B, T, H, Dk = k.shape
    n = T // C
    qf, kf, vf, gf, bf = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                          for t in (q, k, v, g, beta))
    pieces = {}
    sq = kf * kf
    ss = sq.sum(dim=-1, keepdim=True)
    pieces["sum128"] = ((sq.reshape(-1, Dk),), ss.reshape(-1))
    rs = torch.rsqrt(ss + gdn.EPS)
    pieces["rsqrt"] = (((ss + gdn.EPS),), rs)
    kn = kf * rs
    qn = qf * torch.rsqrt((qf * qf).sum(dim=-1, keepdim=True) + gdn.EPS)
    qn = qn * Dk ** -0.5
    vb, kb = vf * bf.unsqueeze(-1), kn * bf.unsqueeze(-1)
    qn, kn, kb, vb = (t.reshape(B, H, n, C, t.shape[-1]) for t in (qn, kn, kb, vb))
    gamma = gf.reshape(B, H, n, C).cumsum(dim=3)
    pieces["cumsum64"] = ((gf.reshape(-1, C),), gamma.reshape(-1, C))
    above = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    diff = (gamma.unsqueeze(4) - gamma.unsqueeze(3)).masked_fill(above, float("-inf"))
    decay = diff.exp()
    pieces["exp"] = ((diff,), decay)
    kkt = kb @ kn.transpose(-1, -2)
    pieces["mm_kkt"] = ((kb, kn.transpose(-1, -2)), kkt)
    system = kkt * decay
    attn = (qn @ kn.transpose(-1, -2)) * decay
    kb_decayed = kb * gamma.exp().unsqueeze(-1)
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    pieces["trsm"] = ((system, vb), u)
    w = torch.linalg.solve_triangular(system, kb_decayed, upper=False, unitriangular=True)
    S = torch.zeros((B, H, Dk, v.shape[-1]), dtype=torch.float32, device=q.device)
    out = torch.zeros_like(u)
    qd = qn * gamma.exp().unsqueeze(-1)
    kd = kn * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    carry = gamma[..., -1].exp()[..., None, None]
    for c in range(n):
        ws = w[:, :, c] @ S
        v_new = u[:, :, c] - ws
        av = attn[:, :, c] @ v_new
        out[:, :, c] = qd[:, :, c] @ S + av
        ktv = kd[:, :, c].transpose(-1, -2) @ v_new
        if c == n // 2:                      # a chunk with a state that is not zero
            pieces["mm_ws"] = ((w[:, :, c], S), ws)
            pieces["mm_av"] = ((attn[:, :, c], v_new), av)
            pieces["mm_ktv"] = ((kd[:, :, c].transpose(-1, -2), v_new), ktv)
        S = S * carry[:, :, c] + ktv
    out = out.reshape(B, H, -1, v.shape[-1]).transpose(1, 2).to(q.dtype, memory_format=torch.contiguous_format)
    return pieces, (out, S)


def _tree(v: torch.Tensor) -> torch.Tensor:
    """Sums over the last axis (a power of two) as a warp's shuffle-down tree: at offset 1, 2, 4, ...
    lane t adds lane t + offset's value; lane 0's total."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def _sum_strided(x: torch.Tensor) -> torch.Tensor:
    """torch's CUDA reduce of a contiguous row of 128 (as read from its Reduce.cuh: 32 lanes, lane t
    holding x[t], x[t + 32], x[t + 64], x[t + 96] in four accumulators combined in order, then the
    lanes' tree), emulated by elementwise fp32 adds."""
    v = x.view(*x.shape[:-1], 4, 32)
    return _tree(((v[..., 0, :] + v[..., 1, :]) + v[..., 2, :]) + v[..., 3, :])


def _sum_vec4(x: torch.Tensor) -> torch.Tensor:
    """The same with vectorized loads (lane t holding x[4t .. 4t + 3])."""
    v = x.view(*x.shape[:-1], 32, 4)
    return _tree(((v[..., 0] + v[..., 1]) + v[..., 2]) + v[..., 3])


def _cumsum_sklansky(x: torch.Tensor, half: int = 16) -> torch.Tensor:
    """torch's CUDA scan of a contiguous row (its ScanUtils.cuh, as read: blocks of 2 x 16 values,
    the running total added into a block's first value, then the Sklansky levels s = 1, 2, ..., 16:
    value a + t % s takes value a - 1, a = (t // s) * 2s + s), emulated by elementwise fp32 adds."""
    out = torch.empty_like(x)
    total = torch.zeros_like(x[..., 0])
    width = 2 * half
    for b0 in range(0, x.shape[-1], width):
        buf = x[..., b0:b0 + width].clone()
        buf[..., 0] = buf[..., 0] + total
        s = 1
        while s <= half:
            t = torch.arange(half)
            a = (t // s) * (2 * s) + s
            ti, si = a + t % s, a - 1
            buf[..., ti] = buf[..., ti] + buf[..., si]
            s *= 2
        out[..., b0:b0 + width] = buf
        total = buf[..., -1]
    return out


CANDIDATES = {
    "sum128": {"ascending": lambda x: _rows(0, x, False), "tl.sum": lambda x: _rows(1, x, False),
               "torch_strided4_tree32": _sum_strided, "vec4_tree32": _sum_vec4},
    "rsqrt": {"tl.rsqrt": lambda x: _unary(2, x), "libdevice.rsqrt": lambda x: _unary(3, x)},
    "exp": {"tl.exp": lambda x: _unary(0, x), "libdevice.exp": lambda x: _unary(1, x)},
    "cumsum64": {"ascending": lambda x: _rows(2, x, True), "tl.cumsum": lambda x: _rows(3, x, True),
                 "sklansky_2x16": _cumsum_sklansky},
    "trsm": {"ascending_fma": lambda L, b: _trsm(L, b, True), "ascending_rounded": lambda L, b: _trsm(L, b, False)},
}
for _p in ("mm_kkt", "mm_ws", "mm_av", "mm_ktv"):
    CANDIDATES[_p] = {"ascending_fma": lambda a, b: _bmm(a, b, 0), "halves_fma": lambda a, b: _bmm(a, b, 1),
                      "tl.dot_ieee": lambda a, b: _bmm(a, b, 2)}


TORCH_OPS = {"sum128": lambda x: x.sum(-1), "rsqrt": torch.rsqrt, "exp": torch.exp, "cumsum64": lambda x: x.cumsum(-1),
             "trsm": lambda a, b: torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)}


def _time_us(fn, reps: int = 20) -> float:
    """Median microseconds of fn() on the GPU (CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def graphed_us(fn, reps: int = 20) -> float:
    """Median microseconds of one replay of fn captured as one CUDA graph (after a run on a side
    stream: kernels compiled, allocations made)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return round(_time_us(graph.replay, reps=reps), 1)


def timings(pieces: dict, q, k, v, g, beta) -> dict:
    """What a rule built from the reference's own ops would cost (the GPU only): each piece's torch
    op once (us), and the whole reference rule eager and, if it captures, as one CUDA graph."""
    out = {name: round(_time_us(lambda: TORCH_OPS.get(name, lambda a, b: a @ b)(*ins)), 1)
           for name, (ins, _) in pieces.items()}
    rule = lambda: gdn.delta_rule_chunked_reference(q, k, v, g, beta)  # noqa: E731
    out["rule_eager"] = round(_time_us(rule, reps=5), 1)
    try:
        out["rule_graph"] = graphed_us(rule, reps=5)
    except Exception as exc:  # noqa: BLE001 - the reference may not capture (e.g. a host sync in the solve)
        out["rule_graph"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


def inputs(B: int, T: int, H: int, dev, seed: int):
    """Prompt-pass-like inputs at the 4B's GDN heads: q, k, v [B, T, H, 128] bf16 (k, q as the
    conv leaves them), g [B, T, H] fp32 log decays, beta [B, T, H] bf16."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, 128, generator=gen).to(dev, torch.bfloat16) for _ in range(3))
    g = (-F.softplus(torch.randn(B, T, H, generator=gen)) * 0.3).to(dev)
    beta = torch.rand(B, T, H, generator=gen).to(dev, torch.bfloat16)
    return q, k, v, g, beta


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4x2048", help="BxT (T a multiple of 64)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    B, T = (int(x) for x in args.shape.split("x"))
    if T % C:
        raise SystemExit(f"--shape: T ({T}) must be a multiple of {C}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False          # the reference's numerics (the judge's)
    torch.backends.cudnn.allow_tf32 = False
    with torch.inference_mode():
        q, k, v, g, beta = inputs(B, T, args.heads, dev, args.seed)
        pieces, (out, state) = reference_pieces(q, k, v, g, beta)
        ref_out, ref_state = gdn.delta_rule_chunked_reference(q, k, v, g, beta)
        report = {"shape": args.shape, "heads": args.heads, "device": str(dev),
                  "chain_is_the_reference": bool(torch.equal(out, ref_out) and torch.equal(state, ref_state)),
                  "pieces": {}}
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        for name, (ins, want) in pieces.items():
            report["pieces"][name] = {}
            for cand, fn in CANDIDATES[name].items():
                if interpreted and cand.startswith("libdevice"):      # not in the interpreter
                    continue
                try:
                    report["pieces"][name][cand] = _compare(want, fn(*ins))
                except Exception as exc:  # noqa: BLE001 - one candidate that does not compile: the rest still run
                    report["pieces"][name][cand] = {"equal": None, "max_abs": None,
                                                    "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if dev.type == "cuda":
            report["torch_us"] = timings(pieces, q, k, v, g, beta)
    print(f"{args.shape}, {args.heads} heads on {dev}; the pieces chain to the reference bit for bit: "
          f"{report['chain_is_the_reference']}")
    print(f"{'piece':10s} {'candidate':22s} {'bit-equal':>10s} {'max |diff|':>11s}")
    for name, cands in report["pieces"].items():
        for cand, r in cands.items():
            if r["equal"] is None:
                print(f"{name:10s} {cand:22s} {r['error']}")
            else:
                print(f"{name:10s} {cand:22s} {r['equal']:10.6f} {r['max_abs']:11.3e}")
    if "torch_us" in report:
        print("torch's ops, us (one layer):", report["torch_us"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

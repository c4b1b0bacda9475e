"""Qwen3.5's decode step on the Triton op set (fq_qwen35: fqkernels.decode_attention and the
GDN step kernels) against the torch op set (the references, Transformers 5.17's bits on the
CPU: tests/test_engine_qwen35_cpu.py), teacher-forced on the tiny preset past a GDN chunk:
the prompt pass (its rule and norms on the kernels) and the decode logits and states within
the kernels' fp32-order noise. Under
Triton's CPU interpreter (Triton >= 3.4) for the logic; on a GPU for the bits, and there the
step captured as a CUDA graph must replay what it computes eagerly."""
from __future__ import annotations

import sys

import pytest
import torch

from engine_modules import ENGINE_DIR, KERNEL_DEVICE, KERNELS_RUN, KERNELS_SKIP_REASON

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

import fq_config  # noqa: E402
import fq_qwen35  # noqa: E402
import fq_weights  # noqa: E402
from fq_ops import TorchOps, TritonOps  # noqa: E402

from fastqwen import synth35  # noqa: E402

DEV = torch.device(KERNEL_DEVICE)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not KERNELS_RUN, reason=KERNELS_SKIP_REASON)]

B, S, N = 2, 70, 6


@pytest.fixture(autouse=True)
def _interpreter(interpreter_fixes):
    """tests/kernels/conftest.py: the interpreter's dot and bf16 rounding as on the GPU."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # Transformers' init, which the bounds below were measured on: the default (fastqwen) family's
    # sharper logits amplify the same fp32-order noise (0.23 against 0.13 allowed here; its own
    # cached decode moves 0.19-0.25 from its full forward, fastqwen/synth35.py).
    path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35k") / "tiny", seed=3, progress=False,
                              init="transformers")
    cfg = fq_config.Qwen35Config.from_dir(str(path))
    return cfg, fq_weights.load_qwen35_weights(str(path), cfg, DEV, pack=False)


def _model(cfg, w, backend: str, exact_decode: bool = True):
    """A Qwen3.5 model over the torch or the Triton op set (its own copy of the weights dict)."""
    ops = TritonOps(exact_decode) if backend == "triton" else TorchOps(exact_decode)
    return fq_qwen35.Qwen35Model(cfg, dict(w), DEV, ops, exact_decode=exact_decode)


def _forced(model, seq, n=N):
    """Prefill logits of seq[:, :S], then n - 1 teacher-forced decode steps' logits; final states."""
    model.ensure_rope(S + n)
    model.allocate_cache(seq.shape[0], S + n)
    with torch.inference_mode():
        out = [model.prefill_logits(seq[:, :S])]
        pos = torch.full((seq.shape[0],), S, dtype=torch.int32, device=DEV)
        for t in range(S, S + n - 1):
            out.append(model.decode_logits(seq[:, t].contiguous(), pos, pos + 1))
            pos += 1
    return torch.stack(out, 1).float(), model.conv_state.clone(), model.state.clone()


def test_triton_step_tracks_the_reference(tiny):
    cfg, w = tiny
    seq = torch.randint(0, cfg.vocab_size, (B, S + N), generator=torch.Generator().manual_seed(4)).to(DEV)
    ref, conv_ref, state_ref = _forced(_model(cfg, w, "torch"), seq)
    got, conv_got, state_got = _forced(_model(cfg, w, "triton"), seq)
    diff = (got - ref).abs().max().item()
    spread = ref.std().item()
    assert diff <= 0.02 * spread + 0.07, f"decode logits differ by {diff} (logit spread {spread:.2f})"
    assert (got[:, 1:].argmax(-1) == ref[:, 1:].argmax(-1)).float().mean() >= 0.8
    # The states hold (and sum) inputs that carry the earlier layers' rounding noise.
    conv_diff = (conv_got.float() - conv_ref.float()).abs().max().item()
    assert conv_diff <= 0.05 * conv_ref.float().abs().max().item(), conv_diff
    state_diff = (state_got - state_ref).abs().max().item()
    assert state_diff <= 0.05 * state_ref.abs().max().item(), state_diff


def test_exact_decode_triton_tracks_the_exact_reference(tiny):
    """Exact GDN decode (exact_decode: the full forward's rows, fqkernels.gdn_exact_step) on both
    op sets: the Triton one's prompt tail and steps through fused_step, the torch one's through
    the reference's chunked rule (tests/test_gdn_exact_decode_cpu.py: the full forward's bits on
    the CPU); within the same bounds, and the states the caches keep (the chunk's start) too. On
    a GPU the decode crosses a chunk boundary (the close); under the interpreter 6 steps (each
    step there takes seconds a layer)."""
    cfg, w = tiny
    n = N if DEV.type == "cpu" else 70
    seq = torch.randint(0, cfg.vocab_size, (B, S + n), generator=torch.Generator().manual_seed(4)).to(DEV)
    ref, _, state_ref = _forced(_model(cfg, w, "torch", True), seq, n)
    got, _, state_got = _forced(_model(cfg, w, "triton", True), seq, n)
    diff = (got - ref).abs().max().item()
    spread = ref.std().item()
    assert diff <= 0.02 * spread + 0.07, f"decode logits differ by {diff} (logit spread {spread:.2f})"
    assert (got[:, 1:].argmax(-1) == ref[:, 1:].argmax(-1)).float().mean() >= 0.8
    assert (state_got - state_ref).abs().max().item() <= 0.05 * state_ref.abs().max().item()


def _all_products_on_the_gemv(model, rows):
    model.ops.force_gemv(model.decode_products(), rows)


@pytest.mark.parametrize("rows", [1, B])
def test_triton_step_on_the_gemv_tracks_the_reference(tiny, monkeypatch, rows):
    """Every decode product through our GEMV (what tune picks where it is faster), at one row
    in_proj's with the conv and gates in its epilogue (gdn_step.in_proj_conv_gates_step): the same
    bounds as on cuBLAS."""
    cfg, w = tiny
    seq = torch.randint(0, cfg.vocab_size, (rows, S + N), generator=torch.Generator().manual_seed(4)).to(DEV)
    ref, _, state_ref = _forced(_model(cfg, w, "torch"), seq)
    model = _model(cfg, w, "triton")
    _all_products_on_the_gemv(model, rows)
    assert len(model.ops.use_gemv) >= 6
    calls = []
    real_linear, real_silu = model.ops._gemv.linear, model.ops._gemv.linear_silu_mul

    class _Counting:      # the GEMV, counting its calls
        linear = staticmethod(lambda x, w, **kw: calls.append("linear") or real_linear(x, w, **kw))
        linear_silu_mul = staticmethod(lambda x, w, **kw: calls.append("silu_mul") or real_silu(x, w, **kw))
        select_config = staticmethod(model.ops._gemv.select_config)

    from fqkernels import gdn_step

    real_fused = gdn_step.in_proj_conv_gates_step
    monkeypatch.setattr(gdn_step, "in_proj_conv_gates_step",
                        lambda *a, **k: calls.append("in_proj_epilogue") or real_fused(*a, **k))
    model.ops._gemv = _Counting
    got, _, state_got = _forced(model, seq)
    want = {"linear", "silu_mul"} | ({"in_proj_epilogue"} if rows == 1 else set())
    assert want <= set(calls), "a product kind never went through the GEMV"
    assert ("in_proj_epilogue" in calls) == (rows == 1)
    diff = (got - ref).abs().max().item()
    spread = ref.std().item()
    assert diff <= 0.02 * spread + 0.07, f"decode logits differ by {diff} (logit spread {spread:.2f})"
    assert (state_got - state_ref).abs().max().item() <= 0.05 * state_ref.abs().max().item()


@pytest.mark.parametrize("on_gemv", [False, True], ids=["cublas", "gemv"])
def test_the_packed_qkv_product_is_the_three_products(tiny, on_gemv):
    """The Triton op set's q | k | v (one packed matrix): in decode one product whose column
    slices are q_proj's, k_proj's and v_proj's outputs: on our GEMV bit for bit (the pack's
    config, given to the separate products too: a column's sum does not depend on the other
    columns), on cuBLAS within a BF16 ulp (another shape may take another kernel); in a prompt
    pass (more than GEMV_MAX_ROWS rows) the separate products on the pack's row slices, the
    same bits as on the separate matrices."""
    from fqkernels import gemv

    cfg, w = tiny
    model = _model(cfg, w, "triton")
    p = f"model.layers.{next(iter(model.attn_slot))}.self_attn."
    packed = model.w[p + "qkv_proj.weight"]
    assert not any(p + f"{n}_proj.weight" in model.w for n in "qkv"), "the originals stay after packing"
    if on_gemv:
        _all_products_on_the_gemv(model, B)
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(B, 1, cfg.hidden_size, generator=gen).bfloat16().to(DEV)
    rows = h.reshape(B, -1)
    config = gemv.select_config(*packed.shape, False, B)
    for got, name in zip(model.ops.linear_parts(h, packed, model.qkv_sizes), "qkv"):
        sep = w[p + f"{name}_proj.weight"]
        assert got.shape == (B, 1, sep.shape[0])
        if on_gemv:
            assert torch.equal(got.reshape(B, -1), gemv.linear(rows, sep, config=config)), name
        else:
            want = torch.nn.functional.linear(h, sep).float()
            assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all(), name
    prompt = torch.randn(B, TritonOps.GEMV_MAX_ROWS, cfg.hidden_size, generator=gen).bfloat16().to(DEV)
    for got, name in zip(model.ops.linear_parts(prompt, packed, model.qkv_sizes), "qkv"):
        assert torch.equal(got, torch.nn.functional.linear(prompt, w[p + f"{name}_proj.weight"])), name


@pytest.mark.skipif(DEV.type != "cuda", reason="times products on a GPU")
def test_tune_times_every_decode_product(tiny):
    cfg, w = tiny
    model = _model(cfg, w, "triton")
    products = model.decode_products()
    report = model.ops.tune(products, B)
    assert set(report) == {p.name for p in products} and len(products) == 7
    want = {(p.silu, B) + tuple(w.shape) for p in products for w in p.weights}
    assert set(model.ops.use_gemv) == want
    assert all(len(t) == 2 and min(t) > 0 for t in report.values()), report


def test_a_wrong_gdn_step_is_caught(tiny, monkeypatch):
    """The comparison above can fail: a decay applied twice in the kernel path (the recurrent
    step's) is far off."""
    from fqkernels import gdn_step

    cfg, w = tiny
    seq = torch.randint(0, cfg.vocab_size, (B, S + N), generator=torch.Generator().manual_seed(4)).to(DEV)
    ref, _, _ = _forced(_model(cfg, w, "torch", False), seq)
    real = gdn_step.decode_step
    monkeypatch.setattr(gdn_step, "decode_step", lambda q, k, v, g, beta, state: real(q, k, v, 2 * g, beta, state))
    got, _, _ = _forced(_model(cfg, w, "triton", False), seq)
    assert (got[:, 1:] - ref[:, 1:]).abs().max().item() > 0.02 * ref[:, 1:].std().item() + 0.07


@pytest.mark.skipif(DEV.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("exact", [False, True], ids=["recurrent", "exact-decode"])
def test_the_step_replays_as_a_graph(tiny, exact):
    from fq_decode import DecodeRunner

    cfg, w = tiny
    seq = torch.randint(0, cfg.vocab_size, (B, S + N), generator=torch.Generator().manual_seed(5)).to(DEV)
    toks = {}
    for graph in (False, True):
        model = _model(cfg, w, "triton", exact)
        model.ensure_rope(S + N)
        model.allocate_cache(B, S + N)
        with torch.inference_mode():
            runner = DecodeRunner(model, B, use_graph=graph)
            runner.start(model.prefill(seq[:, :S]), S)
            out = []
            for _ in range(N):
                runner.step()
                out.append(runner.tokens.clone())
        toks[graph] = torch.stack(out)
    assert torch.equal(toks[True], toks[False])


@pytest.mark.skipif(DEV.type != "cuda", reason="CUDA graphs need a GPU")
def test_the_prompt_pass_replays_as_a_graph(tiny):
    """The prompt pass captured after an eager pass of its shape (fq_decode.PrefillGraph, as the
    engine captures it) replays, on other prompts, the eager pass's first tokens, last-position
    logits' argmax and every cache it fills: KV, conv states and recurrent states, bit for bit."""
    from fq_decode import PrefillGraph

    cfg, w = tiny
    model = _model(cfg, w, "triton")
    model.ensure_rope(S + N)
    model.allocate_cache(B, S + N)
    gen = torch.Generator().manual_seed(6)
    warm, probe = (torch.randint(0, cfg.vocab_size, (B, S), generator=gen).to(DEV) for _ in range(2))

    def caches():
        return [t[..., :S, :].clone() if t.dim() == 5 else t.clone()
                for t in (model.k_cache, model.v_cache, model.conv_state, model.state)]

    with torch.inference_mode():
        model.prefill(warm)
        graph = PrefillGraph(model, B, S)
        eager = model.prefill(probe).clone()
        want = caches()
        model.prefill(warm)                       # other contents, so the replay must rewrite them
        replayed = graph.run(probe).clone()
        got = caches()
    assert torch.equal(replayed, eager)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_prompt_mlp_in_row_slices_is_the_whole_one(tiny, monkeypatch):
    """The Triton op set's prompt pass runs its MLP over row slices past MLP_ROWS tokens (the
    activations' bound): the same logits as unsliced within the products' rounding (a slice's
    product may pick another kernel for its row count), the same greedy tokens."""
    cfg, w = tiny
    seq = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(8)).to(DEV)
    out = {}
    for rows in (None, 50):                        # 2 x 70 = 140 prompt rows: three slices of <= 50
        if rows:
            monkeypatch.setattr(TritonOps, "MLP_ROWS", rows)
        model = _model(cfg, w, "triton")
        model.ensure_rope(S)
        model.allocate_cache(B, S)
        with torch.inference_mode():
            out[rows] = model.prefill_logits(seq).float()
    diff = (out[50] - out[None]).abs().max().item()
    assert diff <= 0.02 * out[None].std().item() + 0.07, diff
    assert torch.equal(out[50].argmax(-1), out[None].argmax(-1))


def test_triton_prompt_in_chunks_tracks_the_whole_prompt(tiny):
    """The Triton op set's prompt pass continued from cached states (prefill_logits with start:
    the conv and the chunked rule from the rows' states, the attention over the cached keys):
    a 70-token prompt as 64 + 6 gives the last logits and the states of the whole pass within
    the kernels' fp32-order noise, and the same argmax."""
    cfg, w = tiny
    seq = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(5)).to(DEV)
    model = _model(cfg, w, "triton")
    model.ensure_rope(S + 1)
    model.allocate_cache(B, S + 1)
    with torch.inference_mode():
        whole = model.prefill_logits(seq).float()
        states = model.conv_state.clone(), model.state.clone()
        model.prefill_logits(seq[:, :64])
        chunked = model.prefill_logits(seq[:, 64:], start=64).float()
    spread = whole.std().item()
    assert (chunked - whole).abs().max().item() <= 0.02 * spread + 0.07
    assert torch.equal(chunked.argmax(-1), whole.argmax(-1))
    # the conv state holds the last rows of in_proj's products, whose kernels the row count picks
    # (140 rows against 12) in every layer up to it: the same noise as the logits, not the same bits
    conv, conv_whole = model.conv_state.float(), states[0].float()
    assert (conv - conv_whole).abs().max().item() <= 0.02 * conv_whole.abs().max().item() + 1e-3
    assert (model.state - states[1]).abs().max().item() <= 1e-4 * states[1].abs().max().item()

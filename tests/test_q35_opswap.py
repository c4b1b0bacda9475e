"""scripts/gpu_q35_opswap.py on the CPU, on a tiny Qwen3.5: the script end to end (native
Transformers 5.17.0 in its own environment, .venv-qwen35), its teacher-forced engine steps
against the engine's own greedy tokens, and the two triton-only patches (the GDN output
kernel's precision, the unpacked prompt-pass products) applied and undone."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine_modules import ENGINE_DIR, REPO
from fastqwen import refenv, synth35

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

SCRIPT = REPO / "scripts" / "gpu_q35_opswap.py"
needs_517 = pytest.mark.skipif(not (refenv.qwen35_site() / "transformers").is_dir(),
                               reason="the Qwen3.5 reference (Transformers 5.17.0, .venv-qwen35) is not installed")


def _script():
    """The script as a module (imported, it leaves sys.path's Transformers alone)."""
    if "gpu_q35_opswap" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_q35_opswap", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["gpu_q35_opswap"] = module
    return sys.modules["gpu_q35_opswap"]


@pytest.fixture(autouse=True)
def recurrent_decode(monkeypatch):
    """The probe's swaps are of the recurrent GDN decode step's pieces: its engines and models here
    take that step (the engine's default is exact decode; the script does the same unless
    FASTQWEN_GDN_EXACT_DECODE=1)."""
    import fq_qwen35

    monkeypatch.setattr(fq_qwen35, "EXACT_DECODE", False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35op") / "tiny", seed=3, progress=False)


@needs_517
def test_the_probe_runs_on_the_cpu(tiny, tmp_path):
    out = tmp_path / "report.json"
    # one thread: the second shape runs past one GDN chunk (64), and with another process on the
    # machine's cores two OpenMP threads took this from seconds to minutes
    env = dict(refenv.reference_env("qwen3_5_text"), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny), "--shapes", "2x40x6,2x100x6",
                          "--variants", "engine,engine_out_tf32x3,torch_backend", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["engine"]["backend"] == "torch"
    assert list(report["shapes"]) == ["2x40x6", "2x100x6"]
    for shape, entry in report["shapes"].items():
        B, _, G = (int(v) for v in shape.split("x"))
        res = entry["results"]
        assert list(res) == ["native_cached", "engine", "torch_backend"], list(res)
        assert "triton" in entry["skipped"]["engine_out_tf32x3"]
        for name, r in res.items():
            assert r["positions"] == B * G, (name, r)
            assert all(math.isfinite(r[k]) for k in ("mean_max_abs", "p99_max_abs", "max_abs", "max_slack")), r
            assert 0 <= r["argmax_agree"] <= r["positions"]
        # native's cached decode emitted its tokens; the engine on the CPU runs the torch reference,
        # which is that cached decode bit for bit (test_engine_qwen35_cpu.py): the same figures
        assert res["native_cached"]["native_token_agree"] == B * G
        same = ("mean_max_abs", "p99_max_abs", "max_abs", "argmax_agree", "max_slack", "native_token_agree")
        for name in ("engine", "torch_backend"):
            assert {k: res[name][k] for k in same} == {k: res["native_cached"][k] for k in same}, name
        assert entry["self_check"] == {"positions": B * G, "agree": B * G}
        assert f"== {shape}" in run.stdout


@needs_517
def test_the_full_forward_with_the_prompts_rule_swapped(tiny, tmp_path):
    """fullfwd_prompt_reference (the full forward with its first 64 positions' chunked rule from
    gdn.chunked_prefill_reference and the rest from Transformers' own function from its state)
    must be the full forward itself, logits and all, over two seeds; the fast rule's twin needs the
    triton backend; a prompt that is not a multiple of the chunk is skipped by name."""
    out = tmp_path / "report.json"
    env = dict(refenv.reference_env("qwen3_5_text"), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny), "--shapes", "2x64x6,1x40x4",
                          "--variants", "fullfwd_prompt_reference,fullfwd_prompt_fast,engine_gdn_decode_chunked",
                          "--seeds", "5,6",
                          "--no-self-check", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["seeds"] == [5, 6] and list(report["shapes"]) == ["2x64x6@5", "2x64x6@6", "1x40x4@5", "1x40x4@6"]
    for key, entry in report["shapes"].items():
        assert "triton" in entry["skipped"]["fullfwd_prompt_fast"]
        if key.startswith("1x40x4"):
            assert "multiple of 64" in entry["skipped"]["fullfwd_prompt_reference"]
            assert "multiple of 64" in entry["skipped"]["engine_gdn_decode_chunked"]
            continue
        chunked = entry["results"]["engine_gdn_decode_chunked"]
        assert chunked["positions"] == 12 and math.isfinite(chunked["mean_max_abs"])
        r = entry["results"]["fullfwd_prompt_reference"]
        gdn_layers = sum(kind == "linear_attention" for kind in json.loads((tiny / "config.json").read_text())
                         .get("layer_types", []))
        assert gdn_layers and r["rule_rows"] == 2 * gdn_layers, (r["rule_rows"], gdn_layers)   # the swap ran
        assert r["positions"] == 12 and r["max_abs"] == 0.0 and r["max_slack"] == 0.0, r
        assert r["argmax_agree"] == 12 and r["count_slack_gt_0.25"] == 0
    total = report["totals"]["fullfwd_prompt_reference"]
    assert total["positions"] == 24 and total["mean_max_abs"] == 0.0
    assert report["totals"]["native_cached"]["positions"] == 2 * 12 + 2 * 4
    assert "== totals over 4 run(s)" in run.stdout


def test_forced_steps_reproduce_the_engines_greedy_tokens(tiny):
    """The probe's positions / lengths / cache conventions: teacher-forced on Engine.generate's own
    tokens, the steps' argmax is those tokens; forced on other tokens it is not (the check can fail)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # as the test above, for the same reason
    try:
        _forced_steps_check(tiny)
    finally:
        torch.set_num_threads(threads)


def _forced_steps_check(tiny):
    from engine import Engine

    mod = _script()
    eng = Engine(str(tiny))
    prompts = torch.randint(0, 1024, (2, 70), generator=torch.Generator().manual_seed(2))
    greedy = torch.tensor(list(eng.generate(prompts.tolist(), 8))).T.contiguous()
    assert greedy.unique().numel() > 3, "the continuation must vary"
    forced = mod.forced_logits(eng.model, prompts, greedy)
    assert forced.shape == (2, 8, 1024) and forced.dtype == torch.bfloat16
    assert torch.equal(forced.argmax(-1), greedy)
    other = torch.roll(greedy, 1, dims=1)
    assert not torch.equal(mod.forced_logits(eng.model, prompts, other)[:, 1:].argmax(-1), greedy[:, 1:])
    # against the full forward itself (here: the forced steps), every figure is exact
    r = mod.compare(forced, forced.float(), greedy)
    assert r["max_abs"] == 0 and r["argmax_agree"] == 16 and r["max_slack"] == 0 and r["native_token_agree"] == 16
    assert r["first_mean_max_abs"] == 0 and r["decode_mean_max_abs"] == 0
    # the prompt pass on another model (here a second torch-backend model on the same weights):
    # its caches carry over, so the decode steps are the same bit for bit; with those caches
    # not copied (a model whose prompt pass is left on zeros) they are not
    import fq_qwen35
    other_model = fq_qwen35.Qwen35Model(eng.cfg, fq_qwen35.load_weights(str(tiny), eng.cfg, eng.model.device, pack=False),
                                        eng.model.device, "torch")
    assert torch.equal(mod.forced_logits(eng.model, prompts, greedy, prompt_model=other_model), forced)
    assert other_model.state.shape[1] == 1 and other_model.k_cache.shape[3] == 2     # its caches given back
    skipped = mod.forced_logits(eng.model, prompts, greedy, prompt_model=_ZeroCaches(other_model))
    assert torch.equal(skipped[:, 0], forced[:, 0]) and not torch.equal(skipped[:, 1:], forced[:, 1:])
    d = forced.float()
    d[:, 0] += 1.0
    r = mod.compare(forced, d, greedy)
    assert r["first_mean_max_abs"] == 1.0 and r["decode_mean_max_abs"] == 0


class _ZeroCaches:
    """A model whose prompt pass returns the wrapped model's logits but leaves its caches zero."""
    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def prefill_logits(self, ids):
        out = self.model.prefill_logits(ids)
        for name in ("k_cache", "v_cache", "conv_state", "state"):
            getattr(self.model, name).zero_()
        return out


def test_plan_patch_is_applied_and_undone():
    from fqkernels import gdn

    mod = _script()
    orig = gdn.chunked_prefill
    with mod.plan_patch(out_prec="tf32x3"):
        patched = gdn.chunked_prefill
        assert patched is not orig and patched.keywords["plan"].out_prec == "tf32x3"
        assert patched.keywords["plan"].block_v == gdn.DEFAULT_PLAN.block_v   # the rest of the plan kept
    assert gdn.chunked_prefill is orig
    with mod.plan_patch(prec="bf16x2", solve_prec="bf16x3", block_v=16):
        plan = gdn.chunked_prefill.keywords["plan"]
        assert (plan.prec, plan.block_v, plan.out_prec) == ("bf16x2", 16, gdn.DEFAULT_PLAN.out_prec)
        assert plan.solve_form == "bf16x3"
    assert gdn.chunked_prefill is orig


def test_unpacked_products_are_the_separate_matrices(tiny, monkeypatch):
    """On a triton-backend model (packed weights; TRITON_INTERPRET lets it be built on the CPU),
    the patched products equal the separate matrices' F.linear calls, and the model's own
    products come back afterwards."""
    import fq_qwen35

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = fq_qwen35.Qwen35Config.from_dir(str(tiny))
    cpu = torch.device("cpu")
    plain = fq_qwen35.load_weights(str(tiny), cfg, cpu)
    model = fq_qwen35.Qwen35Model(cfg, fq_qwen35.load_weights(str(tiny), cfg, cpu, pack=True), cpu, "triton")
    x = torch.randn(3, 5, cfg.hidden_size).bfloat16()
    gdn_p, attn_p = "model.layers.0.linear_attn.", "model.layers.3.self_attn."
    assert cfg.layer_types[0] == "linear_attention" and cfg.layer_types[3] == "full_attention"
    with _script().unpacked_products(model):
        got_in = model.ops.linear(x, model.w[gdn_p + "in_proj.weight"])
        got_qkv = model.ops.linear(x, model.w[attn_p + "qkv_proj.weight"])
        got_mlp = model.ops.linear_silu_mul(x, model.w["model.layers.1.mlp.gate_up.weight"])
    want_in = torch.cat([F.linear(x, plain[gdn_p + f"in_proj_{n}.weight"]) for n in ("qkv", "z", "b", "a")], -1)
    want_qkv = torch.cat([F.linear(x, plain[attn_p + f"{n}_proj.weight"]) for n in "qkv"], -1)
    p = "model.layers.1.mlp."
    want_mlp = F.silu(F.linear(x, plain[p + "gate_proj.weight"])) * F.linear(x, plain[p + "up_proj.weight"])
    assert torch.equal(got_in, want_in) and torch.equal(got_qkv, want_qkv) and torch.equal(got_mlp, want_mlp)
    assert "linear" not in vars(model.ops) and model.ops.linear.__func__ is fq_qwen35._Products.linear


def test_no_exact_decode_tunes_without_it_and_restores_both():
    """engine_no_exact_decode's patch: the products tuned again with gemv.EXACT off, and after it
    gemv.EXACT and the products' choice as they were."""
    from types import SimpleNamespace

    from fqkernels import gemv

    mod = _script()
    seen = []
    ops = SimpleNamespace(use_gemv={("x",): True})
    ops.tune = lambda w, rows: (seen.append((gemv.EXACT, rows)), ops.use_gemv.update({("x",): False}))
    model = SimpleNamespace(ops=ops, w={})
    before = gemv.EXACT
    with mod.no_exact_decode(model, 16):
        assert gemv.EXACT is False and ops.use_gemv == {("x",): False}
    assert seen == [(False, 16)] and gemv.EXACT == before and model.ops.use_gemv == {("x",): True}


def test_the_torch_steps_are_the_torch_backends_own(tiny):
    """engine_gdn_step_torch / engine_attention_step_torch's steps (gdn_step_torch,
    attention_step_torch) on a torch-backend model are that model's own decode step, bit for bit
    (outputs and the caches they update), from the same caches; torch_steps puts them in the
    model's place and takes them out after, and the model's decode then gives its own logits."""
    import fq_qwen35

    mod = _script()
    cfg = fq_qwen35.Qwen35Config.from_dir(str(tiny))
    cpu = torch.device("cpu")
    model = fq_qwen35.Qwen35Model(cfg, fq_qwen35.load_weights(str(tiny), cfg, cpu), cpu, "torch")
    B, P = 2, 70
    prompts = torch.randint(0, cfg.vocab_size, (B, P), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        model.ensure_rope(P + 4)
        model.allocate_cache(B, P + 4)
        model.prefill_logits(prompts)
        h = torch.randn(B, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
        pos = torch.full((B,), P, dtype=torch.int32)
        caches = ("conv_state", "state", "k_cache", "v_cache")
        saved = {n: getattr(model, n).clone() for n in caches}

        def run(step):
            for n in caches:
                getattr(model, n).copy_(saved[n])
            out = step()
            return out, {n: getattr(model, n).clone() for n in caches}

        g = next(i for i, t in enumerate(cfg.layer_types) if t == "linear_attention")
        a = next(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
        cos, sin = model.cos[pos.long()].unsqueeze(1), model.sin[pos.long()].unsqueeze(1)
        for mine, own in ((lambda: mod.gdn_step_torch(model, g, h), lambda: model._gdn(g, h, None)),
                          (lambda: mod.attention_step_torch(model, a, h, pos, pos + 1),
                           lambda: model._attention_step(a, h, cos, sin, pos, pos + 1))):
            (o1, c1), (o2, c2) = run(mine), run(own)
            assert torch.equal(o1, o2) and all(torch.equal(c1[n], c2[n]) for n in caches)
            assert not torch.equal(c1["state"], saved["state"]) or not torch.equal(c1["k_cache"], saved["k_cache"])
        for n in caches:
            getattr(model, n).copy_(saved[n])
        tok = prompts[:, -1].contiguous()
        want = model.decode_logits(tok, pos, pos + 1)
        for n in caches:
            getattr(model, n).copy_(saved[n])
        with mod.torch_steps(model, True, True):
            assert "_gdn_step_kernels" in vars(model) and "_attention_step" in vars(model)
            got = model.decode_logits(tok, pos, pos + 1)     # the torch backend never calls the GDN kernels' step
        assert torch.equal(got, want)
        assert "_gdn_step_kernels" not in vars(model) and "_attention_step" not in vars(model)


def test_gdn_prompt_torch_swaps_the_references_in_and_back():
    """The prompt-pass patch: inside, fqkernels.gdn's prompt functions are the references with
    the kernels' contracts (the rule: gdn.chunked_prefill_reference, tested in test_gdn.py; the
    conv on [B, T, C], z as a packed row); after, the kernels again."""
    from fqkernels import gdn

    mod = _script()
    kernels = {n: getattr(gdn, n) for n in ("chunked_prefill", "gates", "causal_conv_prefill", "gated_rmsnorm")}
    gen = torch.Generator().manual_seed(0)
    B, T, D = 2, 70, 16
    with mod.gdn_prompt_torch(core_only=True):
        assert gdn.chunked_prefill is gdn.chunked_prefill_reference and gdn.gates is kernels["gates"]
    assert {n: getattr(gdn, n) for n in kernels} == kernels
    u = torch.randn(B, T, 8, generator=gen).bfloat16()
    w = torch.randn(8, 4, generator=gen).bfloat16()
    x, z = torch.randn(B * T * 2, D, generator=gen).bfloat16(), torch.randn(B * T, 2 * D, generator=gen).bfloat16()
    nw = torch.randn(D, generator=gen).bfloat16()
    with mod.gdn_prompt_torch(core_only=False):
        assert gdn.gates is gdn.gates_reference
        conv, conv_state = gdn.causal_conv_prefill(u, w)
        normed = gdn.gated_rmsnorm(x, z, nw, 1e-6)
    ref, ref_state = gdn.causal_conv_reference(u.transpose(1, 2), w)
    assert conv.shape == (B, T, 8) and torch.equal(conv, ref.transpose(1, 2)) and torch.equal(conv_state, ref_state)
    assert torch.equal(normed, gdn.gated_rmsnorm_reference(x, z.reshape(-1, D), nw, 1e-6))
    assert {n: getattr(gdn, n) for n in kernels} == kernels


def test_the_chunked_gdn_decode_is_the_layers_prompt_pass_row_by_row(tiny):
    """chunked_gdn_decode (engine_gdn_decode_chunked's GDN step): after a prompt pass of 64 rows,
    each decode step of a GDN layer gives that layer's prompt-pass output at the step's row of the
    whole sequence so far (the full forward's arithmetic, up to the products' rows), across a chunk
    boundary (70 steps: the second chunk's rows start from the first's end states); the model's
    recurrent step stays within the same distance, and the model's own _gdn is back after."""
    import fq_qwen35

    mod = _script()
    cfg = fq_qwen35.Qwen35Config.from_dir(str(tiny))
    cpu = torch.device("cpu")
    model = fq_qwen35.Qwen35Model(cfg, fq_qwen35.load_weights(str(tiny), cfg, cpu), cpu, "torch")
    B, P, G = 2, 64, 70
    g = next(i for i, t in enumerate(cfg.layer_types) if t == "linear_attention")
    H = torch.randn(B, P + G, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()
    rows = slice(0, B)
    model.w[f"model.layers.{g}.linear_attn.A_log"].fill_(-8.0)   # decay ~1: the state carries across chunks
    with torch.inference_mode():
        model.allocate_cache(B, P + G)
        want = model._gdn(g, H, rows)                   # the layer's prompt pass over all P + G rows
        model._gdn(g, H[:, :P], rows)
        with mod.chunked_gdn_decode(model) as chunks:
            assert "_gdn" in vars(model)
            got = torch.cat([model._gdn(g, H[:, P + t:P + t + 1], None) for t in range(G)], 1)
        assert chunks[g]["n"] == G - gdn_chunk() and "_gdn" not in vars(model)
        model._gdn(g, H[:, :P], rows)
        recurrent = torch.cat([model._gdn(g, H[:, P + t:P + t + 1], None) for t in range(G)], 1)
    want = want[:, P:].float()
    scale = want.abs().max()
    err = (got.float() - want).abs().max() / scale
    assert err < 1e-2, float(err)        # 1.4e-3 here; the second chunk from a zero state: 0.75
    assert (recurrent.float() - want).abs().max() / scale < 1e-2


def gdn_chunk() -> int:
    from fqkernels import gdn

    return gdn.CHUNK

"""The engine on Qwen3.5 (engine/fq_qwen35.py, CPU reference path) against Transformers
5.17.0, the Qwen3.5 reference, run in its own environment (.venv-qwen35): teacher-forced
logits on a random continuation (prompt prefill, then one decode step per forced token)
equal, bit for bit, to the reference's own cached decode; greedy tokens; the released
checkpoints' wrapped layout; config errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_modules import ENGINE_DIR

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

import fq_config  # noqa: E402
import fq_weights  # noqa: E402
from engine import Engine  # noqa: E402
from fqkernels import gdn_ref  # noqa: E402

from fastqwen import refenv, synth35  # noqa: E402

B, S, N = 2, 100, 40   # a prompt past one GDN chunk (64), 40 forced steps

_REFERENCE = r"""
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
seq, S = torch.load(sys.argv[2]), int(sys.argv[4])
with torch.no_grad():
    full = m(seq).logits[:, S - 1:].float()
    out = m(seq[:, :S], use_cache=True)
    cache, steps = out.past_key_values, [out.logits[:, -1].float()]
    for t in range(S, seq.shape[1] - 1):
        out = m(seq[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache, steps = out.past_key_values, steps + [out.logits[:, -1].float()]
    greedy = m.generate(seq[:, :S], max_new_tokens=8, do_sample=False)[:, S:]
torch.save({"full": full[:, :-1], "cached": torch.stack(steps, 1), "greedy": greedy}, sys.argv[3])
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35e") / "tiny", seed=3, progress=False)


@pytest.fixture(scope="module")
def forced(tiny, tmp_path_factory):
    """A prompt and a random continuation, and the reference's logits on it."""
    work = tmp_path_factory.mktemp("q35ref")
    seq = torch.randint(0, 1024, (B, S + N), generator=torch.Generator().manual_seed(1))
    torch.save(seq, work / "seq.pt")
    run = subprocess.run([sys.executable, "-c", _REFERENCE, str(tiny), str(work / "seq.pt"), str(work / "ref.pt"),
                          str(S)], env=refenv.reference_env("qwen3_5_text"), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return seq, torch.load(work / "ref.pt", weights_only=True)


_SAVE_NATIVE_INIT = r"""
import sys, torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
torch.manual_seed(0)
cfg = Qwen3_5TextConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                        tie_word_embeddings=True, max_position_embeddings=4096)
model = Qwen3_5ForCausalLM(cfg)
with torch.no_grad():
    model.model.norm.weight.fill_(6.0)  # the final (1 + w) norm at 7: a realistic spread of top-1 gaps
model.to(torch.bfloat16).save_pretrained(sys.argv[1])
"""


def test_a_checkpoint_saved_by_transformers_itself(tmp_path):
    """A tiny hybrid made and saved by Transformers 5.17.0 (its own init and file layout, not
    fastqwen synth's): the engine's teacher-forced logits are its cached decode's, bit for bit."""
    env = refenv.reference_env("qwen3_5_text")
    run = subprocess.run([sys.executable, "-c", _SAVE_NATIVE_INIT, str(tmp_path / "native")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seq = torch.randint(0, 1024, (B, S + N), generator=torch.Generator().manual_seed(4))
    torch.save(seq, tmp_path / "seq.pt")
    run = subprocess.run([sys.executable, "-c", _REFERENCE, str(tmp_path / "native"), str(tmp_path / "seq.pt"),
                          str(tmp_path / "ref.pt"), str(S)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    got = engine_logits(Engine(str(tmp_path / "native")).model, seq)
    assert torch.equal(got, ref["cached"]), (got - ref["cached"]).abs().max().item()
    toks = list(Engine(str(tmp_path / "native")).generate(seq[:, :S].tolist(), 8))
    assert torch.equal(torch.tensor(toks).T, ref["greedy"])


def engine_logits(model, seq: torch.Tensor) -> torch.Tensor:
    """[B, N, vocab]: the prompt's last-position logits, then one decode step per forced token."""
    with torch.inference_mode():
        model.ensure_rope(S + N)
        model.allocate_cache(B, S + N)
        out = [model.prefill_logits(seq[:, :S]).float()]
        for t in range(S, S + N - 1):
            pos = torch.full((B,), t, dtype=torch.int32)
            out.append(model.decode_logits(seq[:, t], pos, pos + 1).float())
    return torch.stack(out, 1)


def test_forced_logits_track_the_reference(tiny, forced):
    seq, ref = forced
    got = engine_logits(Engine(str(tiny)).model, seq)
    full, cached = ref["full"], ref["cached"]
    assert full.argmax(-1).unique().numel() > 20, "the continuation must exercise many outputs"
    # On the CPU the engine's prefill and decode steps are the reference's cached decode,
    # bit for bit. How far that cached decode sits from the reference's own full forward
    # depends on the CPU's BLAS paths (0.0625 on some machines, 0.375 on an AMD EPYC one); the
    # bound only checks it stays the reference's small noise.
    assert torch.equal(got, cached), (got - cached).abs().max().item()
    assert (got - full).abs().max().item() <= 0.5


def test_a_layout_slip_is_caught(tiny, forced, monkeypatch):
    """Tiling the q/k heads instead of repeating each one (a documented trap) moves the
    logits far from the reference: the comparison can fail."""
    seq, ref = forced
    monkeypatch.setattr(gdn_ref, "expand_heads", lambda x, heads: x.repeat(1, 1, heads // x.shape[2], 1))
    got = engine_logits(Engine(str(tiny)).model, seq)
    assert (got - ref["full"]).abs().max().item() > 0.5


def test_greedy_tokens_are_natives(tiny, forced):
    seq, ref = forced
    toks = list(Engine(str(tiny)).generate(seq[:, :S].tolist(), 8))
    assert torch.equal(torch.tensor(toks).T, ref["greedy"])


def _released_layout(tiny, out: Path, extra: dict | None = None) -> tuple:
    """tiny rewritten in the released multimodal wrapper's layout: text weights under
    model.language_model., the MTP head's mtp.* (and `extra` tensors) at the top, a nested
    text_config. Returns (the folder, its tensors)."""
    w = {}
    for f in Path(tiny).glob("*.safetensors"):
        w.update(load_file(str(f)))
    wrapped = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in w.items()}
    wrapped.update(extra or {})
    out.mkdir()
    save_file(wrapped, str(out / "model.safetensors"))
    text = json.loads((Path(tiny) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "tie_word_embeddings": True,
                                                 "text_config": text}))
    return out, wrapped


def test_released_layout_loads_the_same(tiny, tmp_path, capsys):
    """The multimodal wrapper's layout: text weights under model.language_model., a nested
    text_config, and vision / MTP tensors the engine skips with one line."""
    out, wrapped = _released_layout(tiny, tmp_path / "released",
                                    {"model.visual.patch_embed.proj.weight": torch.zeros(2, 2, dtype=torch.bfloat16)})
    skipped = sum(k.startswith(("mtp.", "model.visual.")) for k in wrapped)
    assert skipped >= 2 and any(k.startswith("mtp.") for k in wrapped)
    a, b = Engine(str(tiny)), Engine(str(out))
    assert f"skipped {skipped} vision / multi-token-prediction tensors" in capsys.readouterr().out
    ids = torch.randint(0, 1024, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        for m in (a.model, b.model):
            m.ensure_rope(80)
            m.allocate_cache(1, 80)
        assert torch.equal(a.model.prefill_logits(ids), b.model.prefill_logits(ids))


def test_packed_load_is_the_packing_of_the_plain_load(tiny, tmp_path):
    """load_qwen35_weights(pack=True), what the engine loads: each packed matrix (gate | up,
    qkv | z | b | a, q | k | v) read straight into place equals the plain load's tensors stacked
    (Qwen35Model._pack); everything else is the same tensor, the released layout too."""
    cfg = fq_config.Qwen35Config.from_dir(str(tiny))
    plain = fq_weights.load_qwen35_weights(str(tiny), cfg, torch.device("cpu"), pack=False)
    packed = fq_weights.load_qwen35_weights(str(tiny), cfg, torch.device("cpu"))
    groups = fq_weights.qwen35_pack_groups(cfg)
    assert len(groups) == 2 * cfg.num_layers       # gate | up per layer, one mixer's pack per layer
    for name, parts in groups.items():
        assert name not in plain and not any(p in packed for p in parts)
        assert torch.equal(packed[name], torch.cat([plain[p] for p in parts]))
    rest = set(plain) - {p for parts in groups.values() for p in parts}
    assert rest == set(packed) - set(groups)
    assert all(torch.equal(plain[n], packed[n]) for n in rest)
    assert packed["lm_head.weight"] is packed["model.embed_tokens.weight"]


@pytest.mark.parametrize("change,match", [({"rope_parameters": {"rope_type": "yarn"}}, "rope_type 'yarn'"),
                                          ({"attention_bias": True}, "attention_bias"),
                                          ({"layer_types": ["sliding_attention"] * 8}, "layer_types"),
                                          ({"vocab_size": None}, "vocab_size"),
                                          ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple"),
                                          ({"linear_num_key_heads": 3}, "linear_num_value_heads"),
                                          ({"partial_rotary_factor": 0.3, "rope_parameters": {}}, "even number")])
def test_config_errors_name_the_field(change, match):
    raw = synth35.get_preset("qwen3.5-tiny")
    raw.update(change)
    if raw.get("vocab_size", 0) is None:
        del raw["vocab_size"]
    with pytest.raises(ValueError, match=match):
        fq_config.Qwen35Config.from_dict(raw)


def test_the_judge_runs_on_the_preset(tiny, tmp_path):
    """`fastqwen judge` on a Qwen3.5 checkpoint: native is Transformers 5.17.0's (the native
    folder in 5.17.0's environment), the replay runs 5.17.0's full forward, the roofline knows
    the recurrent state; the engine passes with zero violations."""
    from fastqwen.cli import main

    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps({"name": "t", "workloads": [{"name": "b2", "batch": 2, "prompt": 70, "output": 6}]}))
    out = tmp_path / "report.json"
    assert main(["judge", "--model", str(tiny), "--workloads", str(wl), "--samples", "1", "--device", "cpu",
                 "--seed", "3", "--out", str(out), "--load-timeout", "120", "--sample-timeout", "60"]) == 0
    report = json.loads(out.read_text())
    assert report["versions"]["transformers"] == "5.17.0"
    assert report["native_dir"].endswith("native_engine")
    (result,) = report["results"]
    assert result["passed"] and result["replay"]["sides"]["engine"]["violation_count"] == 0
    assert result["replay"]["sides"]["native"]["positions"] == 12
    assert report["model"]["parameters"] == sum(
        __import__("math").prod(s) for _, s in synth35.expected_tensors(synth35.get_preset("qwen3.5-tiny")))


def test_backend_is_explicit(tiny, monkeypatch):
    """The op set is named, never picked silently: the CPU default is the references, a bad name
    or the kernels without a GPU (or the interpreter) are errors naming the value, and the
    environment's FASTQWEN_BACKEND is read where no argument is given."""
    import fq_ops

    monkeypatch.delenv("FASTQWEN_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert fq_ops.ops_for("auto", cpu).name == "torch"
    with pytest.raises(ValueError, match="'fla' is not one of auto, torch, triton"):
        fq_ops.ops_for("fla", cpu)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        fq_ops.ops_for("triton", cpu)
    monkeypatch.setenv("FASTQWEN_BACKEND", "fla")
    with pytest.raises(ValueError, match="'fla' is not one of"):
        Engine(str(tiny))
    assert Engine(str(tiny), backend="torch").describe()["backend"] == "torch"     # the argument wins
    monkeypatch.delenv("FASTQWEN_BACKEND")
    eng = Engine(str(tiny))
    info = eng.describe()
    assert info == {"family": "qwen3.5", "backend": "torch", "decode_graph": False, "prefill_graphs": False,
                    "pdl": False, "exact_decode": True, "speculation": "off", "lm_screen": False,
                    "gdn_prompt_rule": "reference",
                    "gdn_decode": "full forward's rows"}
    assert not eng.model.ops.one_row_tensor_cores and eng.one_row_products() == "fma"  # Qwen3.5's stay fma
    from bench.spec import one_row_shapes

    products = eng.model.decode_products()
    eng.model.ops.one_row_tensor_cores = one_row_shapes(products, "mlp.gate_up")
    assert eng.one_row_products() == "tensor cores: mlp.gate_up"
    eng.model.ops.one_row_tensor_cores = one_row_shapes(products, "mlp.down_proj")   # products of one shape move together
    together = [p.name for p in products if p.weights[0].shape == eng.model.w["model.layers.0.mlp.down_proj.weight"].shape]
    assert "mlp.down_proj" in together and eng.one_row_products() == "tensor cores: " + ", ".join(together)
    eng.model.ops.one_row_tensor_cores = one_row_shapes(products, "dot")
    assert eng.one_row_products() == "tensor cores"
    with pytest.raises(ValueError, match="mlp.gate is not family, fma, dot or products among linear_attn.in_proj"):
        one_row_shapes(products, "mlp.gate")
    assert one_row_shapes(products, "fma") == frozenset()
    eng.model.ops.one_row_tensor_cores = frozenset()
    monkeypatch.setenv("FASTQWEN_EXACT_DECODE", "0")
    assert Engine(str(tiny)).describe()["gdn_decode"] == "recurrent"
    assert Engine(str(tiny), exact_decode=True).describe()["gdn_decode"] == "full forward's rows"
    # the Triton op set names its prompt rule and its exact step's form (its kernel, columns, warps,
    # rows a trip, caps)
    from fqkernels import gdn_exact_step

    monkeypatch.setattr(eng.model.ops, "name", "triton")
    assert eng.describe()["gdn_prompt_rule"] == "kernels"
    assert eng.describe()["gdn_decode"] == f"full forward's rows ({gdn_exact_step.step_form()})"
    assert "128 columns and 4 warps a program, 32 rows a trip" in gdn_exact_step.step_form()


_MTP_REFERENCE = r"""
import glob, sys, torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                          Qwen3_5TextRotaryEmbedding)
folder, inp, outp = sys.argv[1:4]
cfg = Qwen3_5TextConfig.from_pretrained(folder)
cfg._attn_implementation = "sdpa"
w = {}
for f in glob.glob(folder + "/*.safetensors"):
    w.update(load_file(f))
def norm(name):
    m = Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    m.weight.data = w[name].float()
    return m.to(torch.bfloat16)
# the head's one decoder layer is a full-attention layer of the model's own definition
layer = Qwen3_5DecoderLayer(cfg, cfg.layer_types.index("full_attention")).to(torch.bfloat16)
layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")})
d = torch.load(inp)
tokens, hidden = d["tokens"], d["hidden"]
B, n = tokens.shape
embed = w["model.embed_tokens.weight"]
with torch.no_grad():
    e = norm("mtp.pre_fc_norm_embedding.weight")(F.embedding(tokens, embed))
    h = norm("mtp.pre_fc_norm_hidden.weight")(hidden)
    x = F.linear(torch.cat([e, h], dim=-1), w["mtp.fc.weight"])
    pos = torch.arange(n).view(1, n).expand(B, n)
    # the text model's rotary takes the three multimodal position rows, equal for text
    rope = Qwen3_5TextRotaryEmbedding(cfg)(x, pos[None].expand(3, B, n))
    x = layer(x, position_embeddings=rope, position_ids=pos)
    out = norm("mtp.norm.weight")(x)
    logits = F.linear(out, w.get("lm_head.weight", embed))
torch.save({"hidden": out, "logits": logits}, outp)
"""


def test_mtp_head_is_the_published_layer_from_the_released_layout(tiny, tmp_path):
    """The multi-token-prediction head loaded from the released wrapped layout (text weights under
    model.language_model., the head's mtp.* at the top, as vLLM's and SGLang's loaders read it)
    against a torch reference written from the published layer: embed -> pre_fc_norm_embedding,
    hidden -> pre_fc_norm_hidden, fc over [embedding | hidden], one full-attention decoder layer of
    Transformers 5.17's Qwen3.5 (causal over the head's rows, RoPE at their positions), norm, the
    LM head. The head's rows from a fresh cache: its states and picks."""
    out, wrapped = _released_layout(tiny, tmp_path / "released")
    assert any(k.startswith("mtp.layers.0.") for k in wrapped), "the synthetic checkpoint carries the head"
    eng = Engine(str(out), speculation="mtp")
    model = eng.model
    g = torch.Generator().manual_seed(7)
    n = 12
    tokens = torch.randint(0, 1024, (2, n), generator=g)
    hidden = torch.randn(2, n, eng.cfg.hidden_size, generator=g).to(torch.bfloat16)
    torch.save({"tokens": tokens, "hidden": hidden}, tmp_path / "in.pt")
    run = subprocess.run([sys.executable, "-c", _MTP_REFERENCE, str(tiny), str(tmp_path / "in.pt"),
                          str(tmp_path / "ref.pt")], env=refenv.reference_env("qwen3_5_text"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    with torch.inference_mode():
        eng._prepare_cache(2, 64)
        picks, states = model.mtp_draft(tokens, hidden, torch.zeros(2, dtype=torch.int32))
    # the same ops in the reference's order up to the decoder layer's internals (attention and
    # MLP on the engine's op set): within bf16 rounding, the same picks
    d = (states.float() - ref["hidden"].float()).abs().max().item()
    assert d <= 0.02 * ref["hidden"].float().abs().max().item(), d
    assert torch.equal(picks, ref["logits"].argmax(-1))

"""The fast engine's CPU path (the same model code on the torch reference ops)
against native Transformers on the tiny checkpoint, and the engine's contract."""
import json
import shutil

import pytest
import torch

from engine_modules import ENGINE_DIR, load_engine_module


@pytest.fixture(scope="module")
def engines(tiny_model, native_engine_dir):
    fast = load_engine_module(ENGINE_DIR, "fastqwen_engine_under_test")
    native = load_engine_module(native_engine_dir, "fastqwen_native_under_test")
    return fast.Engine(str(tiny_model)), native.Engine(str(tiny_model))


def _prompts(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (batch, length), generator=g).tolist()


def _teacher_forced_slack(model_dir, prompts, steps):
    """Per emitted position: native full-forward max logit minus the emitted token's logit."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    out = torch.tensor(steps).T  # [B, N]
    seq = torch.cat([torch.tensor(prompts), out], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=seq).logits[:, len(prompts[0]) - 1:-1].float()
    return logits.max(-1).values - logits.gather(-1, out[..., None])[..., 0]


@pytest.mark.parametrize("batch,prompt,steps", [(1, 7, 12), (3, 40, 20), (5, 129, 9)])
def test_tokens_pass_the_margin_and_mostly_match_native(engines, tiny_model, batch, prompt, steps):
    """Bit-identical tokens cannot be promised (the packed QKV product sums in
    another order than three separate ones), but every token must be within
    the platform's 2.0-logit margin of native's full forward, and nearly all
    must equal native's own greedy choice."""
    fast, native = engines
    prompts = _prompts(batch, prompt, seed=batch * 1000 + prompt)
    ours = list(fast.generate(prompts, steps))
    theirs = list(native.generate(prompts, steps))
    slack = _teacher_forced_slack(tiny_model, prompts, ours)
    assert slack.max() <= 2.0, f"margin violated: max slack {slack.max():.3f}"
    assert ours[0] == theirs[0], "the prefill's token must match native's"
    agree = (torch.tensor(ours) == torch.tensor(theirs)).float().mean()
    assert agree >= 0.5, f"only {agree:.0%} of tokens equal native's"


def test_contract_types_counts_and_order(engines):
    fast, _ = engines
    prompts = _prompts(4, 16, seed=1)
    out = list(fast.generate(prompts, 6))
    assert len(out) == 6
    for step in out:
        assert type(step) is list and len(step) == 4
        assert all(type(t) is int for t in step)
    # permuting the batch permutes the outputs
    perm = [2, 0, 3, 1]
    out_p = list(fast.generate([prompts[i] for i in perm], 6))
    assert out_p == [[step[i] for i in perm] for step in out]


def test_no_state_between_calls(engines):
    fast, _ = engines
    a, b = _prompts(2, 24, seed=2), _prompts(2, 24, seed=3)
    first = list(fast.generate(a, 8))
    list(fast.generate(b, 8))          # same shape, other prompt
    list(fast.generate(_prompts(3, 50, seed=4), 5))  # other shape: cache reallocated
    assert list(fast.generate(a, 8)) == first


def test_never_stops_early_at_eos(engines, tiny_model):
    fast, _ = engines
    eos = json.loads((tiny_model / "config.json").read_text())["eos_token_id"]
    assert len(list(fast.generate([[eos] * 5, [eos] * 5], 40))) == 40


@pytest.mark.parametrize("args,needle", [
    (([], 4), "non-empty"),
    (([[1, 2], [3]], 4), "same length"),
    (([[1, 2]], 0), ">= 1"),
    (([[1, 2]], 2.0), "must be an int"),
    (([[1, 4096]], 3), "outside the vocabulary"),
    (([[1, -1]], 3), "outside the vocabulary"),
    (([[1, 2.5]], 3), "only ints"),
    (([[1, True]], 3), "only ints"),
    (([[]], 3), "at least one token"),
    (([[1]], 5000), "max_position_embeddings"),
])
def test_bad_input_raises_value_error(engines, args, needle):
    fast, _ = engines
    with pytest.raises(ValueError, match=needle):
        fast.generate(*args)


def test_loader_names_bad_tensors(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    fast = load_engine_module(ENGINE_DIR, "fastqwen_engine_under_test")
    work = tmp_path / "m"
    shutil.copytree(tiny_model, work)
    shard = next(work.glob("*.safetensors"))
    tensors = {k: v.clone() for k, v in load_file(shard).items()}  # not views of the file we rewrite
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*shape"):
        fast.Engine(str(work))
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor " + name.replace(".", r"\.")):
        fast.Engine(str(work))


def test_config_errors(tmp_path, tiny_model):
    fast = load_engine_module(ENGINE_DIR, "fastqwen_engine_under_test")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fast.Engine(str(tmp_path / "nowhere"))
    work = tmp_path / "m"
    shutil.copytree(tiny_model, work)
    cfg = json.loads((work / "config.json").read_text())
    cfg["model_type"] = "llama"
    (work / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        fast.Engine(str(work))
    (work / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        fast.Engine(str(work))


def test_prefill_mlp_in_row_slices_is_the_same_function(engines, monkeypatch):
    """A prompt longer than MLP_ROWS runs its MLP in row slices (bounded activations):
    the logits are the unsliced ones (rows are independent), the tokens the same."""
    import fq_qwen3

    fast, _ = engines
    prompts = _prompts(1, 40, seed=5)
    whole = list(fast.generate(prompts, 4))
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        logits = fast.model.prefill_logits(ids)
    calls = []
    real = fast.model._prefill_mlp

    def counting(h, *args):
        calls.append(h.shape[0])
        return real(h, *args)

    monkeypatch.setattr(fq_qwen3, "MLP_ROWS", 16)
    monkeypatch.setattr(fast.model, "_prefill_mlp", counting)
    sliced = list(fast.generate(prompts, 4))
    with torch.inference_mode():
        logits_sliced = fast.model.prefill_logits(ids)
    assert 40 in calls, "the prefill's MLP never saw the whole prompt's rows"
    assert sliced == whole
    assert torch.equal(logits_sliced, logits)


# ---- sliding window: the reference (4.51.3) applies config.sliding_window in every layer ----

WINDOW = 48


@pytest.fixture(scope="module")
def window_model(tiny_model, tmp_path_factory):
    """The tiny checkpoint with `sliding_window: 48` in its config.json (same weights)."""
    work = tmp_path_factory.mktemp("tiny_window") / "m"
    shutil.copytree(tiny_model, work)
    cfg = json.loads((work / "config.json").read_text())
    cfg["sliding_window"] = WINDOW
    (work / "config.json").write_text(json.dumps(cfg))
    return work


@pytest.fixture(scope="module")
def window_engine(window_model):
    return load_engine_module(ENGINE_DIR, "fastqwen_engine_under_test").Engine(str(window_model))


# (batch, prompt, steps): decode crossing the window from a short prompt; a prompt one
# short of it (plain causal prefill in the reference); exactly the window (the masked
# prefill, nothing masked yet); prompts well past it.
@pytest.mark.parametrize("batch,prompt,steps", [(2, 30, 40), (2, 47, 6), (3, 48, 6), (2, 100, 30), (1, 170, 12)])
def test_sliding_window_is_the_reference(window_engine, window_model, tiny_model, batch, prompt, steps):
    """Tokens within the margin of the windowed reference's full forward, and the
    prefill's logits equal to its last row; the same sequences scored without the
    window are far off, so a missing or misplaced window cannot pass."""
    from transformers import Qwen3ForCausalLM

    prompts = _prompts(batch, prompt, seed=7000 + prompt)
    emitted = list(window_engine.generate(prompts, steps))
    slack = _teacher_forced_slack(window_model, prompts, emitted)
    assert slack.max() <= 0.5, f"max slack {slack.max():.3f} against the windowed reference"
    ref = Qwen3ForCausalLM.from_pretrained(str(window_model), torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    plain = Qwen3ForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    seq = torch.cat([torch.tensor(prompts), torch.tensor(emitted).T], dim=1)
    with torch.inference_mode():
        want = ref(input_ids=seq).logits[:, prompt - 1:-1].float()
        unwindowed = plain(input_ids=seq).logits[:, prompt - 1:-1].float()
        got = window_engine.model.prefill_logits(torch.tensor(prompts)).float()
    assert torch.equal(got, want[:, 0]), "the prefill's logits are not the reference's"
    if prompt + steps - 1 > WINDOW:
        beyond = (unwindowed - want).abs().amax(-1)[:, max(0, WINDOW - prompt + 1):]  # positions >= WINDOW
        assert beyond.max() > 5.0, "this case does not tell a window from none"


def test_config_takes_qwen3config_defaults(tmp_path, tiny_model):
    """Absent fields take Qwen3Config's defaults, head_dim 128 and sliding_window 4096 among them."""
    fq_config = _engine_module("fq_config")
    raw = json.loads((tiny_model / "config.json").read_text())
    for field in ("head_dim", "sliding_window", "rms_norm_eps", "rope_theta"):
        raw.pop(field)
    cfg = fq_config.Qwen3Config.from_dict(raw)
    assert (cfg.head_dim, cfg.sliding_window, cfg.rms_norm_eps, cfg.rope_theta) == (128, 4096, 1e-6, 10000.0)
    from transformers import Qwen3Config

    hf = Qwen3Config(**raw)
    assert (hf.head_dim, hf.sliding_window, hf.rms_norm_eps, hf.rope_theta) == (128, 4096, 1e-6, 10000.0)


@pytest.mark.parametrize("field,value,needle", [
    ("use_sliding_window", True, "use_sliding_window=true"),
    ("sliding_window", 0, "sliding_window must be a positive integer"),
    ("sliding_window", "4096", "sliding_window must be a positive integer"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("output_attentions", True, "output_attentions"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
    ("attention_bias", True, "attention_bias"),
    ("hidden_act", "gelu", "hidden_act"),
    ("torch_dtype", "int8", "torch_dtype"),
    ("head_dim", None, "head_dim must be a positive integer"),
    ("head_dim", 48, "power of two"),
])
def test_config_refuses_what_it_does_not_compute(tiny_model, field, value, needle):
    fq_config = _engine_module("fq_config")
    raw = json.loads((tiny_model / "config.json").read_text())
    raw[field] = value
    with pytest.raises(ValueError, match=needle):
        fq_config.Qwen3Config.from_dict(raw)


def test_float32_checkpoint_loads_as_the_reference_loads_it(engines, tiny_model, tmp_path):
    """A float32 checkpoint is rounded to BF16 at load (from_pretrained(torch_dtype=bfloat16)
    does the same): the engine gives the BF16 checkpoint's tokens."""
    from safetensors.torch import load_file, save_file

    work = tmp_path / "f32"
    shutil.copytree(tiny_model, work)
    for shard in work.glob("*.safetensors"):
        save_file({k: v.float() for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})
    cfg = json.loads((work / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (work / "config.json").write_text(json.dumps(cfg))
    fast, _ = engines
    f32 = load_engine_module(ENGINE_DIR, "fastqwen_engine_under_test").Engine(str(work))
    prompts = _prompts(2, 20, seed=9)
    assert list(f32.generate(prompts, 5)) == list(fast.generate(prompts, 5))


def _engine_module(name):
    load_engine_module(ENGINE_DIR, "fastqwen_engine_under_test")  # puts engine/ on sys.path
    import importlib

    return importlib.import_module(name)


@pytest.mark.parametrize("init", ["fastqwen", "transformers"])
def test_massive_activations_checkpoint_passes_the_margin(tmp_path, init):
    """The engine on a checkpoint with planted massive activations and attention sinks
    (`fastqwen synth --massive-activations`), both inits, with a window past which it
    decodes: every token within the margin of the reference's full forward."""
    from fastqwen.synth import synthesize

    model = synthesize("tiny", tmp_path / "m", seed=3, device="cpu", progress=False, init=init,
                       massive_activations=True, sliding_window=64)
    fast = load_engine_module(ENGINE_DIR, "fastqwen_engine_under_test").Engine(str(model))
    from fastqwen.judge.prompts import synthetic_stream

    stream = synthetic_stream(4096)
    prompts = [stream[i * 300:i * 300 + 90] for i in range(3)]  # text-like ids: trigger tokens occur
    emitted = list(fast.generate(prompts, 24))
    slack = _teacher_forced_slack(model, prompts, emitted)
    assert slack.max() <= 2.0, f"margin violated: max slack {slack.max():.3f}"


def test_engine_describes_what_runs(engines):
    info = engines[0].describe()
    assert info == {"family": "qwen3", "backend": "torch", "decode_graph": False, "prefill_graphs": False,
                    "pdl": False, "exact_decode": True, "speculation": "off", "lm_screen": False}
    # the family's choice for one sequence's products (Qwen3: the tensor cores; the op set's default fma)
    model = engines[0].model
    assert model.ops.one_row_tensor_cores == {tuple(p.weights[0].shape) for p in model.decode_products()}
    assert engines[0].one_row_products() == "tensor cores"


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_a_call_a_few_positions_longer_keeps_the_graphs(family, tiny_model, tmp_path):
    """The RoPE tables grow in whole granules: a call longer than the last by a few positions
    (inside the cache's capacity) rebuilds no table, so the decode runner and its graph are kept,
    and its tokens are a fresh engine's."""
    from fastqwen import synth35

    model = tiny_model if family == "qwen3" else synth35.synthesize("qwen3.5-tiny", tmp_path / "q35", seed=1,
                                                                     progress=False)
    module = load_engine_module(ENGINE_DIR, "fastqwen_engine_under_test")
    eng = module.Engine(str(model))
    vocab = eng.cfg.vocab_size
    list(eng.generate([[t % vocab for t in p] for p in _prompts(1, 12, seed=2)], 4))
    runner, cos = eng._runner, eng.model.cos
    longer = [[t % vocab for t in p] for p in _prompts(1, 20, seed=3)]
    assert list(eng.generate(longer, 6)) == list(module.Engine(str(model)).generate(longer, 6))
    assert eng._runner is runner and eng.model.cos is cos

"""The fast engine on a GPU, tiny checkpoint: the CUDA-graph decode gives the
eager decode's tokens exactly, every token passes native's 2.0-logit margin,
and shapes never seen at warmup (other batch, longer context) still work."""
import pytest
import torch

from engine_modules import ENGINE_DIR, load_engine_module

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return load_engine_module(ENGINE_DIR, "fastqwen_engine_gpu_under_test").Engine(str(tiny_model))


def _prompts(batch, length, seed, vocab=4096):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def _slack(model_dir, prompts, steps):
    from transformers import Qwen3ForCausalLM

    from fastqwen.numerics import pin_reference_numerics

    pin_reference_numerics()

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.bfloat16,
                                             attn_implementation="sdpa").cuda().eval()
    out = torch.tensor(steps).T.cuda()
    seq = torch.cat([torch.tensor(prompts).cuda(), out], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=seq).logits[:, len(prompts[0]) - 1:-1].float()
    return logits.max(-1).values - logits.gather(-1, out[..., None])[..., 0]


def test_graph_equals_eager(engine):
    prompts = _prompts(3, 50, seed=1)
    graphed = list(engine.generate(prompts, 20))
    assert engine._runner.graph is not None
    engine.use_graphs, engine._runner = False, None
    try:
        eager = list(engine.generate(prompts, 20))
        assert engine._runner.graph is None
    finally:
        engine.use_graphs, engine._runner = True, None
    assert graphed == eager


@pytest.mark.parametrize("batch,prompt,steps", [(1, 64, 24), (4, 96, 24), (9, 200, 12)])
def test_margin_against_native(engine, tiny_model, batch, prompt, steps):
    prompts = _prompts(batch, prompt, seed=batch + prompt)
    emitted = list(engine.generate(prompts, steps))
    slack = _slack(tiny_model, prompts, emitted)
    assert slack.max() <= 2.0, f"margin violated: max slack {slack.max():.3f}"


def test_unseen_shapes_and_repeatability(engine):
    a = _prompts(2, 30, seed=7)
    first = list(engine.generate(a, 10))
    list(engine.generate(_prompts(5, 700, seed=8), 6))      # larger batch and cache: reallocated, recaptured
    list(engine.generate(_prompts(2, 3000, seed=9), 1000))  # a long context: cache reallocated again
    assert list(engine.generate(a, 10)) == first


def test_prefill_graph_replay_equals_eager_prefill(engine):
    """The second call of a shape replays the prefill graph captured by the first;
    its tokens are those of an eager prefill of the same prompts."""
    warm, probe = _prompts(3, 80, seed=21), _prompts(3, 80, seed=22)
    engine._prefill_graphs = {}
    list(engine.generate(warm, 4))                      # eager prefill, then capture
    assert (3, 80) in engine._prefill_graphs
    replayed = list(engine.generate(probe, 12))        # graph replay
    engine.use_prefill_graphs = False
    try:
        eager = list(engine.generate(probe, 12))
    finally:
        engine.use_prefill_graphs = True
    assert replayed == eager
    # A reallocated cache drops the graphs that point at the old one.
    list(engine.generate(_prompts(6, 900, seed=23), 2))
    assert (3, 80) not in engine._prefill_graphs


def _fq_attention():
    import sys

    if str(ENGINE_DIR) not in sys.path:
        sys.path.insert(0, str(ENGINE_DIR))
    import fq_attention

    return fq_attention


def _prompt_attention_inputs(batch, seq_len, capacity, heads=32, kv_heads=8, dim=128):
    """Random q [B*S, H, D] and K/V caches [B + 1, KVH, capacity, D] (one spare sequence), bf16."""
    g = torch.Generator(device="cuda").manual_seed(seq_len)
    q = torch.randn(batch * seq_len, heads, dim, generator=g, device="cuda").to(torch.bfloat16)
    kc = torch.randn(batch + 1, kv_heads, capacity, dim, generator=g, device="cuda").to(torch.bfloat16)
    vc = torch.randn(batch + 1, kv_heads, capacity, dim, generator=g, device="cuda").to(torch.bfloat16)
    return q, kc, vc


@pytest.mark.parametrize("batch,seq_len", [(1, 100), (3, 257)])
def test_prefill_attention_gqa_is_bit_equal_to_expanded_kv(batch, seq_len):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fq_attention = _fq_attention()
    heads, dim = 32, 128
    q, kc, vc = _prompt_attention_inputs(batch, seq_len, capacity=512)
    got = fq_attention.prefill_attention(q, kc, vc, batch, seq_len, dim**-0.5)
    assert fq_attention._FLASH_GQA is True, "flash did not take the unexpanded K/V"
    qh = q.view(batch, seq_len, heads, dim).transpose(1, 2)
    k = kc[:batch, :, :seq_len].repeat_interleave(4, 1)
    v = vc[:batch, :, :seq_len].repeat_interleave(4, 1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        want = torch.nn.functional.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=dim**-0.5)
    assert torch.equal(got, want.transpose(1, 2).reshape(-1, heads * dim))


# ---- sliding window (config.sliding_window: the reference windows every layer) ----

@pytest.fixture(scope="module")
def window_engine(tiny_model, tmp_path_factory):
    import json
    import shutil

    work = tmp_path_factory.mktemp("tiny_window_gpu") / "m"
    shutil.copytree(tiny_model, work)
    cfg = json.loads((work / "config.json").read_text())
    cfg["sliding_window"] = 48
    (work / "config.json").write_text(json.dumps(cfg))
    engine = load_engine_module(ENGINE_DIR, "fastqwen_engine_gpu_under_test").Engine(str(work))
    engine.model_dir = work
    return engine


@pytest.mark.parametrize("batch,prompt,steps", [(2, 30, 60), (3, 48, 20), (4, 200, 40), (9, 100, 30)])
def test_window_margin_against_native(window_engine, batch, prompt, steps):
    prompts = _prompts(batch, prompt, seed=batch + prompt)
    for _ in range(2):  # the second call replays the prefill graph
        emitted = list(window_engine.generate(prompts, steps))
        slack = _slack(window_engine.model_dir, prompts, emitted)
        assert slack.max() <= 2.0, f"margin violated: max slack {slack.max():.3f}"


def test_window_graph_equals_eager(window_engine):
    prompts = _prompts(3, 70, seed=31)
    graphed = list(window_engine.generate(prompts, 40))
    window_engine.use_graphs, window_engine._runner = False, None
    try:
        eager = list(window_engine.generate(prompts, 40))
    finally:
        window_engine.use_graphs, window_engine._runner = True, None
    assert graphed == eager


@pytest.mark.parametrize("batch,seq_len,window", [(1, 300, 100), (2, 1000, 256), (3, 777, 777)])
def test_windowed_prefill_attention_is_the_references_call(monkeypatch, batch, seq_len, window):
    """The windowed prefill gives the bits of the reference's own SDPA call (the whole
    [S, S] mask, K/V repeated per head, contiguous q/k/v), also when its query rows
    are taken in chunks and the keys past a chunk are left out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fq_attention = _fq_attention()
    heads, dim = 32, 128
    q, kc, vc = _prompt_attention_inputs(batch, seq_len, capacity=1024)
    qh = q.view(batch, seq_len, heads, dim).transpose(1, 2).contiguous()
    k = kc[:batch, :, :seq_len].repeat_interleave(4, 1).contiguous()
    v = vc[:batch, :, :seq_len].repeat_interleave(4, 1).contiguous()
    pos, key = torch.arange(seq_len, device="cuda")[:, None], torch.arange(seq_len + 1, device="cuda")
    mask = torch.full((seq_len, seq_len + 1), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device="cuda")
    mask *= (key > pos) | (key <= pos - window)
    mask = mask[None, None].expand(batch, 1, -1, -1)[..., :seq_len]  # as the reference slices it
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=dim**-0.5)
    want = want.transpose(1, 2).reshape(-1, heads * dim)
    got = fq_attention.prefill_attention(q, kc, vc, batch, seq_len, dim**-0.5, window=window)
    assert torch.equal(got, want), "one chunk: not the reference's bits"
    monkeypatch.setattr(fq_attention, "_MASK_ELEMENTS", 128 * seq_len)  # 128-row chunks
    assert torch.equal(fq_attention.prefill_attention(q, kc, vc, batch, seq_len, dim**-0.5, window=window), want), \
        "chunked: not the reference's bits"
    last = fq_attention.prefill_attention(q, kc, vc, batch, seq_len, dim**-0.5, last_only=True, window=window)
    assert torch.equal(last, want.view(batch, seq_len, -1)[:, -1])


def test_slots_serve_ragged_requests_within_the_margin(engine, tiny_model):
    """Continuous batching on the GPU (Engine.slots: a graph per step size): requests of their
    own lengths, admitted and retired between steps, each within native's 2.0-logit margin,
    and the graphed steps' tokens equal to the eager steps'."""
    from test_slots_cpu import SCHEDULE, run_schedule

    prompts = [_prompts(1, n, seed=300 + r)[0] for r, (n, _, _) in enumerate(SCHEDULE)]
    graphed = run_schedule(engine, prompts)
    engine.use_graphs = False
    try:
        eager = run_schedule(engine, prompts)
    finally:
        engine.use_graphs = True
    assert graphed == eager
    for r, toks in graphed.items():
        slack = _slack(tiny_model, [prompts[r]], [[t] for t in toks])
        assert slack.max() <= 2.0, (r, slack.max())


def test_paged_slots_give_the_row_slots_tokens(engine):
    """The paged cache on the GPU (pages of 64 positions through block tables, the decode kernels
    reading them; few pages, so requests also wait for pages): each request's greedy tokens are
    those the row cache of the same capacity gives, graphed."""
    from test_slots_cpu import SCHEDULE, run_schedule

    prompts = [_prompts(1, n, seed=300 + r)[0] for r, (n, _, _) in enumerate(SCHEDULE)]
    rows = run_schedule(engine, prompts, max_len=192)
    assert run_schedule(engine, prompts, max_len=192, page_size=64, num_pages=5) == rows
    assert engine._slots.free_pages == 5


@pytest.mark.parametrize("page_size", [None, 64])
def test_chunked_admission_graphed_gives_the_eager_tokens(engine, page_size):
    """Prompts prefilled in chunks of 24 between steps: from a chunk shape's second pass on it
    runs as a CUDA graph (fq_decode.ChunkGraph); every request's tokens are those of the same
    schedule run eagerly, rows and pages."""
    from test_slots_cpu import SCHEDULE, run_schedule

    prompts = [_prompts(1, n, seed=400 + r)[0] for r, (n, _, _) in enumerate(SCHEDULE)]
    kw = dict(max_len=192, page_size=page_size, num_pages=None if page_size is None else 12, chunk=24)
    graphed = run_schedule(engine, prompts, **kw)
    assert engine._slots._chunk_graphs, "no chunk ran as a graph"
    engine.use_graphs = False
    try:
        eager = run_schedule(engine, prompts, **kw)
    finally:
        engine.use_graphs = True
    assert graphed == eager


@pytest.fixture(scope="module")
def qwen35_engine(tmp_path_factory):
    from fastqwen import synth35

    path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35g") / "tiny", seed=3, progress=False)
    return load_engine_module(ENGINE_DIR, "fastqwen_engine_q35_gpu_under_test").Engine(str(path))


def test_qwen35_slots_graphed_admission_keeps_the_eager_tokens_and_snapshots(qwen35_engine):
    """Qwen3.5 paged slots on the GPU: a prompt admitted alone runs as its shape's ChunkGraph from
    the shape's second pass on, one that keeps a GDN state snapshot too (the snapshot's position
    part of the shape, its index written before each replay); each request's tokens and every
    kept snapshot are those of the same requests run eagerly, bit for bit (each after Slots.warm,
    as the server runs it)."""
    from test_slots_cpu import _greedy, _prompt

    w1, w2 = _prompt(200, 61, 1024), _prompt(200, 62, 1024)
    prompts = {"w1": w1, "w2": w2, "h2": w2[:192] + _prompt(20, 63, 1024), "h1": w1[:192] + _prompt(20, 64, 1024),
               "h2b": w2[:192] + _prompt(20, 65, 1024)}

    def run(graphs: bool):
        qwen35_engine.use_graphs = graphs
        slots = qwen35_engine.slots(2, 320, page_size=64, num_pages=24)
        slots.graph_snapshot_passes = True                  # the default (fq_slots.GRAPH_SNAPSHOT_PASSES)
        slots.warm()                                         # as the server starts its slots
        tokens = {k: _greedy(slots, {k: p}, 6)[k] for k, p in prompts.items()}
        pool, model = slots.pool, qwen35_engine.model
        snaps = []
        for w in (w1, w2):
            index = pool._snap_of[pool._page_of[tuple(w[:192])]]
            snaps.append((model.snap_state[index].clone(), model.snap_conv[index].clone()))
        return tokens, snaps, list(slots._chunk_graphs), slots.pool.hit_tokens

    try:
        graphed = run(True)
        eager = run(False)
    finally:
        qwen35_engine.use_graphs = True
    assert graphed[2] == [(200, 0, 192), (20, 192, None)], graphed[2]
    assert eager[2] == [] and graphed[3] == eager[3] == 3 * 192
    assert graphed[0] == eager[0]
    for (gs, gc), (es, ec) in zip(graphed[1], eager[1]):
        assert torch.equal(gs, es) and torch.equal(gc, ec)


# ---- speculation: a verify's rows are the plain step's bits (fq_spec) ---------------------------
@pytest.mark.parametrize("batch", [1, 4, 9])
def test_verify_rows_equal_the_plain_decode_steps_bits(engine, batch):
    model, P, T = engine.model, 40, 5
    ids = torch.tensor(_prompts(batch, P, seed=batch))
    tokens = torch.tensor(_prompts(batch, T, seed=batch + 100)).cuda()
    engine._close_slots()
    try:
        with torch.inference_mode():
            engine._prepare_cache(batch, P + T)
            engine._tune(batch)
            model.prefill_logits(ids.cuda())
            verify = model.verify_logits(tokens, torch.full((batch,), P, dtype=torch.int32, device="cuda"))
            steps = []
            for j in range(T):
                pos = torch.full((batch,), P + j, dtype=torch.int32, device="cuda")
                steps.append(model.decode_logits(tokens[:, j].contiguous(), pos, pos + 1))
        assert torch.equal(verify, torch.stack(steps, dim=1))
    finally:
        engine._drop_graphs()


@pytest.mark.parametrize("family,batch,prompt", [("qwen3", 4, 1100), ("qwen3.5", 4, 1100), ("qwen3.5", 9, 600)])
def test_verify_rows_keep_the_plain_steps_attention_splits(engine, engine35, family, batch, prompt):
    """Past a few hundred positions the attention's split count follows the row count: the verify's
    B * (k + 1) rows must still sum each row's keys in the B-row step's splits (fq_ops.planned_as;
    Qwen3.5's gated attention once did not, and at 1,024 positions its verify's picks were not the
    step's). The capacity here gives the B-row and verify launches different default splits."""
    from fqkernels.decode_attention import decode_attention_plan

    eng, T = (engine if family == "qwen3" else engine35), 5
    model, cfg = eng.model, eng.cfg
    ids = torch.tensor(_prompts(batch, prompt, seed=batch, vocab=eng.cfg.vocab_size)).cuda()
    tokens = torch.tensor(_prompts(batch, T, seed=batch + 100, vocab=eng.cfg.vocab_size)).cuda()
    start = torch.full((batch,), prompt, dtype=torch.int32, device="cuda")
    eng._close_slots()
    try:
        with torch.inference_mode():
            eng._prepare_cache(batch, prompt + T)
            sizes = (cfg.num_heads, cfg.num_kv_heads, model.k_cache.shape[3], cfg.head_dim)
            assert decode_attention_plan(batch, *sizes).num_splits != decode_attention_plan(batch * T, *sizes).num_splits
            eng._tune(batch)
            model.prefill_logits(ids)
            verify = model.verify_logits(tokens, start).clone()
            model.prefill_logits(ids)          # the state and cache again as the prompt left them
            steps = []
            for j in range(T):
                pos = start + j
                steps.append(model.decode_logits(tokens[:, j].contiguous(), pos, pos + 1))
        assert torch.equal(verify, torch.stack(steps, dim=1))
    finally:
        eng._drop_graphs()


@pytest.mark.parametrize("mode,batch", [("ngram", 1), ("oracle:0.7", 1), ("oracle:0.7", 4), ("recycle", 9)])
def test_speculation_emits_the_plain_tokens_on_the_gpu(engine, mode, batch):
    prompts = _prompts(batch, 64, seed=7 * batch)
    want = list(engine.generate(prompts, 40))
    engine.set_speculation(mode)
    try:
        assert list(engine.generate(prompts, 40)) == want
        assert engine.spec_stats()["verify_steps"] > 0 and engine._spec.graphs["verify4"] is not None
    finally:
        engine.set_speculation("off")


@pytest.fixture(scope="module")
def q35_folder(tmp_path_factory):
    from fastqwen import synth35

    return synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35gpu") / "tiny", seed=3, progress=False)


@pytest.fixture(scope="module")
def engine35(q35_folder):
    return load_engine_module(ENGINE_DIR, "fastqwen_engine_gpu_under_test").Engine(str(q35_folder))


@pytest.mark.parametrize("mode,batch,prompt", [("oracle:0.5", 1, 58), ("oracle:0.0", 3, 61), ("ngram", 2, 50),
                                               ("oracle:0.5", 6, 58), ("oracle:1.0", 16, 61)])
def test_qwen35_speculation_emits_the_plain_tokens_on_the_gpu(engine35, mode, batch, prompt):
    """Verifies that close a GDN chunk at a row they reject, then roll back (fq_qwen35.commit_verify);
    wider than rollback_rows, verifies that stop before each close."""
    prompts = _prompts(batch, prompt, seed=prompt, vocab=engine35.cfg.vocab_size)
    want = list(engine35.generate(prompts, 40))
    engine35.set_speculation(mode)
    try:
        assert list(engine35.generate(prompts, 40)) == want
    finally:
        engine35.set_speculation("off")


@pytest.mark.parametrize("batch", [1, 3])
def test_qwen35_mtp_speculation_with_a_token_map_keeps_the_plain_tokens_on_the_gpu(engine35, q35_folder, tmp_path, batch):
    """The MTP head's draft vocabulary on the Triton op set: its picks are the map's ids (here the
    odd ones), and the emitted tokens stay plain decode's."""
    import json

    ids = list(range(1, engine35.cfg.vocab_size, 2))
    (tmp_path / "map.json").write_text(json.dumps(ids))
    eng = load_engine_module(ENGINE_DIR, "fastqwen_engine_gpu_under_test").Engine(
        str(q35_folder), speculation="mtp", speculative_token_map=str(tmp_path / "map.json"))
    prompts = _prompts(batch, 58, seed=5 + batch, vocab=engine35.cfg.vocab_size)
    assert list(eng.generate(prompts, 40)) == list(engine35.generate(prompts, 40))
    assert eng.spec_stats()["verify_steps"] > 0
    with torch.inference_mode():
        h = torch.randn(4, eng.cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        picks = eng.model.mtp_picks(h.bfloat16())
    assert picks.shape == (4,) and all(p % 2 == 1 for p in picks.tolist())


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_auto_verifies_of_every_width_keep_the_plain_tokens_on_the_gpu(engine, engine35, family, monkeypatch):
    """auto's graphs of 1-4 drafts and its plain step, taken in turn (its choice replaced by a
    cycle), over prompts ending 6 positions before a GDN chunk's end."""
    import sys

    eng = engine if family == "qwen3" else engine35
    module = sys.modules[type(eng).__module__]

    class Cycling(module.AutoPolicy):
        def next_width(self, found=True):
            self.turn = getattr(self, "turn", -1) + 1
            choices = list(self.verify_ms) + [0]
            return choices[self.turn % len(choices)]

    prompts = _prompts(3, 58, seed=58, vocab=eng.cfg.vocab_size)
    want = list(eng.generate(prompts, 40))
    monkeypatch.setattr(module, "AutoPolicy", Cycling)
    eng.set_speculation("auto")
    try:
        assert list(eng.generate(prompts, 40)) == want
        assert set(eng.spec_stats()["width_steps"]) == {1, 2, 3, 4}
        assert all(eng._spec.graphs[f"verify{w}"] is not None for w in (1, 2, 3, 4))
    finally:
        eng.set_speculation("off")

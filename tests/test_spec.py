"""Exact speculative decoding on the CPU reference path (tiny Qwen3 and Qwen3.5): a verify row's
logits are the plain decode step's bits, speculation on or off gives the same tokens for every drafter, the
drafters propose what their definitions say, and the statistics add up."""
import pytest
import torch

from engine_modules import ENGINE_DIR, load_engine_module

engine_module = load_engine_module(ENGINE_DIR, "fastqwen_engine_spec_under_test")

import fq_spec  # noqa: E402  (on the path once the engine module is loaded)



def _prompts(batch, length, seed, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


@pytest.fixture(scope="module")
def qwen35_tiny_model(tmp_path_factory):
    from fastqwen import synth35

    return synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35spec") / "tiny", seed=3, progress=False)


@pytest.fixture(scope="module")
def plain(tiny_model):
    return engine_module.Engine(str(tiny_model))


# ---- the option -------------------------------------------------------------------------------
@pytest.mark.parametrize("value,mode,accept", [("off", "off", 1.0), ("ngram", "ngram", 1.0), ("Recycle", "recycle", 1.0),
                                               ("auto", "auto", 1.0),
                                               ("oracle:0.7", "oracle", 0.7), ("oracle:0", "oracle", 0.0)])
def test_speculation_values_parse(value, mode, accept):
    spec = fq_spec.parse_speculation(value)
    assert (spec.mode, spec.accept, spec.k) == (mode, accept, fq_spec.DEFAULT_K)


@pytest.mark.parametrize("value,k,message", [("fast", None, "'fast' is not one of"),
                                             ("oracle:1.5", None, r"in \[0, 1\]"), ("oracle:x", None, r"in \[0, 1\]"),
                                             (3, None, "must be a string"), ("ngram", 0, "speculative_tokens"),
                                             ("ngram", 17, "speculative_tokens"), ("ngram", True, "speculative_tokens")])
def test_a_bad_speculation_value_is_an_error_naming_it(value, k, message):
    with pytest.raises(ValueError, match=message):
        fq_spec.parse_speculation(value, k)


def test_the_environment_sets_speculation_and_a_keyword_wins(tiny_model, monkeypatch):
    monkeypatch.setenv("FASTQWEN_SPECULATION", "ngram")
    assert engine_module.Engine(str(tiny_model)).spec.mode == "ngram"
    assert engine_module.Engine(str(tiny_model), speculation="off").spec.mode == "off"
    monkeypatch.setenv("FASTQWEN_SPECULATION", "nonsense")
    with pytest.raises(ValueError, match="nonsense"):
        engine_module.Engine(str(tiny_model))


def test_mtp_needs_a_qwen35_checkpoint_with_its_head(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="a Qwen3 model has none"):
        engine_module.Engine(str(tiny_model), speculation="mtp")


def test_qwen35_speculation_needs_exact_decode(qwen35_tiny_model):
    with pytest.raises(ValueError, match="needs exact_decode"):
        engine_module.Engine(str(qwen35_tiny_model), speculation="ngram", exact_decode=False)


# ---- acceptance and the drafters (device state, here on the CPU) ------------------------------
def _state(seqs, k, limit=None):
    """A SpecState holding seqs (each sequence's prompt + emitted tokens)."""
    width = max(len(x) for x in seqs) + 8
    st = fq_spec.SpecState(len(seqs), width, k, "cpu")
    for b, x in enumerate(seqs):
        st.seq[b, :len(x)] = torch.tensor(x)
        st.length[b] = len(x)
        st.limit[b] = width if limit is None else limit[b]
    return st


@pytest.mark.parametrize("drafts,picks,room,matched,emit", [
    ([1, 2, 3], [1, 2, 3, 4], 9, 3, 4), ([1, 2, 3], [1, 5, 3, 4], 9, 1, 2), ([9, 2, 3], [1, 2, 3, 4], 9, 0, 1),
    ([1, 2, 3], [1, 2, 3, 4], 2, 3, 2), ([1, 2, 3], [1, 2, 3, 4], 0, 3, 0)])
def test_accept_keeps_the_agreeing_prefix_and_the_targets_next_pick(drafts, picks, room, matched, emit):
    m, e = fq_spec.accept_rows(torch.tensor([drafts]), torch.tensor([picks]), torch.tensor([room]))
    assert (m.item(), e.item()) == (matched, emit)


def test_the_state_appends_what_each_sequence_emits_and_stops_at_its_limit():
    st = _state([[5, 6], [7]], k=2, limit=[4, 9])
    st.append(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([2, 3]))
    assert st.length.tolist() == [4, 4]
    assert st.seq[0, :4].tolist() == [5, 6, 1, 2] and st.seq[1, :4].tolist() == [7, 4, 5, 6]
    assert st.last().tolist() == [2, 6] and st.positions().tolist() == [3, 3]


def test_prompt_lookup_kept_as_tokens_come_drafts_as_a_scan_of_the_sequence_does():
    """PromptLookup's index, extended a token or a few at a time, gives at every length the draft
    of a plain scan for the latest earlier occurrence of the tail (written here)."""
    PromptLookup = fq_spec.PromptLookup

    def scan(seq, k, max_n=3):
        for n in range(min(max_n, len(seq) - 1), 0, -1):
            for i in range(len(seq) - n - 1, -1, -1):
                if seq[i:i + n] == seq[-n:]:
                    got = seq[i + n:i + n + k]
                    return got + [seq[-1]] * (k - len(got))
        return [seq[-1]] * k

    g = torch.Generator().manual_seed(3)
    for vocab, n in ((3, 60), (6, 80), (50, 40)):
        seq = torch.randint(0, vocab, (n,), generator=g).tolist()
        lookup = PromptLookup(seq[:5])
        at = 5
        while at < n:
            step = 1 + at % 3
            lookup.extend(seq[at:at + step])
            at = min(n, at + step)
            for k in (1, 4):
                assert lookup.draft(k) == scan(seq[:at], k), (vocab, at, k)
    assert PromptLookup([7]).draft(3) == [7, 7, 7]
    assert PromptLookup([1, 2, 3, 9, 1, 2, 3]).draft(2) == [9, 1]


def test_ngram_drafts_what_followed_the_latest_occurrence_of_the_tail():
    d = fq_spec.NgramDrafter()
    # tail (2, 3) last seen before at index 5 -> followed by 5, 6, then the sequence's own tail
    assert d.draft(_state([[1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]], 3)).tolist() == [[5, 6, 1]]
    assert d.draft(_state([[10, 11, 12, 13]], 2)).tolist() == [[13, 13]]   # nothing to match
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, v, (n,), generator=g).tolist() for v, n in [(3, 20), (5, 30), (8, 12), (2, 4), (4, 1)]]
    for k in (1, 4, 7):
        # the device's drafts are the server's host-side prompt lookup's (fastqwen.serve.speculation)
        assert d.draft(_state(seqs, k)).tolist() == [fq_spec.PromptLookup(x).draft(k) for x in seqs]


def test_recycle_chains_the_targets_latest_picks_from_confirmed_rows():
    d = fq_spec.RecycleDrafter(100)
    st = _state([[1, 4]], 2)
    d.prepare(st)
    d.start(st, 1, 10)
    assert d.draft(st).tolist() == [[4, 4]]
    # row 4 -> 7 (kept: the next row's input is 7), 7 -> 8 (the draft 9 after it was wrong: stop)
    d.observe(st, torch.tensor([[4, 7, 9]]), torch.tensor([[7, 8, 2]]), torch.tensor([2]))
    assert {t: d.table[0, t].item() for t in (4, 7, 9)} == {4: 7, 7: 8, 9: -1}
    st3 = _state([[1, 4]], 3)
    assert d.draft(st3).tolist() == [[7, 8, 4]]
    # a later row's pick wins for a token seen twice in one verify
    d.observe(st, torch.tensor([[4, 4, 4]]), torch.tensor([[4, 4, 6]]), torch.tensor([3]))
    assert d.table[0, 4].item() == 6


def _oracle(accept, recordings, prompt, k, vocab=50, seed=0):
    d = fq_spec.OracleDrafter(accept, vocab, seed=seed)
    for p, rec in recordings.items():
        d.record(list(p), rec)
    d.set_prompts([list(p) for p in recordings])
    return d


def test_the_oracle_replays_its_recording_and_corrupts_at_the_asked_rate():
    right = _oracle(1.0, {(1, 2): [5, 6, 7, 8]}, 2, 2)
    st = _state([[1, 2, 5]], 2)
    right.prepare(st)
    right.start(st, 2, 4)
    assert right.draft(st).tolist() == [[6, 7]]
    st.append(torch.tensor([[6, 7]]), torch.tensor([2]))
    assert right.draft(st).tolist() == [[8, 7]]             # past the recording: the last token
    wrong = _oracle(0.0, {(1, 2): list(range(40))}, 2, 16)
    st = _state([[1, 2, 0]], 16)
    wrong.prepare(st)
    wrong.start(st, 2, 40)
    drafted = wrong.draft(st)[0].tolist()
    assert all(t != r and 0 <= t < 50 for t, r in zip(drafted, range(1, 17)))
    record = list(range(1, 4001))
    half = _oracle(0.5, {(1,): record}, 1, 16, vocab=5000, seed=3)
    st = fq_spec.SpecState(1, 4100, 16, "cpu")
    half.prepare(st)
    st.start(torch.tensor([[1]]), torch.tensor([record[0]]), 4000)
    half.start(st, 1, 4000)
    hits = total = 0
    while st.length.item() < 3980:
        drafted = half.draft(st)[0].tolist()
        m = st.length.item() - 1
        hits += sum(t == r for t, r in zip(drafted, record[m:m + 16]))
        total += 16
        st.append(torch.tensor([record[m:m + 16]]), torch.tensor([16]))
    assert 0.45 < hits / total < 0.55


# ---- the auto policy ---------------------------------------------------------------------------
def test_expected_tokens_is_the_geometric_sum():
    assert fq_spec.expected_tokens(0.0, 4) == 1.0 and fq_spec.expected_tokens(1.0, 4) == 5.0
    assert fq_spec.expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_verify_widths_are_every_width_to_4_then_the_tile_filling_ones_and_k():
    assert fq_spec.verify_widths(1) == (1,)
    assert fq_spec.verify_widths(3) == (1, 2, 3)
    assert fq_spec.verify_widths(4) == (1, 2, 3, 4)
    assert fq_spec.verify_widths(6) == (1, 2, 3, 4, 6)
    assert fq_spec.verify_widths(8) == (1, 2, 3, 4, 7, 8)
    assert fq_spec.verify_widths(16) == (1, 2, 3, 4, 7, 8, 15, 16)


def test_verify_observed_counts_a_rejection_only_where_one_was_seen():
    assert fq_spec.verify_observed(3, 4, 100) == (2, 1)       # 2 right, the third wrong
    assert fq_spec.verify_observed(5, 4, 100) == (4, 0)       # all 4 right: none seen
    assert fq_spec.verify_observed(2, 4, 2) == (1, 0)         # capped by room: the next one unknown
    assert fq_spec.verify_observed(1, 1, 100) == (0, 1)
    assert fq_spec.verify_observed(0, 4, 0) == (0, 0)         # a finished sequence


def _fed(policy, right, rejected, verifies=100):
    """The policy after `verifies` verifies that each checked `right` right drafts and saw `rejected`
    wrong ones (the estimate: right / (right + rejected))."""
    for _ in range(verifies):
        policy.observe_verify(right, rejected)
    return policy


def test_auto_estimates_a_drafts_chance_from_the_drafts_it_checked():
    policy = fq_spec.AutoPolicy({4: 3.0}, plain_ms=2.5)
    assert policy.acceptance == 0.0
    for _ in range(100):                   # the prior fades over about `window` drafts
        policy.observe_verify(3, 1)        # rows of 3 right then a wrong one
    assert policy.acceptance == pytest.approx(0.75, abs=0.01)
    for _ in range(200):
        policy.observe_verify(0, 1)        # the window forgets: wrong from the first draft
    assert policy.acceptance < 0.05


def test_auto_picks_the_width_that_pays_best_at_the_running_acceptance():
    # a batch where a wider verify costs more (16 sequences: 32, 48, 80 rows)
    steep = {1: 3.0, 2: 3.6, 4: 5.0}
    assert fq_spec.AutoPolicy(steep, 2.5, prior=0.9).best() == 4
    assert fq_spec.AutoPolicy(steep, 2.5, prior=0.5).best() == 1
    assert fq_spec.AutoPolicy(steep, 2.5, prior=0.3).best() == 1      # 1.3 / 3.0 beats 1.05 / 2.5
    assert fq_spec.AutoPolicy(steep, 2.5, prior=0.2).best() == 0      # a plain step
    # one sequence: the verify's rows cost about the same, so the widest pays best
    flat = {1: 3.0, 2: 3.05, 4: 3.1}
    assert fq_spec.AutoPolicy(flat, 2.5, prior=0.5).best() == 4
    # the estimate moves the choice
    policy = fq_spec.AutoPolicy(steep, 2.5, prior=0.0)
    assert policy.next_width() == 0
    assert _fed(policy, 1, 1).next_width() == 1       # a = 0.5
    assert _fed(policy, 4, 0).next_width() == 4       # a = 1


def test_auto_says_the_acceptance_from_which_a_width_pays():
    # width 1 pays from a ~ 0.58, width 2 from ~ 0.85, width 4 never (5 tokens / 6 ms < 1.05 / 1 ms)
    policy = fq_spec.AutoPolicy({1: 1.5, 2: 2.5, 4: 6.0}, plain_ms=1.0)
    assert policy.break_even(1) == pytest.approx(0.575, abs=0.01)
    assert 0.8 < policy.break_even(2) < 0.9 and policy.break_even(4) > 1.0
    # one sequence: width 4 pays at a lower acceptance than width 1
    flat = fq_spec.AutoPolicy({1: 3.0, 4: 3.2}, plain_ms=2.5)
    assert flat.break_even(4) < flat.break_even(1) < 1.0
    hopeless = fq_spec.AutoPolicy({4: 10.0}, plain_ms=1.0, prior=1.0)
    assert hopeless.acceptance == 1.0 and hopeless.next_width() == 0


def test_auto_moves_its_costs_toward_what_the_steps_measure():
    # timed at the start, width 4 pays at a = 0.5; the call's verifies turn out to cost twice that
    policy = fq_spec.AutoPolicy({1: 3.0, 4: 3.2}, plain_ms=2.5, prior=0.5)
    assert policy.best() == 4
    for _ in range(30):
        policy.observe_cost(4, 6.4)
    assert policy.verify_ms[4] == pytest.approx(6.4, rel=0.01) and policy.best() == 1
    for _ in range(30):
        policy.observe_cost(0, 1.0)              # plain steps cheaper than timed: no width pays, even at a = 1
    assert policy.plain_ms == pytest.approx(1.0, rel=0.01) and policy.best() == 0
    policy.observe_cost(1, None)                 # timing off: nothing moves
    assert policy.verify_ms[1] == 3.0
    assert fq_spec.marks_ms([1.5, 2.0]) == 3.5 and fq_spec.marks_ms([None]) is None and fq_spec.marks_ms([]) is None


def test_the_servers_policy_keeps_a_cost_per_bucket_and_moves_the_one_a_step_measured():
    from fq_slots import BucketPolicy

    policy = BucketPolicy({1: (2.5, {1: 3.0, 4: 3.2}), 16: (3.5, {1: 5.0, 4: 9.0})})
    policy.policy.accepted = policy.policy.checked * 0.6          # a = 0.6
    assert policy.next_width(1) == 4 and policy.next_width(9) == 1
    for _ in range(30):
        policy.observe_cost(16, 1, 12.0)     # bucket 16's verify of 1 costs more at the requests' contexts
    assert policy.costs[16][1][1] == pytest.approx(12.0, rel=0.01) and policy.next_width(16) == 0
    assert policy.costs[1] == (2.5, {1: 3.0, 4: 3.2}) and policy.next_width(1) == 4     # bucket 1 kept its own
    policy.observe_cost(8, 0, 1.0)           # no such bucket, and timing off: nothing moves
    policy.observe_cost(1, 0, None)
    assert policy.costs[1][0] == 2.5


def test_auto_verifies_while_they_pay_and_learns_from_plain_steps_without_verifying():
    """A verify costs 1.2 plain steps here (it pays from about a = 0.2 with 4 drafts). Verifies'
    outcomes and plain steps' host checks (observe_shadow) feed one running estimate: wrong checks
    keep every step plain, with no verify spent on finding out; two right ones (a = 2 / 6 against
    the prior of 0 worth 4 drafts) turn verifies on; wrong verifies turn them off again."""
    good = fq_spec.AutoPolicy({4: 3.0}, plain_ms=2.5, prior=0.0)
    assert not good.pays() and good.next_width() == 0
    for _ in range(20):
        good.observe_verify(3, 1)
    assert good.pays() and good.next_width() == 4
    wrong = fq_spec.AutoPolicy({1: 3.0, 4: 3.2}, plain_ms=2.5)
    for _ in range(1000):
        assert wrong.next_width() == 0
        wrong.observe_shadow(0, 2)
    assert wrong.acceptance == 0.0
    right = fq_spec.AutoPolicy({1: 3.0, 4: 3.2}, plain_ms=2.5)
    right.observe_shadow(1, 0)
    assert right.next_width() == 0
    right.observe_shadow(1, 0)
    assert right.next_width() == 4 and right.acceptance == pytest.approx(2 / 6, rel=0.05)
    for _ in range(40):
        right.observe_verify(0, 1)
    assert right.next_width() == 0
    with pytest.raises(ValueError, match="positive costs"):
        fq_spec.AutoPolicy({4: 0.0}, plain_ms=1.0)
    with pytest.raises(ValueError, match="positive costs"):
        fq_spec.AutoPolicy({}, plain_ms=1.0)


class _PlainPolicy(fq_spec.AutoPolicy):
    """auto's policy that never verifies, recording what the shadow checks told it."""
    seen = []

    def best(self):
        return 0

    def observe_shadow(self, right, wrong):
        type(self).seen.append((right, wrong))
        super().observe_shadow(right, wrong)


def test_auto_checks_each_plain_steps_would_be_draft_against_its_pick(plain, tiny_model, monkeypatch):
    """Every plain step's pick of every sequence is set against prompt lookup's first draft over
    the tokens before it (on the host): the counts equal a replay of PromptLookup over the output."""
    prompts = _prompts(3, 12, seed=6)
    prompts[1] = [5, 6, 7, 8] * 3
    want = list(plain.generate(prompts, 30))
    monkeypatch.setattr(engine_module, "AutoPolicy", _PlainPolicy)
    _PlainPolicy.seen = []
    eng = engine_module.Engine(str(tiny_model), speculation="auto", speculative_tokens=3)
    got = list(eng.generate(prompts, 30))
    assert got == want and eng.spec_stats()["verify_steps"] == 0
    right = wrong = 0
    for b, prompt in enumerate(prompts):
        out = [step[b] for step in got]
        for j in range(1, len(out)):            # out[0] is the prompt pass's, the rest plain steps'
            hit = fq_spec.PromptLookup(prompt + out[:j]).draft(1)[0] == out[j]
            right, wrong = right + hit, wrong + (not hit)
    assert (sum(r for r, _ in _PlainPolicy.seen), sum(w for _, w in _PlainPolicy.seen)) == (right, wrong)
    assert right + wrong == 3 * 29


# ---- verify rows are the decode step's bits ------------------------------------------------
def _allocate(model, B, capacity, paged=None):
    """Caches of B rows of `capacity` positions; paged = (each row's pages {row: [page, ...]}, pages
    in the pool, positions a page): the paged form, rows on pages out of order."""
    if paged is None:
        model.allocate_cache(B, capacity)
    else:
        tables, pool, page = paged
        model.allocate_paged_cache(B, pool, page, capacity)
        for b, pages in tables.items():
            model.block_table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    model.ensure_rope(capacity)


def _one_row_steps(model, tokens, P):
    """The plain decode step's logits for tokens [B, T] at positions P .. P + T - 1, one step a
    position: [B, T, vocab]."""
    B, T = tokens.shape
    steps = [model.decode_logits(tokens[:, j].contiguous(), torch.full((B,), P + j, dtype=torch.int32),
                                 torch.full((B,), P + j + 1, dtype=torch.int32)) for j in range(T)]
    return torch.stack(steps, dim=1)


@pytest.mark.parametrize("paged", [False, True])
def test_verify_rows_equal_the_one_row_decode_steps_bit_for_bit(plain, paged):
    model = plain.model
    B, P, T = 3, 9, 5
    ids = torch.tensor(_prompts(B, P, seed=11))
    tokens = torch.tensor(_prompts(B, T, seed=12))
    with torch.inference_mode():
        _allocate(model, B, 32, ({b: [3 * b + 2, 3 * b] for b in range(B)}, 3 * B, 16) if paged else None)
        model.prefill_logits(ids)
        verify = model.verify_logits(tokens, torch.full((B,), P, dtype=torch.int32))
        steps = _one_row_steps(model, tokens, P)
    plain._drop_graphs()
    model.allocate_cache(1, 2)
    assert torch.equal(verify, steps)


# ---- generate: the same tokens, on or off ------------------------------------------------------
def _every_token_verified(st: dict, batch: int, steps: int) -> None:
    """A drafter's run: every token after the prompt pass's came out of a verify (none from a plain
    step), the verifies' emitted count is the tokens generate() returned, and no more drafts were
    kept than were made."""
    assert st["plain_steps"] == 0 and st["verify_steps"] > 0 and st["verified_rows"] > 0
    assert st["emitted"] == batch * (steps - 1)
    assert 0 <= st["accepted"] <= st["drafted"]


@pytest.mark.parametrize("mode", ["ngram", "recycle", "oracle:1.0", "oracle:0.6", "oracle:0.0"])
def test_speculation_emits_the_plain_tokens(plain, tiny_model, mode):
    prompts = _prompts(3, 12, seed=5)
    prompts[1] = [5, 6, 7, 8] * 3            # a repeating prompt: prompt lookup has something to find
    want = list(plain.generate(prompts, 30))
    eng = engine_module.Engine(str(tiny_model), speculation=mode, speculative_tokens=3)
    got = list(eng.generate(prompts, 30))
    assert got == want
    st = eng.spec_stats()
    assert st["mode"] == mode.split(":")[0] and st["k"] == 3
    _every_token_verified(st, 3, 30)
    assert st["width_steps"] == {3: st["verify_steps"]}
    # drafts count where a sequence had room for them: with r < 4 tokens left, r - 1 (at most 3
    # verifies a sequence, 1 + 2 + 3 drafts fewer than 3 each)
    assert 3 * st["verified_rows"] - 3 * (1 + 2 + 3) <= st["drafted"] <= 3 * st["verified_rows"]
    assert st["verify_ms"] > 0 and st["draft_ms"] > 0 and st["plain_ms"] is None
    if mode == "ngram":                     # the repeating prompt: some drafts right
        assert st["accepted"] > 0
    if mode == "oracle:1.0":                # every draft right: k + 1 tokens a verify (the last one's
        # drafts would run past the 30 tokens: fewer, all right)
        assert st["verify_steps"] == -(-(30 - 1) // 4) and st["record_s"] > 0
        assert st["accepted"] == st["drafted"] and st["acceptance"] == 1.0
    if mode == "oracle:0.0":                # every draft wrong: one token a verify, as plain decode
        assert st["accepted"] == 0 and st["verify_steps"] == 29


def test_the_runner_times_its_steps_at_the_calls_context_and_leaves_the_state_there(plain):
    from fq_decode import SpecRunner

    with torch.inference_mode():
        plain._prepare_cache(2, 256)
        state = fq_spec.SpecState(2, 256, 3, plain.device)
        runner = SpecRunner(plain.model, fq_spec.NgramDrafter(), state, False, plain=True, widths=(1, 3),
                            context=200)
        # every warm-up and timed step ran at position 200 with no room to emit: nothing appended
        assert state.length.tolist() == [201, 201] and state.limit.tolist() == [201, 201]
        assert set(runner.costs) == {"draft_ms", "verify1_ms", "verify3_ms", "plain_ms"}
        assert all(ms > 0 for ms in runner.costs.values())
        # a step run eagerly (a profiler's view) leaves the state where it was too
        runner.run_eager("verify3")
        assert state.length.tolist() == [201, 201]
        with pytest.raises(ValueError, match=r"no step 'verify2' \(its steps: draft, verify1, verify3, plain\)"):
            runner.run_eager("verify2")
        with pytest.raises(ValueError, match="context 256 outside"):
            SpecRunner(plain.model, fq_spec.NgramDrafter(), fq_spec.SpecState(2, 256, 3, plain.device), False,
                       context=256)
    plain._drop_graphs()
    plain.model.allocate_cache(1, 2)


class _CyclingPolicy(fq_spec.AutoPolicy):
    """auto's policy, its choice replaced by a cycle through every verify width and a plain step."""

    def next_width(self):
        self.turn = getattr(self, "turn", -1) + 1
        choices = list(self.verify_ms) + [0]
        return choices[self.turn % len(choices)]


def test_auto_mixes_verify_widths_and_plain_steps_and_keeps_the_plain_tokens(plain, tiny_model, monkeypatch):
    prompts = _prompts(3, 12, seed=5)
    prompts[1] = [5, 6, 7, 8] * 3
    want = list(plain.generate(prompts, 40))
    monkeypatch.setattr(engine_module, "AutoPolicy", _CyclingPolicy)
    eng = engine_module.Engine(str(tiny_model), speculation="auto", speculative_tokens=3)
    assert list(eng.generate(prompts, 40)) == want
    st = eng.spec_stats()
    assert set(st["width_steps"]) == {1, 2, 3} and st["plain_steps"] > 0
    assert sum(st["width_steps"].values()) == st["verify_steps"]
    assert set(st["verify_ms_by_width"]) == {1, 2, 3} and st["verify_ms"] > 0
    assert st["plain_ms"] > 0 and st["draft_ms"] > 0
    # the verifies emitted what the plain steps (one token a sequence at most) did not
    assert 3 * 39 - 3 * st["plain_steps"] <= st["emitted"] < 3 * 39


def test_qwen35_auto_mixes_verify_widths_across_a_chunks_end(plain35, qwen35_tiny_model, monkeypatch):
    """Verifies of 1-4 drafts and plain steps in turn over prompts ending 6 positions before a
    chunk's end: the narrower verifies close chunks at other rows than the widest."""
    prompts = _prompts(3, 58, seed=58)
    prompts[1] = ([5, 6, 7, 8] * 20)[:58]
    want = list(plain35.generate(prompts, 30))
    monkeypatch.setattr(engine_module, "AutoPolicy", _CyclingPolicy)
    eng = engine_module.Engine(str(qwen35_tiny_model), speculation="auto")
    assert list(eng.generate(prompts, 30)) == want
    assert set(eng.spec_stats()["width_steps"]) == {1, 2, 3, 4}


def test_the_oracle_records_once_then_replays(tiny_model):
    eng = engine_module.Engine(str(tiny_model), speculation="oracle:1.0")
    prompts = _prompts(2, 7, seed=8)
    first = list(eng.generate(prompts, 10))
    assert eng.spec_stats()["record_s"] > 0
    assert list(eng.generate(prompts, 10)) == first
    assert eng.spec_stats()["record_s"] == 0.0


def test_spec_stats_are_empty_with_speculation_off_and_describe_names_the_mode(plain, tiny_model):
    list(plain.generate(_prompts(1, 5, seed=1), 3))
    assert plain.spec_stats()["drafted"] == 0 and plain.spec_stats()["acceptance"] is None
    assert plain.describe()["speculation"] == "off"
    assert engine_module.Engine(str(tiny_model), speculation="ngram").describe()["speculation"] == "ngram (k=4)"


@pytest.mark.parametrize("mode", ["recycle", "oracle:0.7"])
def test_batch_one_long_run_keeps_the_plain_tokens(plain, tiny_model, mode):
    """One sequence, 6 drafts a verify, 64 tokens; the oracle at 0.7 keeps several drafts in a
    verify (fewer verifies than tokens), token recycling on random weights mostly none."""
    prompts = _prompts(1, 20, seed=21)
    want = list(plain.generate(prompts, 64))
    eng = engine_module.Engine(str(tiny_model), speculation=mode, speculative_tokens=6)
    assert list(eng.generate(prompts, 64)) == want
    st = eng.spec_stats()
    _every_token_verified(st, 1, 64)
    assert st["verify_steps"] == st["verified_rows"] == 63 - st["accepted"]
    if mode == "oracle:0.7":
        assert st["accepted"] > 6 and st["verify_steps"] < 63 - 6


# ---- Qwen3.5: the GDN layers' verify and its rollback ------------------------------------------
@pytest.fixture(scope="module")
def plain35(qwen35_tiny_model):
    return engine_module.Engine(str(qwen35_tiny_model))


@pytest.mark.parametrize("paged", [False, True])
def test_qwen35_verify_rows_equal_the_decode_steps_across_a_chunks_end(plain35, paged):
    """Positions 61-65: the verify closes the first chunk at its third row and goes on in the next."""
    model = plain35.model
    B, P, T = 2, 61, 5
    ids = torch.tensor(_prompts(B, P, seed=31))
    tokens = torch.tensor(_prompts(B, T, seed=32))
    with torch.inference_mode():
        _allocate(model, B, 128, ({b: [b, 7 - b, 4 + b] for b in range(B)}, 8, 32) if paged else None)
        model.prefill_logits(ids)
        conv, state = model.conv_state.clone(), model.state.clone()
        verify = model.verify_logits(tokens, torch.full((B,), P, dtype=torch.int32))
        # nothing kept: the states as before the verify
        model.commit_verify(torch.full((B,), P, dtype=torch.int32), torch.zeros(B, dtype=torch.int64))
        assert torch.equal(model.conv_state, conv) and torch.equal(model.state, state)
        steps = _one_row_steps(model, tokens, P)
    plain35._drop_graphs()
    model.allocate_cache(1, 2)
    assert torch.equal(verify, steps)


@pytest.mark.parametrize("P", [61, 63])
def test_qwen35_a_wide_verify_runs_no_row_from_a_close_on(plain35, P):
    """A verify of more sequences than rollback_rows. At positions 61-65 a sequence may keep 2 rows
    (row 2 closes the chunk): the verify runs rows 0 and 1 only (the recurrent state and the
    chunk's rows are as before past them, rows 0 and 1 of the chunk not overwritten by the next
    chunk's), they equal the decode steps, and keeping both leaves every state as two steps do.
    At 63-67 the close is row 0: all 5 rows kept, equal to the steps across the close."""
    model = plain35.model
    B, T = model.rollback_rows + 2, 5
    keep = 2 if P == 61 else T
    ids = torch.tensor(_prompts(B, P, seed=41))
    tokens = torch.tensor(_prompts(B, T, seed=42))
    pos = torch.full((B,), P, dtype=torch.int32)
    n = (P + keep - 1) % 64 + 1                     # the chunk rows written by the kept rows' chunk
    with torch.inference_mode():
        _allocate(model, B, 128)
        model.prefill_logits(ids)
        state = model.state.clone()
        assert model.verify_keep(pos, T).tolist() == [keep] * B
        verify = model.verify_logits(tokens, pos)
        if P == 61:
            assert torch.equal(model.state, state)  # no close ran
        model.commit_verify(pos, torch.full((B,), keep, dtype=torch.int64))
        got = (model.conv_state.clone(), model.state.clone(), [r.v[:, :n].clone() for r in model.rows])
        model.prefill_logits(ids)
        steps = _one_row_steps(model, tokens[:, :keep], P)
        want = (model.conv_state, model.state, [r.v[:, :n] for r in model.rows])
        assert torch.equal(verify[:, :keep], steps)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    plain35._drop_graphs()
    model.allocate_cache(1, 2)


@pytest.mark.parametrize("mode", ["ngram", "recycle", "oracle:0.5", "oracle:1.0"])
def test_qwen35_wide_speculation_emits_the_plain_tokens(plain35, qwen35_tiny_model, mode):
    """Six sequences (wider than rollback_rows: each verify stops before a chunk's close) over
    prompts ending 6 positions before a chunk's end: the tokens stay plain decode's, and drafts the
    verify did not run are not counted (the oracle at 1.0: acceptance exactly 1)."""
    prompts = _prompts(6, 58, seed=66)
    prompts[1] = ([5, 6, 7, 8] * 20)[:58]
    want = list(plain35.generate(prompts, 30))
    eng = engine_module.Engine(str(qwen35_tiny_model), speculation=mode)
    assert 6 > eng.model.rollback_rows
    assert list(eng.generate(prompts, 30)) == want
    st = eng.spec_stats()
    _every_token_verified(st, 6, 30)
    if mode == "oracle:1.0":
        assert st["drafted"] > 0 and st["accepted"] == st["drafted"]


@pytest.mark.parametrize("prompt", [50, 58, 61])
@pytest.mark.parametrize("mode", ["ngram", "oracle:0.5", "oracle:0.0"])
def test_qwen35_speculation_emits_the_plain_tokens(plain35, qwen35_tiny_model, prompt, mode):
    """Prompts ending 14, 6 and 3 positions before a chunk's end: verifies that close a chunk at a
    row they then reject (oracle:0 rejects every draft), and ones that keep the close."""
    prompts = _prompts(3, prompt, seed=prompt)
    prompts[1] = ([5, 6, 7, 8] * 20)[:prompt]
    want = list(plain35.generate(prompts, 30))
    eng = engine_module.Engine(str(qwen35_tiny_model), speculation=mode)
    assert list(eng.generate(prompts, 30)) == want
    st = eng.spec_stats()
    _every_token_verified(st, 3, 30)
    if mode == "oracle:0.0":
        assert st["accepted"] == 0 and st["verify_steps"] == 29
    if mode == "oracle:0.5":
        assert st["accepted"] > 0


@pytest.mark.parametrize("mode", ["mtp", "oracle:0.8"])
def test_qwen35_mtp_head_drafts_and_the_plain_tokens_stay(plain35, qwen35_tiny_model, mode):
    """The MTP head (the synthetic checkpoint's mtp.*) loaded for "mtp" and for the oracle, which
    runs it and replaces its drafts; plain decode does not load it."""
    prompts = _prompts(2, 58, seed=4)
    want = list(plain35.generate(prompts, 24))
    assert not plain35.model.has_mtp
    eng = engine_module.Engine(str(qwen35_tiny_model), speculation=mode)
    assert eng.model.has_mtp and eng.model.mtp_k is None
    assert list(eng.generate(prompts, 24)) == want
    st = eng.spec_stats()
    assert st["draft_ms"] > 0 and 4 * st["verified_rows"] - 2 * (4 * 5 // 2) <= st["drafted"] <= 4 * st["verified_rows"]
    assert eng.model.mtp_k.shape[:2] == (eng.cfg.mtp_layers, 2)


def _mtp_after_prompts(model_dir, batch: int, seed: int):
    """An "mtp" engine's drafter ready after the prompt pass over `batch` random 20-token prompts
    (a cache of 64 positions, 3 drafts, 10 steps to go): (engine, speculation state, prompts, the
    prompt pass's picks)."""
    eng = engine_module.Engine(str(model_dir), speculation="mtp")
    prompts = _prompts(batch, 20, seed=seed)
    with torch.inference_mode():
        eng._prepare_cache(batch, 64)
        st = fq_spec.SpecState(batch, 64, 3, "cpu")
        eng._drafter.prepare(st)
        first = eng.model.prefill(torch.tensor(prompts))
        st.start(torch.tensor(prompts), first, 10)
        eng._drafter.start(st, 20, 10)
    return eng, st, prompts, first


def test_mtp_drafts_are_the_heads_argmax_chain(qwen35_tiny_model):
    """The drafter's k drafts after the prompt pass: the head's pick at the last prompt row, then
    each chained row's pick (checked against mtp_draft called row by row)."""
    eng, st, prompts, first_t = _mtp_after_prompts(qwen35_tiny_model, 1, seed=9)
    model, drafter = eng.model, eng._drafter
    with torch.inference_mode():
        drafts = drafter.draft(st)[0].tolist()
        first = first_t.tolist()
        # again by hand: the head over the prompt rows, then two chained rows
        ids = torch.tensor(prompts)
        nxt = torch.cat([ids[:, 1:], torch.tensor([first])], dim=1)
        assert model.hidden.shape[1] == 20          # the prompt pass's states, every position
        picks, hidden = model.mtp_draft(nxt, model.hidden, torch.zeros(1, dtype=torch.int32))
        chain, pick, state = [int(picks[0, -1])], picks[:, -1], hidden[:, -1]
        for i in (1, 2):       # the prompt's rows at positions 0-19; chained rows at 20, 21
            p2, h2 = model.mtp_draft(pick.view(1, 1), state.unsqueeze(1), torch.full((1,), 19 + i, dtype=torch.int32))
            pick, state = p2[:, 0], h2[:, 0]
            chain.append(int(pick[0]))
    assert drafts == chain


def test_mtp_observe_readies_the_heads_pick_at_each_sequences_last_kept_row(qwen35_tiny_model):
    """After a verify the head runs over all its rows (their K/V) and the LM head over each
    sequence's last kept row only: that row's pick, state and position are the next first draft's,
    as the head over all rows (mtp_draft) gives them."""
    class Verified:                     # what observe reads of the speculation state
        def __init__(self, positions):
            self._positions = positions

        def positions(self):
            return self._positions

    eng = _mtp_after_prompts(qwen35_tiny_model, 2, seed=11)[0]
    model, drafter = eng.model, eng._drafter
    with torch.inference_mode():
        model.hidden = torch.randn(2, 4, eng.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
        picks = torch.tensor(_prompts(2, 4, seed=12))
        kept = torch.tensor([1, 3])
        drafter.observe(Verified(20 + kept.to(torch.int32)), None, picks, kept)
        want_picks, want_hidden = model.mtp_draft(picks, model.hidden, torch.full((2,), 20, dtype=torch.int32))
    rows = (torch.tensor([0, 1]), torch.tensor([0, 2]))
    assert drafter.pick.tolist() == want_picks[rows].tolist()
    assert torch.equal(drafter.state, want_hidden[rows])
    assert drafter.position.tolist() == [20, 22]


def test_set_speculation_switches_a_loaded_engine(plain35, qwen35_tiny_model):
    """One engine, its modes switched: the same tokens in each; "mtp" needs the head loaded."""
    eng = engine_module.Engine(str(qwen35_tiny_model))
    prompts = _prompts(2, 30, seed=6)
    want = list(eng.generate(prompts, 12))
    for mode in ("ngram", "oracle:0.5", "off"):
        eng.set_speculation(mode, 3)
        assert list(eng.generate(prompts, 12)) == want
        assert eng.describe()["speculation"] == ("off" if mode == "off" else f"{mode.split(':')[0]} (k=3)")
        st = eng.spec_stats()
        if mode == "off":
            assert st["verify_steps"] == 0 and st["drafted"] == 0
        else:
            _every_token_verified(st, 2, 12)
    with pytest.raises(ValueError, match="multi-token-prediction head loaded"):
        eng.set_speculation("mtp")
    assert eng.spec.mode == "off"            # a refused switch leaves the mode as it was


def test_switching_back_to_the_runners_mode_keeps_its_drafter_and_runner(plain, tiny_model):
    """"off" then the mode again (a bench's paired reps): the runner built for the mode is kept, so
    no graph is captured inside a timed call; another mode, or another k, builds its own."""
    prompts = _prompts(2, 12, seed=9)
    want = list(plain.generate(prompts, 10))
    eng = engine_module.Engine(str(tiny_model), speculation="auto", speculative_tokens=3)
    assert list(eng.generate(prompts, 10)) == want
    runner, drafter = eng._spec, eng._drafter
    eng.set_speculation("off")
    assert list(eng.generate(prompts, 10)) == want and eng._drafter is None
    eng.set_speculation("auto", 3)
    assert eng._drafter is drafter
    assert list(eng.generate(prompts, 10)) == want and eng._spec is runner
    for mode, k in (("auto", 2), ("ngram", 3)):
        eng.set_speculation(mode, k)
        assert eng._drafter is not drafter
        assert list(eng.generate(prompts, 10)) == want and eng._spec is not runner
    eng.set_speculation("auto", 3)            # only the last mode's drafter is kept
    assert eng._drafter is not drafter


@pytest.mark.parametrize("mode", ["auto", "ngram"])
def test_the_first_step_is_queued_before_the_first_tokens_are_read(plain, tiny_model, mode):
    """As plain decode's loop does, the device goes from the prompt pass into the first step: it is
    queued before the first tokens reach the caller (on the CPU it has run by then), and a call of
    one token queues none. The tokens stay plain decode's."""
    prompts = _prompts(2, 12, seed=11)
    eng = engine_module.Engine(str(tiny_model), speculation=mode, speculative_tokens=3)
    calls = []
    step = eng._spec_step
    eng._spec_step = lambda runner, width: calls.append(width) or step(runner, width)
    gen = eng.generate(prompts, 8)
    first = next(gen)
    assert len(calls) == 1 and (calls[0] == 0) == (mode == "auto")
    assert [first] + list(gen) == list(plain.generate(prompts, 8))
    calls.clear()
    assert list(eng.generate(prompts, 1)) == list(plain.generate(prompts, 1)) and calls == []


def test_a_verify_runs_a_cublas_product_as_the_b_row_steps_calls():
    """Inside planned_as(B), a product the tuner left on cuBLAS runs a verify's B T rows
    (sequence-major) as T calls of B rows, one row a sequence, as the B-row step calls it (cuBLAS's
    bits depend on the row count); the result is each row's product, in the rows' order. Outside
    a verify, and for a product on the GEMV, one call."""
    import fq_ops

    ops = fq_ops.TritonOps()            # no product tuned onto the GEMV: every product is cuBLAS's
    calls = []
    real = fq_ops.F.linear

    def linear(x, w):
        calls.append(tuple(x.shape))
        return real(x, w)

    gen = torch.Generator().manual_seed(0)
    B, T, K, N = 3, 4, 16, 8
    x = torch.randn(B * T, K, generator=gen)
    w = torch.randn(N, K, generator=gen)
    mp = pytest.MonkeyPatch()
    mp.setattr(fq_ops.F, "linear", linear)
    try:
        want = real(x, w)
        with ops.planned_as(B):
            got = ops.linear(x.view(B, T, K), w)
            assert calls == [(B, K)] * T and torch.equal(got.reshape(B * T, N), want)
            calls.clear()
            mp.setattr(ops, "add_rmsnorm", lambda res, r, nw, eps: r)     # the row-wise norm: a kernel
            assert torch.equal(ops.linear_add_rmsnorm(x, w, None, None, 1e-6), want)
            assert calls == [(B, K)] * T
            calls.clear()
            assert torch.equal(ops.linear(x[:B], w), want[:B]) and calls == [(B, K)]   # the step's own rows
        calls.clear()
        assert torch.equal(ops.linear(x, w), want) and calls == [(B * T, K)]            # no verify: one call
    finally:
        mp.undo()


# ---- one sequence's verify through the LM screen's rows ------------------------------------------
class _RowsScreen:
    """A stand-in for fqkernels.lm_screen.LmScreen on the CPU (the kernels need a GPU): the picks of
    the LM head's logits, row by row as the one-row step computes them; counts the rows it screens."""
    ROWS_MAX = 16

    def __init__(self, logits_of):
        self.logits_of, self.rows = logits_of, []

    def argmax(self, x, out=None):
        pick = torch.argmax(self.logits_of(x).float(), dim=-1)
        return pick if out is None else out.copy_(pick)

    def argmax_rows(self, x, out=None):
        assert x.is_contiguous() and x.dim() == 2
        self.rows.append(x.shape[0])
        return torch.cat([self.argmax(x[r:r + 1]) for r in range(x.shape[0])])


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
@pytest.mark.parametrize("mode", ["oracle:0.9", "oracle:0.3"])
def test_one_sequence_verify_picks_through_the_screens_rows(plain, plain35, tiny_model, qwen35_tiny_model,
                                                            family, mode):
    """At one sequence a verify's picks come from the screen's rows (k + 1 of them, the verify's
    hidden rows in order), and the tokens are plain decode's; at two sequences the logits' path."""
    base, path = (plain, tiny_model) if family == "qwen3" else (plain35, qwen35_tiny_model)
    prompts = _prompts(1, 40, seed=61)
    want = list(base.generate(prompts, 24))
    eng = engine_module.Engine(str(path), speculation=mode, speculative_tokens=3)
    model = eng.model
    head = model.w.lm_head if family == "qwen3" else model.w["lm_head.weight"]
    model.screen = _RowsScreen(lambda x: model.ops.linear(x, head))
    assert list(eng.generate(prompts, 24)) == want
    assert model.screen.rows and set(model.screen.rows) == {4}
    model.screen.rows.clear()
    two = _prompts(2, 40, seed=62)
    assert list(eng.generate(two, 8)) == list(base.generate(two, 8))
    assert model.screen.rows == []


@pytest.mark.parametrize("mode,moved", [("off", False), ("auto", False), ("ngram", True), ("oracle:0.5", True)])
def test_qwen35_moves_one_sequences_products_when_built_to_verify_every_step(qwen35_tiny_model, mode, moved):
    """Modes that verify every step put one sequence's products on the tensor cores (their verify's rows
    share the step's tile); "off" and "auto" keep the one-row kernel; set_speculation keeps the choice."""
    eng = engine_module.Engine(str(qwen35_tiny_model), speculation=mode)
    shapes = {tuple(p.weights[0].shape) for p in eng.model.decode_products()}
    assert eng.model.ops.one_row_tensor_cores == (frozenset(shapes) if moved else frozenset())
    eng.set_speculation("off" if moved else "ngram")
    assert bool(eng.model.ops.one_row_tensor_cores) == moved


def test_a_verify_hands_each_gdn_layers_rows_to_the_op_at_once(plain35, qwen35_tiny_model):
    """Each GDN layer of a verify hands its T rows of every sequence to ops.gdn_exact_rows in one
    call ([T, B, ...], from the first row's positions, the model's tile: on the Triton op set
    gdn_exact_step.fused_rows, one launch); a stand-in that runs the op set's own records the
    calls, and the tokens stay plain decode's."""
    calls = []
    eng = engine_module.Engine(str(qwen35_tiny_model), speculation="oracle:0.7", speculative_tokens=3)
    per_rows = eng.model.ops.gdn_exact_rows

    def stand_in(q, k, v, g, beta, positions, state, rows, tile=None, ends=None):
        calls.append((tuple(v.shape[:2]), tuple(positions.shape), tile))
        return per_rows(q, k, v, g, beta, positions, state, rows, tile=tile, ends=ends)

    eng.model.ops.gdn_exact_rows = stand_in
    prompts = _prompts(2, 50, seed=8)
    assert list(eng.generate(prompts, 20)) == list(plain35.generate(prompts, 20))
    assert calls and {c[0] for c in calls} <= {(w + 1, 2) for w in range(1, 4)} and {c[1] for c in calls} == {(2,)}
    assert {c[2] for c in calls} == {eng.model.decode_tile}


# ---- the MTP head's draft vocabulary (a speculative token map) ---------------------------------
def _write_map(path, ids):
    path.write_text(__import__("json").dumps(ids))
    return str(path)


def test_a_token_map_keeps_the_heads_drafts_inside_it_and_the_plain_tokens(plain35, qwen35_tiny_model, tmp_path):
    """With a map the head's pick is the largest of the map's logits (the LM head's rows of its ids),
    every draft one of its ids, and the emitted tokens stay plain decode's."""
    ids = list(range(0, 1024, 3))                    # a third of the tiny vocabulary
    eng = engine_module.Engine(str(qwen35_tiny_model), speculation="mtp",
                               speculative_token_map=_write_map(tmp_path / "map.json", ids[::-1]))
    assert eng.model.draft_ids.tolist() == ids       # sorted on load
    with torch.inference_mode():
        h = torch.randn(5, eng.cfg.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
        logits = eng.model._logits(h)
        want = torch.tensor(ids)[logits[:, ids].argmax(dim=-1)]
        assert eng.model.mtp_picks(h).tolist() == want.tolist()
        assert not torch.equal(want, logits.argmax(dim=-1))       # the map changes some picks here
    prompts = _prompts(2, 58, seed=4)
    drafted = []
    draft = eng._drafter.draft
    eng._drafter.draft = lambda state: drafted.append(draft(state)) or drafted[-1]
    assert list(eng.generate(prompts, 24)) == list(plain35.generate(prompts, 24))
    assert drafted and set(torch.cat(drafted).flatten().tolist()) <= set(ids)


@pytest.mark.parametrize("content,message", [
    ("[3, 1024]", "token id 1024 outside the vocabulary \\[0, 1024\\)"),
    ("[-1, 2]", "token id -1 outside"),
    ("[5, 7, 5]", "token id 5 appears more than once"),
    ("[]", "no token ids"),
    ("[1.5]", "list of integer token ids"),
    ("[1, 2", "not valid JSON"),
    ('{"ids": [1]}', "list of integer token ids")])
def test_a_bad_token_map_is_an_error_naming_the_bad_value(tmp_path, content, message):
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        fq_spec.load_token_map(str(path), 1024)


def test_a_token_map_reads_sglangs_pt_form_and_refuses_other_files(tmp_path):
    torch.save(torch.tensor([9, 2, 4], dtype=torch.int32), tmp_path / "map.pt")
    assert fq_spec.load_token_map(str(tmp_path / "map.pt"), 10).tolist() == [2, 4, 9]
    torch.save([7, 3], tmp_path / "list.pt")
    assert fq_spec.load_token_map(str(tmp_path / "list.pt"), 10).tolist() == [3, 7]
    torch.save(torch.tensor([1.0, 2.0]), tmp_path / "float.pt")
    with pytest.raises(ValueError, match="1-D integer tensor"):
        fq_spec.load_token_map(str(tmp_path / "float.pt"), 10)
    (tmp_path / "map.txt").write_text("1 2 3")
    with pytest.raises(ValueError, match="expected a .pt or .json file"):
        fq_spec.load_token_map(str(tmp_path / "map.txt"), 10)
    with pytest.raises(ValueError, match="missing.pt: no such file"):
        fq_spec.load_token_map(str(tmp_path / "missing.pt"), 10)


def test_a_token_map_needs_the_mtp_head(tiny_model, qwen35_tiny_model, tmp_path, monkeypatch):
    """A map is the head's vocabulary: on Qwen3, or a Qwen3.5 engine that loads no head, it is an
    error naming the map; the environment variable sets it as the keyword does."""
    path = _write_map(tmp_path / "map.json", [1, 2, 3])
    with pytest.raises(ValueError, match="map.json.*no head"):
        engine_module.Engine(str(tiny_model), speculation="ngram", speculative_token_map=path)
    with pytest.raises(ValueError, match="map.json.*no head"):
        engine_module.Engine(str(qwen35_tiny_model), speculation="off", speculative_token_map=path)
    monkeypatch.setenv("FASTQWEN_SPECULATIVE_TOKEN_MAP", path)
    eng = engine_module.Engine(str(qwen35_tiny_model), speculation="mtp")
    assert eng.model.draft_ids.tolist() == [1, 2, 3]

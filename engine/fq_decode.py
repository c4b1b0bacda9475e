"""The decode loop's one owner of CUDA graphs.

A `DecodeRunner` holds the static input buffers of the decode step (tokens,
positions, lengths) for one batch size and cache capacity, and, on a GPU, the
CUDA graph of one whole step captured over them. A step reads its token and
position from device memory and writes the next ones back, so replays chain
with no host involvement; the host only copies each step's tokens out.

Rule: one graph per (batch, cache capacity), captured before the prefill of the
first generate of that shape (the warmup), never per sample. A call whose batch
matches and whose length fits reuses it.

A `LogitsStep` is the step continuous batching runs (fq_slots): the first rows of the
cache, each at its own position, logits out for the caller to sample from.

A `SpecRunner` holds speculative decoding's steps (fq_spec) of one (batch, k): a draft, a verify
with its acceptance and bookkeeping, and a plain step, each a graph over the same device state.

A `PrefillGraph` does the same for the prefill of one (batch, prompt length):
the first call of that shape runs eagerly and then captures; later calls copy
their ids into the static buffer and replay. It removes the host's per-kernel
launch cost (a few hundred launches) from the time to first token.
"""

import torch

from fq_spec import accept_rows, marks_ms, time_ms, timed_call


def _capture_step(step, pool=None) -> torch.cuda.CUDAGraph:
    """One call of `step` as a CUDA graph. Two warm-up calls on a side stream first: Triton
    compiles, cuBLAS picks its kernels and every cached workspace is allocated outside the
    graph's pool. pool: a memory pool shared with other graphs (torch.cuda.graph_pool_handle()),
    for graphs replayed one at a time on one stream whose outputs stay referenced: each reuses
    the others' temporaries, so the pool holds the largest one's, not their sum."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    torch.cuda.synchronize()
    return graph


class DecodeRunner:
    def __init__(self, model, batch: int, use_graph: bool):
        dev = model.device
        self.model = model
        self.batch = batch
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        # positions and lengths (= positions + 1) are two rows of one buffer: one add advances both.
        self._pos_len = torch.zeros((2, batch), dtype=torch.int32, device=dev)
        self.positions, self.lengths = self._pos_len[0], self._pos_len[1]
        self.lengths.fill_(1)
        self.graph = None
        if use_graph:
            self._capture()

    def _step(self) -> None:
        # The step's argmax writes the next tokens over the ones it read (the embedding
        # lookup that reads them is the step's first kernel), then both counters advance.
        self.model.decode(self.tokens, self.positions, self.lengths, out=self.tokens)
        self._pos_len.add_(1)

    def _capture(self) -> None:
        # The K/V the warm-up steps write at positions 0-1 is garbage that the prefill
        # which follows overwrites.
        self.graph = _capture_step(self._step)

    def start(self, first_tokens: torch.Tensor, position: int) -> None:
        """Point the step at the token after the prompt: position = prompt length."""
        self.tokens.copy_(first_tokens)
        self.positions.fill_(position)
        self.lengths.fill_(position + 1)

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()


class PrefillGraph:
    """The prefill of one (batch, prompt length) over a static ids buffer, as one CUDA graph.

    Capture only after an eager prefill of the same shape (Triton compiled, cuBLAS
    warmed, GEMV workspaces allocated). The graph writes the model's current KV
    cache and reads its RoPE tables: drop it whenever either is reallocated.
    """

    def __init__(self, model, batch: int, prompt: int):
        self.model = model
        self.ids = torch.zeros((batch, prompt), dtype=torch.int64, device=model.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.first = model.prefill(self.ids)
        # the model's final-normed states of the pass, where it keeps them (an MTP head reads them)
        self.hidden = getattr(model, "hidden", None)

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        """First generated tokens [B] (a static buffer: copy before the next run)."""
        self.ids.copy_(ids, non_blocking=True)
        self.graph.replay()
        if self.hidden is not None:
            self.model.hidden = self.hidden
        return self.first


class ChunkGraph:
    """One chunk of a prompt prefilled in chunks (fq_slots' staging row), `length` positions from
    `start`, over a static ids buffer, as one CUDA graph: prefill_logits(ids, row, start), the
    last position's logits in a static buffer (copy before the next run). cut (Qwen3.5): the
    pass also keeps its GDN states after start + cut positions as a snapshot, whose index each
    run names (a static index buffer). Capture only after an eager pass of the same shape; it
    reads the row's caches and block table where they are. use_graph False: the same buffers,
    each run an eager pass (the CPU tests of the plumbing)."""

    def __init__(self, model, row: int, length: int, start: int, pool=None, cut: int | None = None,
                 use_graph: bool = True):
        self.model, self.row, self.start = model, row, start
        self.ids = torch.zeros((1, length), dtype=torch.int64, device=model.device)
        self.index = None if cut is None else torch.zeros(1, dtype=torch.int64, device=model.device)
        self.snapshot = None if cut is None else (start + cut, self.index)
        self.graph = None
        if use_graph:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self._pass()

    def _pass(self) -> None:
        self.logits = self.model.prefill_logits(self.ids, row=self.row, start=self.start, snapshot=self.snapshot)

    def run(self, ids: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """The chunk's pass on ids [1, length]; index: the snapshot's (a graph captured with cut)."""
        if (index is None) != (self.index is None):
            raise ValueError(f"ChunkGraph.run: a snapshot index {index!r} for a graph "
                             f"{'with' if self.index is not None else 'without'} a snapshot")
        self.ids.copy_(ids, non_blocking=True)
        if index is not None:
            self.index.fill_(index)
        if self.graph is None:
            self._pass()
        else:
            self.graph.replay()
        return self.logits


class LogitsStep:
    """One decode step of the first `rows` cache rows that returns logits (fq_slots: the caller
    samples), over static buffers: tokens [rows] int64 and positions [rows] int32 written by
    the caller before each run (lengths = positions + 1), logits [rows, vocab] read after it.
    On a GPU the step is captured as a CUDA graph; capture it while no row holds a request
    (its warm-up steps write K/V and recurrent states in all `rows` rows)."""

    def __init__(self, model, rows: int, use_graph: bool):
        dev = model.device
        self.model, self.rows = model, rows
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._pos_len = torch.zeros((2, rows), dtype=torch.int32, device=dev)
        self.positions, self.lengths = self._pos_len[0], self._pos_len[1]
        self.logits = None
        self.graph = _capture_step(self._step) if use_graph else None

    def _step(self) -> None:
        torch.add(self.positions, 1, out=self.lengths)
        self.logits = self.model.decode_logits(self.tokens, self.positions, self.lengths)

    def run(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.logits


def verify_picks(model, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's argmax after each row's prefix in a verify of tokens [B, k + 1] at positions
    [B] .. + k (the model's verify_logits), [B, k + 1] int64. One sequence's rows through the LM
    screen where the model has one (each row's pick the one-row step's: the screen's refine is the
    one-row GEMV's sums), one int8 pass over the head for all of them."""
    B, T = tokens.shape
    screen = getattr(model, "screen", None)
    if B == 1 and screen is not None and T <= screen.ROWS_MAX:
        return screen.argmax_rows(model.verify_hidden(tokens, positions).contiguous()).view(B, T)
    logits = model.verify_logits(tokens, positions)
    return model.ops.argmax(logits.view(-1, logits.shape[-1])).view(tokens.shape)


class VerifyStep:
    """A speculative verify of the first `rows` cache rows (fq_slots: continuous batching), each at
    its own position, over static buffers: tokens [rows, k + 1] int64 (a row's last token, then its
    k drafts) and positions [rows] int32 written by the caller, picks [rows, k + 1] (the target's
    argmax after each row's prefix) read after run(). The rows are launched as the rows-row decode
    step (verify_logits), so each is that step's bits. On a GPU a CUDA graph, captured (like
    LogitsStep) while no row holds a request."""

    def __init__(self, model, rows: int, k: int, use_graph: bool, pool=None):
        dev = model.device
        self.model, self.rows, self.k = model, rows, k
        self.tokens = torch.zeros((rows, k + 1), dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.picks = None
        self.graph = _capture_step(self._step, pool) if use_graph else None

    def _step(self) -> None:
        self.picks = verify_picks(self.model, self.tokens, self.positions)

    def run(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.picks


class SpecRunner:
    """Speculative decoding's steps over one SpecState (fq_spec) of `batch` sequences and k drafts:
    a draft (the drafter's k, into a static [batch, k] buffer), a verify of w drafts for each w in
    `widths` (the last token and the first w drafts as w + 1 decode rows of the model's
    verify_logits, the target's picks, their acceptance, the tokens emitted into the state, the
    model's rollback of rejected rows, the drafter's update) and a plain step (one decode row a
    sequence, its pick emitted: speculation "auto" between verifies). On a GPU each is one CUDA
    graph, captured before the prompt pass that its warm-up rows' cache writes would corrupt, and
    each is timed there at `context` positions (costs: draft_ms, verify{w}_ms, plain_ms: what the
    auto policy weighs; a step's attention grows with its context, not with what the cache holds,
    and with no room to emit, the warm-up and timed steps leave the state where it was). After a
    step the host reads picks [batch, w + 1] and emit [batch]: the tokens each sequence emitted are
    picks[b, :emit[b]]; last_marks then holds that step's timing marks (marks_ms reads them)."""

    def __init__(self, model, drafter, state, use_graph: bool, plain: bool = False, widths: tuple | None = None,
                 context: int = 0):
        self.model, self.drafter, self.state = model, drafter, state
        self.batch, self.k = state.batch, state.k
        self.widths = tuple(widths) if widths else (self.k,)
        if not all(1 <= w <= self.k for w in self.widths):
            raise ValueError(f"SpecRunner: verify widths {self.widths} must lie in 1..{self.k}")
        drafter.prepare(state)
        self.drafts = torch.zeros((self.batch, self.k), dtype=torch.int64, device=state.device)
        self.picks = {w: None for w in self.widths}
        self.emit = {w: None for w in self.widths}
        # a plain step's inputs, pick and (pick, emitted) for the host: static buffers of its graph
        self.plain_tok = torch.zeros(self.batch, dtype=torch.int64, device=state.device)
        self.plain_pos_len = torch.zeros((2, self.batch), dtype=torch.int32, device=state.device)
        self.plain_pick = torch.zeros(self.batch, dtype=torch.int64, device=state.device)
        self.plain_packed = torch.zeros((self.batch, 2), dtype=torch.int64, device=state.device)
        self.last_marks = []
        if not 0 <= context < state.capacity:
            raise ValueError(f"SpecRunner: context {context} outside its state's capacity {state.capacity}")
        state.length.fill_(context + 1)
        state.limit.fill_(context + 1)
        self._steps = {"draft": self._draft,
                       **{f"verify{w}": (lambda w=w: self._verify(w)) for w in self.widths},
                       **({"plain": self._plain} if plain else {})}
        # one pool for all: a verify's temporaries (Qwen3.5's rollback copies ~48 MB of recurrent
        # state a sequence) are held once, not once a width
        pool = torch.cuda.graph_pool_handle() if use_graph else None
        self.graphs = {name: _capture_step(fn, pool) if use_graph else None for name, fn in self._steps.items()}
        self.costs = {f"{name}_ms": time_ms(lambda n=name: self._run(n), state.device) for name in self._steps}

    def _draft(self) -> None:
        self.drafts.copy_(self.drafter.draft(self.state))

    def _verify(self, width: int) -> None:
        state, model = self.state, self.model
        drafts = self.drafts[:, :width]
        rows = torch.cat([state.last().view(-1, 1), drafts], dim=1)
        positions = state.positions()
        picks = self.picks[width] = verify_picks(model, rows, positions)
        room = torch.minimum(state.limit - state.length, model.verify_keep(positions, width + 1))
        _, emit = accept_rows(drafts, picks, room)
        self.emit[width] = emit
        state.append(picks, emit)
        model.commit_verify(positions, emit)
        self.drafter.observe(state, rows, picks, emit)

    def _plain(self) -> None:
        # state.last(), positions() and append() as one launch each (fqkernels.spec_plain): the step
        # between verifies costs about what DecodeRunner's does
        state, ops = self.state, self.model.ops
        ops.spec_plain_inputs(state.seq, state.length, self.plain_tok, self.plain_pos_len)
        self.model.decode(self.plain_tok, self.plain_pos_len[0], self.plain_pos_len[1], out=self.plain_pick)
        ops.spec_plain_advance(self.plain_pick, state.seq, state.length, state.limit, self.plain_packed)

    def _run(self, name: str) -> None:
        graph = self.graphs[name]
        if graph is not None:
            graph.replay()
        else:
            self._steps[name]()

    def run_eager(self, name: str) -> None:
        """Step `name` ("draft", "verify{w}", "plain") with its ops launched one by one, not as its
        graph: what a profiler attributes kernel by kernel (bench spec --profile)."""
        if name not in self._steps:
            raise ValueError(f"SpecRunner: no step {name!r} (its steps: {', '.join(self._steps)})")
        self._steps[name]()

    def verify(self, width: int | None = None) -> tuple:
        """A draft and a verify of `width` drafts (one of widths; None: k); returns the device's
        (picks [B, width + 1], emit [B])."""
        width = self.k if width is None else width
        if width not in self.picks:
            raise ValueError(f"SpecRunner: no verify of {width} drafts (its widths: {self.widths})")
        self.last_marks = [self._timed("draft"), self._timed(f"verify{width}")]
        return self.picks[width], self.emit[width]

    def plain(self) -> torch.Tensor:
        """One plain decode step; returns the device's [B, 2]: each sequence's pick and whether it
        emitted it (1, or 0 past its limit)."""
        self.last_marks = [self._timed("plain")]
        return self.plain_packed

    def start_timing(self) -> None:
        """Time each step from here on (times_ms() reads them after the device has finished)."""
        self._marks = {name: [] for name in self.graphs}

    def _timed(self, name: str):
        """Run step `name`; timing on, its mark (fq_spec.timed_call's)."""
        marks = getattr(self, "_marks", None)
        if marks is None:
            self._run(name)
            return None
        _, mark = timed_call(lambda: self._run(name), self.state.device)
        marks[name].append(mark)
        return mark

    def times_ms(self) -> dict:
        """Since start_timing, the mean device milliseconds of a draft, a verify (any width) and a
        plain step (draft_ms, verify_ms, plain_ms; None where none ran) and of a verify of each
        width that ran (verify_ms_by_width), then timing off. Call after the device has finished
        those steps."""
        marks, self._marks = getattr(self, "_marks", None) or {}, None
        ms = {name: [marks_ms([m]) for m in got] for name, got in marks.items()}

        def mean(xs):
            return sum(xs) / len(xs) if xs else None

        verifies = [m for w in self.widths for m in ms.get(f"verify{w}", [])]
        return {"draft_ms": mean(ms.get("draft", [])), "verify_ms": mean(verifies),
                "plain_ms": mean(ms.get("plain", [])),
                "verify_ms_by_width": {w: mean(ms[f"verify{w}"]) for w in self.widths if ms.get(f"verify{w}")}}

"""Continuous batching: requests of their own prompt lengths join and leave between decode
steps (what a server needs; Engine.generate keeps its equal-length batches).

The row form keeps the model's own caches, max_slots rows of max_len positions, with the
running requests always in the first rows: admit() prefills a prompt into the next row
(admit_group() prompts of one length together, in one prompt pass);
retire() moves the last running request's row (its K/V and recurrent states) into the freed
one. step() runs one decode step of the first `bucket` rows, bucket the smallest of 1, 2, 4,
... max_slots that holds the running requests (a row past them runs token 0 at position 0 of
its own row, and its result is dropped), each row at its own position, and returns the
running requests' logits; the caller samples and passes each request's token back in the
next step(). step_rows() is the same step with the tokens already on the device, in row
order (a server's sampled tokens, never read back before the next step is queued: the
host's work on one step's tokens overlaps the next step on the GPU). On a GPU each bucket's
step is a CUDA graph (fq_decode.LogitsStep), captured when the slots open, before any request.
A row's arithmetic does not depend on the other rows' contents, so a request's greedy tokens
depend only on the bucket's row count.

Paged form (page_size): the attention caches are pools of pages of page_size positions and
each row has a block table (the model's allocate_paged_cache): a request takes the pages for
the positions it may hold (its prompt and the tokens it may generate: admit's `reserve`)
when it is admitted and gives them back when it retires, so short requests take little and
many fit where rows of max_len would not. A retired row's place is taken by the last row's
block table, not by a copy of its K/V. The decode kernels read the same K/V through the table
in the same order (the same bits as the row form; GPU tests). Every row not holding a request
points at a spare page no request gets, where a padding row of a step's bucket writes. The GDN
states of Qwen3.5 stay one row per request.

A prompt can also be prefilled in chunks between steps (begin(), then prefill_next() once per
step until it returns the logits): the chunks go into a staging row past the step's rows, which
no step touches, each chunk's queries seeing the positions before it (the models'
prefill_logits with start); the last chunk moves the request into the next running row (its
K/V and states, or its block table). So a long prompt joins without stalling the running
requests for its whole prompt pass. With graphs (a GPU), a prompt admitted alone (admit, a group
of one) goes the same way in one chunk, so its pass is a graph from its shape's second pass on
(a Qwen3.5 pass that keeps a state snapshot too, unless graph_snapshot_passes is off).
warm() runs a pass, its continuation and a pass of a few prompts together before the first
request, so their kernels compile then.

Shared prefixes (paged form, share_prefixes): each full page of an admitted prompt is kept
under the prompt's tokens up to its end; a later prompt starting with the same tokens takes
those pages (counted: a page is free again when no request holds it, and stays findable until
the pool needs it) and prefills only the rest, its queries seeing the shared positions
(prefill_logits with start). At least the last token is always prefilled (its logits start
the request). Qwen3's whole state is its K/V. Qwen3.5's GDN layers also need their conv and
recurrent states at the shared prefix's end: where the page size is a multiple of the
model's snapshot_granule (the rule's chunk, 64), a prompt's pass keeps a snapshot of them
(the pass has that state anyway) where it leaves a kept prefix it matches but cannot share
(no snapshot there yet: a system prompt the next request will share), else where its last
whole page before its last token ends (a repeat or a continuation of it), in a
small pool of state_snapshots (each one row's GDN states: ~52 MB on the 4B), the oldest
dropped first; a later prompt shares only a prefix that ends where a snapshot was taken,
its row's states put back from it before its rest is prefilled. A prompt prefilled in chunks
takes its snapshot where a chunk starts there or crosses it by whole rule chunks.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from fq_decode import ChunkGraph, LogitsStep, VerifyStep
from fq_spec import AutoPolicy, marks_ms, time_ms, timed_call


class SlotError(RuntimeError):
    """A slot request the current slots cannot take (no free row, a prompt too long, ...)."""


def buckets(max_slots: int) -> list[int]:
    """The step sizes: powers of two below max_slots, then max_slots."""
    out, b = [], 1
    while b < max_slots:
        out.append(b)
        b *= 2
    return out + [max_slots]


def default_pages(max_slots: int, max_len: int, page_size: int, num_pages: int | None = None) -> int:
    """A paged Slots' pool size: num_pages, or (None) max_slots rows' worth of pages."""
    return max_slots * (max_len // page_size) if num_pages is None else num_pages


def pages_for(positions: int, page_size: int) -> int:
    """Pages of page_size positions that hold `positions`."""
    return -(-positions // page_size)


# Qwen3.5's GDN state snapshots a paged Slots keeps for shared prefixes, unless told
DEFAULT_STATE_SNAPSHOTS = 8
# On a GPU a chunk of a prompt prefilled in chunks runs as a CUDA graph per (length, start, snapshot cut) from
# that shape's second pass on (the first runs eagerly: Triton compiles, cuBLAS warms up), for
# chunks of at most CHUNK_GRAPH_TOKENS; at most CHUNK_GRAPHS_KEPT graphs, the oldest dropped, all
# on one memory pool (never two replays at once). The eager pass at these sizes is launch-bound
# (a 256-token chunk's host time is several times its GPU work: docs/PERFORMANCE.md).
CHUNK_GRAPH_TOKENS = 2048
CHUNK_GRAPHS_KEPT = 8
# A Qwen3.5 pass that keeps a state snapshot (every prompt admitted with prefix sharing on) runs
# as a chunk graph too: it cut one stream's TTFT about 3.7x (docs/SERVING.md).
GRAPH_SNAPSHOT_PASSES = True


# Slots a server opens when it is not told, where the memory holds them (fit_rows, fit_pages)
DEFAULT_MAX_SLOTS = 64


def fit_rows(requested: int | None, row_bytes: int, budget_bytes: int | None, max_len: int) -> int:
    """Slots of `row_bytes` each: `requested`, checked against the budget (bytes left for them;
    None on the CPU: no limit), or with None the most that fit, at most DEFAULT_MAX_SLOTS (16 on
    the CPU). A request that cannot fit is an error naming both sizes."""
    if budget_bytes is None:
        return requested or 16
    fits = max(0, budget_bytes // row_bytes)
    if requested is None:
        if fits < 1:
            raise ValueError(f"no room for one slot of {max_len} tokens ({row_bytes / 2**30:.2f} GiB of KV "
                             f"cache): {max(budget_bytes, 0) / 2**30:.2f} GiB is left beside the weights")
        return min(DEFAULT_MAX_SLOTS, fits)
    if requested > fits:
        raise ValueError(f"{requested} slots of {max_len} tokens need {requested * row_bytes / 2**30:.1f} GiB of "
                         f"KV cache; {max(budget_bytes, 0) / 2**30:.1f} GiB is left beside the weights "
                         f"(room for {fits})")
    return requested


def fit_pages(page_size: int, requested: int | None, max_len: int, page_bytes: int, row_bytes: int,
              budget_bytes: int | None, snapshots: int = 0) -> tuple[int, int]:
    """(slots, KV pages) of the paged cache: `requested` slots (None: DEFAULT_MAX_SLOTS, 16 on the
    CPU), each holding `row_bytes` of its own (Qwen3.5's GDN states), `snapshots` more of those
    (Qwen3.5's state snapshots for shared prefixes), and as many pages of `page_size` positions as
    the budget holds beside them, at most every slot's max_len worth. Too little for one request
    of max_len positions is an error naming the sizes."""
    if page_size < 1 or max_len % page_size:
        raise ValueError(f"a context of {max_len} tokens must be a multiple of the page size {page_size}")
    per_request = max_len // page_size
    if budget_bytes is None:
        rows = requested or 16
        return rows, rows * per_request
    rows = requested or DEFAULT_MAX_SLOTS
    states = (rows + 1 + snapshots) * row_bytes    # the slots' rows, the staging row, the snapshots
    pages = min(rows * per_request, max(0, budget_bytes - states) // page_bytes)
    if pages < per_request:
        raise ValueError(f"{rows} slots and one request of {max_len} tokens need "
                         f"{(states + per_request * page_bytes) / 2**30:.2f} GiB of cache; "
                         f"{max(budget_bytes, 0) / 2**30:.2f} GiB is left beside the weights")
    return rows, pages


def state_snapshots_for(model, page_size: int | None, share_prefixes: bool, state_snapshots: int | None = None):
    """How many GDN state snapshots paged slots keep for shared prefixes (module doc): None for a
    model whose prefixes need none (Qwen3: its whole state is its K/V); 0 where none can serve
    (no pages, pages not a multiple of the model's snapshot_granule, sharing off); else
    state_snapshots (None: DEFAULT_STATE_SNAPSHOTS). A negative count is an error naming it."""
    granule = getattr(model, "snapshot_granule", None)
    if granule is None:
        return None
    if state_snapshots is not None and state_snapshots < 0:
        raise ValueError(f"Slots: state_snapshots must be >= 0, got {state_snapshots}")
    if not share_prefixes or page_size is None or page_size % granule:
        return 0
    return DEFAULT_STATE_SNAPSHOTS if state_snapshots is None else state_snapshots


class PagePool:
    """The paged cache's pages (module doc): free ones, and with sharing the full prompt pages kept
    under the prompt prefix they end, counted by the requests holding them; those no request
    holds are reused last (oldest first), their prefix forgotten then."""

    def __init__(self, num_pages: int, page_size: int, share: bool, snapshots: int | None = None):
        """snapshots: a model whose prefixes need a state snapshot at their end (Qwen3.5): how many
        are kept (a prefix is found only where one ends); None: prefixes need none (Qwen3)."""
        self.page_size, self.share = page_size, share
        self.snapshots = snapshots
        self._snap_free = list(range((snapshots or 0) - 1, -1, -1))
        self._snap_of: OrderedDict = OrderedDict()          # kept page -> its prefix's snapshot, oldest first
        self._free = list(range(num_pages - 1, -1, -1))     # holding nothing; popped from the end
        self._refs = [0] * num_pages
        self._prefix_of: dict[int, tuple] = {}               # page -> the prompt prefix it ends
        self._page_of: dict[tuple, int] = {}                 # prompt prefix (whole pages) -> page
        self._idle: OrderedDict = OrderedDict()              # kept pages no request holds, oldest first
        self.hit_tokens = 0                                  # prompt positions found in kept pages

    @property
    def free(self) -> int:
        return len(self._free) + len(self._idle)

    def take(self, n: int) -> list:
        """n pages for a request: free ones first, then the oldest kept ones (forgotten)."""
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._page_of[self._prefix_of.pop(page)]
                if page in self._snap_of:
                    self._snap_free.append(self._snap_of.pop(page))
            self._refs[page] = 1
            pages.append(page)
        return pages

    def lookup(self, prompt: list) -> list:
        """The kept pages of the prompt's longest kept prefix of whole pages, leaving at least its
        last token to prefill (with snapshots: the longest such prefix that ends at a snapshot,
        snapshot_of(its last page)); the request now holds them too."""
        if not self.share:
            return []
        found = []
        for i in range((len(prompt) - 1) // self.page_size):
            page = self._page_of.get(tuple(prompt[:(i + 1) * self.page_size]))
            if page is None:
                break
            found.append(page)
        if self.snapshots is not None:
            while found and found[-1] not in self._snap_of:
                found.pop()
            if found:
                self._snap_of.move_to_end(found[-1])        # the most recently used, dropped last
        for page in found:
            self._idle.pop(page, None)
            self._refs[page] += 1
        self.hit_tokens += len(found) * self.page_size
        return found

    def keep(self, prompt: list, pages: list) -> None:
        """The prompt's full pages (prefilled) kept under their prefixes, where none is yet."""
        if not self.share:
            return
        for i in range(len(prompt) // self.page_size):
            prefix = tuple(prompt[:(i + 1) * self.page_size])
            if prefix not in self._page_of and pages[i] not in self._prefix_of:
                self._page_of[prefix] = pages[i]
                self._prefix_of[pages[i]] = prefix

    def snapshot_of(self, page: int) -> int:
        """The snapshot kept for the prefix that page ends (lookup found it)."""
        return self._snap_of[page]

    def snapshot_point(self, prompt: list, shared: int) -> int:
        """Where a prompt sharing `shared` positions takes its snapshot (one a pass), or 0 for none
        (sharing off, no snapshots here, or nothing past the shared prefix): where it leaves the
        kept prefix it matches, if that lies past what it shares (a prefix two prompts have in
        common, e.g. a system prompt, with no snapshot yet: the next prompt with it shares it),
        else the end of its last whole page before its last token (what lookup would find of the
        same prompt, or of one that continues it)."""
        if not self.share or not self.snapshots:
            return 0
        matched = 0
        while (matched + self.page_size <= len(prompt) - 1
               and tuple(prompt[:matched + self.page_size]) in self._page_of):
            matched += self.page_size
        at = matched if matched > shared else (len(prompt) - 1) // self.page_size * self.page_size
        return at if at > shared else 0

    def new_snapshot(self) -> int | None:
        """A snapshot's index for a prompt's pass to fill: a free one, else the least recently used
        one (its prefix no longer found); None when every snapshot is being filled by a pass
        (more prompts at once than snapshots): that prompt takes none."""
        if self._snap_free:
            return self._snap_free.pop()
        if not self._snap_of:
            return None
        _, index = self._snap_of.popitem(last=False)
        return index

    def bind_snapshot(self, index: int, prompt: list, at: int) -> None:
        """After keep(): the snapshot a prompt's pass took at `at` becomes the snapshot of its
        prefix's kept page (the prompt's own, or the one another prompt keeps it on), unless that
        page has one already (then it is given back)."""
        page = self._page_of.get(tuple(prompt[:at]))
        if page is not None and page not in self._snap_of:
            self._snap_of[page] = index
        else:
            self._snap_free.append(index)

    def drop_snapshot(self, index: int) -> None:
        """A snapshot taken for a pass that failed, given back."""
        self._snap_free.append(index)

    def release(self, pages: list) -> None:
        """A request's pages given back: each one no request holds any more is free, or kept."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._prefix_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)


class Slots:
    def __init__(self, model, device: torch.device, max_slots: int, max_len: int, use_graphs: bool = False,
                 tune=None, page_size: int | None = None, num_pages: int | None = None, share_prefixes: bool = True,
                 state_snapshots: int | None = None, speculative_tokens: int = 0, verify_widths: tuple | None = None):
        """tune(rows): called once per bucket before its step is built (the engine's choice of
        products at that many rows). page_size: the paged form (module doc), max_len a multiple of
        it; num_pages: the pool's pages (None: max_slots rows' worth); share_prefixes: pages of a
        common prompt prefix shared (paged form, where the model allows: module doc);
        state_snapshots: how many GDN state snapshots a Qwen3.5 model keeps for it (None:
        DEFAULT_STATE_SNAPSHOTS; 0: its prefixes are not shared). speculative_tokens: k > 0 builds
        each bucket's verify of k drafts too (verify_rows), and of each of verify_widths' drafts
        where given (each in 1..k: the widths speculation "auto" chooses among)."""
        if max_slots < 1 or max_len < 2:
            raise ValueError(f"Slots: max_slots ({max_slots}) must be >= 1 and max_len ({max_len}) >= 2")
        if page_size is not None and (page_size < 1 or max_len % page_size):
            raise ValueError(f"Slots: page_size {page_size} must be >= 1 and divide max_len {max_len}")
        self.model, self.device = model, device
        self.max_slots, self.max_len = max_slots, max_len
        self.page_size = page_size
        model.ensure_rope(max_len)
        # row max_slots: the staging row of a prompt prefilled in chunks (begin), never in a step
        self.staging = max_slots
        if page_size is None:
            self.num_pages = 0
            model.allocate_cache(max_slots + 1, max_len)
        else:
            self.num_pages = default_pages(max_slots, max_len, page_size, num_pages)
            if self.num_pages < 1:
                raise ValueError(f"Slots: num_pages must be >= 1, got {num_pages}")
            # one page more, never handed out: every row not holding a request points at it, so the
            # padding rows of a step's bucket (token 0 at position 0, dropped) write there, never
            # into a page a request holds
            model.allocate_paged_cache(max_slots + 1, self.num_pages + 1, page_size, max_len)
            model.block_table.fill_(self.num_pages)
        snapshots = state_snapshots_for(model, page_size, share_prefixes, state_snapshots)
        share = (share_prefixes and page_size is not None and getattr(model, "prefix_sharing", False)
                 and snapshots != 0)
        self.pool = PagePool(self.num_pages, page_size or 1, share, snapshots if share else None)
        if share and snapshots:
            model.allocate_snapshots(snapshots)
        self.closed = False                       # Engine.generate() takes the caches back
        self.keys: list = []                      # the request in each running row, in row order
        self.lengths: list[int] = []              # positions cached per running row
        self.reserved: list[int] = []             # positions each running row may hold
        self.pages: list[list[int]] = []          # each running row's pages (paged form)
        self._staged = None                       # the request in the staging row: [key, prompt, reserve, pages, done]
        self._steps = {}
        self.use_graphs = use_graphs
        # a pass that keeps a Qwen3.5 state snapshot as a chunk graph too (GRAPH_SNAPSHOT_PASSES)
        self.graph_snapshot_passes = GRAPH_SNAPSHOT_PASSES
        self._chunk_graphs: OrderedDict = OrderedDict()   # (length, start, snapshot cut or None) -> ChunkGraph
        self._chunk_seen: set = set()                     # chunk shapes run once eagerly
        # how the last prompt pass ran: "group" (one eager pass of admit_group's prompts),
        # "eager", "capture" (its shape's graph captured, then run) or "graph" (a replay)
        self.last_pass: str | None = None
        self._chunk_pool = None
        # positions go to the device through two pinned buffers used in turn, each behind an
        # event, so a step is queued without waiting on the one before it
        pinned = device.type == "cuda"
        self._positions = [torch.zeros(max_slots, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._copied = [None, None]
        self._turn = 0
        self.k = speculative_tokens
        self.widths = tuple(sorted(set(verify_widths or ()) | {self.k})) if self.k else ()
        if any(not 1 <= w <= self.k for w in self.widths):
            raise ValueError(f"Slots: verify widths {verify_widths} must lie in 1..{self.k}")
        self._verifies = {}         # (bucket rows, drafts) -> VerifyStep
        # the verifies' graphs share one pool: it holds the largest one's temporaries (fq_decode._capture_step)
        verify_pool = torch.cuda.graph_pool_handle() if use_graphs and self.widths else None
        for rows in buckets(max_slots):
            if tune is not None:
                tune(rows)
            self._steps[rows] = LogitsStep(model, rows, use_graphs)
            for width in self.widths:
                self._verifies[rows, width] = VerifyStep(model, rows, width, use_graphs, pool=verify_pool)
        self._verified = None      # the last verify's (bucket rows, positions) until commit()
        self.verify_keep = []      # after verify_rows: the positions each running row may keep
        # timing on (speculation "auto"): each step's device time, read once its tokens are
        self.timing = False
        self.last_timing = None    # the last step's (bucket rows, drafts a row: 0 a plain step, mark)

    @property
    def running(self) -> tuple:
        """The running requests' keys in row order (the order of step_rows' tokens and logits)."""
        return tuple(self.keys)

    def stats(self) -> dict:
        """A server's counters: requests running, the KV cache in use (kv_usage), prompt positions
        found in shared pages so far, and how the last prompt pass ran ("group", "eager",
        "capture", "graph"; None before any)."""
        return {"running": len(self.keys), "kv_usage": self.kv_usage, "prefix_hit_tokens": self.pool.hit_tokens,
                "last_pass": self.last_pass}

    def warm(self, length: int = 128, group: int = 4) -> None:
        """Run what a server's first prompts would compile, before any arrives: a prompt pass of
        `length` tokens in the staging row (keeping a state snapshot halfway where the model keeps
        them), its continuation by as many (a prefix hit's rest, a later chunk), and a pass of
        `group` such prompts together in the first rows (admit_group's: kernels whose launch
        configuration follows the batch, e.g. the GDN state kernel's columns), eagerly. Nothing is
        kept: no pages for sharing, no snapshot, no graph; rows, pages and snapshots as before."""
        self._check_open()
        if self._staged is not None or self.keys:
            raise SlotError("warm(): only before any request is admitted")
        if 2 * length >= self.max_len:
            length = max(1, (self.max_len - 1) // 2)
        pages = self._take_pages(self.staging, 2 * length, [])[0]
        index = self.pool.new_snapshot() if self.pool.snapshots else None
        granule = getattr(self.model, "snapshot_granule", 0)
        cut = length // 2 // granule * granule if granule else 0
        ids = torch.zeros((1, length), dtype=torch.int64, device=self.device)
        try:
            with torch.inference_mode():
                self.model.prefill_logits(ids, row=self.staging,
                                          snapshot=(cut, [index]) if index is not None and cut else None)
                self.model.prefill_logits(ids, row=self.staging, start=length)
        finally:
            if index is not None:
                self.pool.drop_snapshot(index)
            self._give_back(self.staging, pages)
        group = min(group, self.max_slots)
        if group < 2:
            return
        taken = []
        try:
            for row in range(group):
                taken.append(self._take_pages(row, length, [])[0])
            with torch.inference_mode():
                self.model.prefill_logits(ids.expand(group, length), row=0)
        finally:
            for row in reversed(range(len(taken))):     # the pool's free list as it was
                self._give_back(row, taken[row])

    @property
    def free(self) -> int:
        """Rows free for requests (a request being prefilled in chunks holds the row it will take)."""
        return self.max_slots - len(self.keys) - (self._staged is not None)

    @property
    def staged(self):
        """The key of the request being prefilled in chunks, or None."""
        return None if self._staged is None else self._staged[0]

    @property
    def free_pages(self) -> int:
        return self.pool.free

    def fits(self, reserves: list) -> bool:
        """Whether requests that may hold these many positions each can be admitted now (free rows,
        and in the paged form free pages)."""
        if len(reserves) > self.free:
            return False
        if self.page_size is None:
            return True
        return sum(pages_for(min(r, self.max_len), self.page_size) for r in reserves) <= self.free_pages

    @property
    def kv_usage(self) -> float:
        """The KV cache in use: pages taken over the pool's (paged form), else cached positions over
        all rows' positions."""
        if self.page_size is not None:
            return 1.0 - self.free_pages / self.num_pages
        return sum(self.lengths) / (self.max_slots * self.max_len)

    def _check_open(self) -> None:
        if self.closed:
            raise SlotError("the engine's caches were taken back (a generate() call): open new slots")

    def admit(self, key, prompt: list[int], reserve: int | None = None) -> torch.Tensor:
        """Prefill `prompt` for request `key` into the next free row; returns the last
        position's logits [vocab]. reserve: as admit_group's."""
        return self.admit_group([key], [prompt], None if reserve is None else [reserve])[0]

    def admit_group(self, keys: list, prompts: list, reserve: list | None = None,
                    all_positions: bool = False) -> torch.Tensor:
        """Prefill prompts of one length together (one prompt pass, as Engine.generate's) into
        the next free rows; returns their last positions' logits [len(keys), vocab]. reserve:
        the positions each request may hold, prompt included (None: max_len each; more than
        max_len counts as max_len); room() counts against it, and in the paged form the
        request takes the pages for it now. all_positions: the logits of every prompt position,
        [len(keys), length, vocab] (a prompt's own log-likelihood); the pass is then one eager pass
        over the whole prompts (nothing shared, no snapshot)."""
        reserve = self._check_new(keys, prompts, reserve)
        if self.use_graphs and len(keys) == 1 and self._staged is None and not all_positions:
            # One prompt with graphs (a GPU): through the staging row as one chunk of all its rest
            # after its shared prefix (begin, prefill_next), so its pass is that (length, start)'s
            # ChunkGraph from the shape's second pass on (_chunk_pass), a prefix hit's rest too;
            # the eager pass below is launch-bound at these sizes (a 512-token prompt took about twice
            # the graph's TTFT, a prefix hit's rest longer than a whole prompt: docs/PERFORMANCE.md).
            self.begin(keys[0], prompts[0], reserve[0])
            try:
                logits = self.prefill_next(len(prompts[0]))
            except Exception:
                self.retire(keys[0])                 # nothing held, as the pass below on failure
                raise
            return logits[None]
        length = len(prompts[0])
        row = len(self.keys)
        taken = [self._take_pages(row + j, r, p, share=not all_positions) for j, (r, p) in enumerate(zip(reserve, prompts))]
        pages = [t[0] for t in taken]
        ids = torch.tensor(prompts, dtype=torch.int64, device=self.device)
        # where each prompt's pass keeps a state snapshot (Qwen3.5; 0: none), taken after every
        # shared prefix's snapshot is back in its row (_take_pages: a new one may reuse an old one's room)
        points = [0 if all_positions else self.pool.snapshot_point(prompt, start)
                  for prompt, (_, start) in zip(prompts, taken)]
        if len(set(points)) > 1 and not any(t[1] for t in taken):
            # one pass takes one position's snapshots: where the prompts' (one length) last whole
            # pages end, for all of them
            points = [(length - 1) // self.page_size * self.page_size] * len(prompts)
        snaps = [self.pool.new_snapshot() if at else None for at in points]
        if any(at and index is None for at, index in zip(points, snaps)):
            # fewer snapshots to fill than prompts: one pass over all of them takes none, one pass
            # each takes those it got
            if not any(t[1] for t in taken):
                for index in snaps:
                    if index is not None:
                        self.pool.drop_snapshot(index)
                snaps = [None] * len(snaps)
            points = [at if index is not None else 0 for at, index in zip(points, snaps)]
        self.last_pass = "group"
        try:
            with torch.inference_mode():
                if not any(t[1] for t in taken):     # nothing shared: one prompt pass (one length: one point)
                    logits = self.model.prefill_logits(ids, row=row, snapshot=(points[0], snaps) if points[0] else None,
                                                       all_positions=all_positions)
                else:                                # each prompt's rest after its shared prefix
                    logits = torch.cat([self.model.prefill_logits(
                        ids[j:j + 1, start:], row=row + j, start=start,
                        snapshot=(points[j], [snaps[j]]) if points[j] else None) for j, (_, start) in enumerate(taken)])
        except Exception:
            for j, p in enumerate(pages):
                self._give_back(row + j, p)
            for index in snaps:
                if index is not None:
                    self.pool.drop_snapshot(index)
            raise
        for prompt, p, at, index in zip(prompts, pages, points, snaps):
            self.pool.keep(prompt, p)
            if at:
                self.pool.bind_snapshot(index, prompt, at)
        self.keys += list(keys)
        self.lengths += [length] * len(keys)
        self.reserved += reserve
        self.pages += pages
        return logits

    def _check_new(self, keys: list, prompts: list, reserve: list | None) -> list:
        """admit_group's and begin's checks; returns the reserves (positions each may hold)."""
        self._check_open()
        if not keys or len(keys) != len(prompts):
            raise SlotError(f"admit_group: {len(keys)} keys for {len(prompts)} prompts")
        clash = [k for k in keys if k in self.keys or k == self.staged] or [k for i, k in enumerate(keys)
                                                                           if k in keys[:i]]
        if clash:
            raise SlotError(f"request {clash[0]!r} is already running")
        length = len(prompts[0])
        if length == 0:
            raise SlotError("a prompt needs at least one token")
        if any(len(p) != length for p in prompts):
            raise SlotError(f"admit_group takes prompts of one length, got {sorted({len(p) for p in prompts})}")
        if length >= self.max_len:
            raise SlotError(f"a prompt of {length} tokens leaves no room to generate within max_len {self.max_len}")
        if len(keys) > self.free:
            raise SlotError(f"all {self.max_slots} slots are running" if not self.free else
                            f"{len(keys)} requests for {self.free} free slots")
        reserve = [self.max_len] * len(keys) if reserve is None else [min(int(r), self.max_len) for r in reserve]
        if len(reserve) != len(keys) or any(r <= length for r in reserve):
            raise SlotError(f"admit_group: reserve {reserve} must give each of the {len(keys)} requests more than "
                            f"its {length} prompt positions")
        if not self.fits(reserve):
            need = sum(pages_for(r, self.page_size) for r in reserve)
            raise SlotError(f"{need} KV pages needed for {len(keys)} request(s), {self.free_pages} free")
        return reserve

    def _take_pages(self, row: int, reserve: int, prompt: list, share: bool = True) -> tuple:
        """The pages for `reserve` positions, into row's block table (paged form; else none): the
        kept pages of the prompt's shared prefix first (unless not `share`), and with snapshots the
        prefix's GDN states put into the row. Returns (pages, prompt positions shared)."""
        if self.page_size is None:
            return [], 0
        shared = self.pool.lookup(prompt) if share else []
        if shared and self.pool.snapshots:
            with torch.inference_mode():
                self.model.load_snapshot(self.pool.snapshot_of(shared[-1]), row)
        pages = shared + self.pool.take(pages_for(reserve, self.page_size) - len(shared))
        self.model.block_table[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return pages, len(shared) * self.page_size

    def _give_back(self, row: int, pages: list) -> None:
        """Pages back to the pool, and the row's block table back to the spare page."""
        self.pool.release(pages)
        if self.page_size is not None:
            self.model.block_table[row].fill_(self.num_pages)

    def begin(self, key, prompt: list, reserve: int | None = None) -> None:
        """Start prefilling `prompt` in chunks for request `key` in the staging row (one request at a
        time): it takes its pages (paged form) and counts against the free rows now; each
        prefill_next() call then prefills the next chunk. reserve: as admit_group's."""
        if self._staged is not None:
            raise SlotError(f"request {self.staged!r} is being prefilled in chunks: one at a time")
        reserve = self._check_new([key], [prompt], None if reserve is None else [reserve])[0]
        pages, shared = self._take_pages(self.staging, reserve, prompt)
        at = self.pool.snapshot_point(prompt, shared)
        # [key, prompt, reserve, pages, positions done, snapshot point, its index (None: none taken)]
        self._staged = [key, list(prompt), reserve, pages, shared, at, self.pool.new_snapshot() if at else None]

    def prefill_next(self, tokens: int) -> torch.Tensor | None:
        """Prefill the staged prompt's next `tokens` positions (at most). While positions remain,
        returns None; after the last chunk the request runs in the next row (as admit's would) and
        its last position's logits [vocab] are returned."""
        self._check_open()
        if self._staged is None:
            raise SlotError("prefill_next(): no request is being prefilled (begin() first)")
        if tokens < 1:
            raise SlotError(f"prefill_next(): tokens must be >= 1, got {tokens}")
        key, prompt, reserve, pages, done, at, index = self._staged
        stop = min(len(prompt), done + tokens)
        ids = torch.tensor([prompt[done:stop]], dtype=torch.int64, device=self.device)
        snapshot = None
        if index is not None and done <= at < stop:     # the snapshot point is in this chunk or at its start
            if at == done:
                with torch.inference_mode():
                    self.model.save_snapshot(self.staging, index)
            elif (at - done) % self.model.snapshot_granule == 0:
                snapshot = (at, [index])
            else:                                      # not at one of this pass's rule chunks: none taken
                self.pool.drop_snapshot(index)
                self._staged[6] = index = None
        with torch.inference_mode():
            logits = self._chunk_pass(ids, done, snapshot)
        self._staged[4] = stop
        if stop < len(prompt):
            return None
        row = len(self.keys)
        self.pool.keep(prompt, pages)
        if index is not None:
            self.pool.bind_snapshot(index, prompt, at)
        with torch.inference_mode():
            self.model.copy_row(self.staging, row, len(prompt))
        if self.page_size is not None:
            self.model.block_table[self.staging].fill_(self.num_pages)
        self._staged = None
        self.keys.append(key)
        self.lengths.append(len(prompt))
        self.reserved.append(reserve)
        self.pages.append(pages)
        return logits[0]

    def _chunk_pass(self, ids: torch.Tensor, start: int, snapshot) -> torch.Tensor:
        """A chunk's pass in the staging row: its shape's graph where there is one (module
        constants), else eager. A snapshot's pass (Qwen3.5) eager unless graph_snapshot_passes;
        then a shape of its own, its cut (the snapshot's position past start) part of the graph
        and its index written before each run."""
        cut = None if snapshot is None else snapshot[0] - start
        shape = (ids.shape[1], start, cut)
        if (not self.use_graphs or ids.shape[1] > CHUNK_GRAPH_TOKENS
                or (snapshot is not None and not self.graph_snapshot_passes)):
            self.last_pass = "eager"
            return self.model.prefill_logits(ids, row=self.staging, start=start, snapshot=snapshot)
        graph = self._chunk_graphs.get(shape)
        self.last_pass = "graph"
        if graph is None:
            if shape not in self._chunk_seen:
                self._chunk_seen.add(shape)
                self.last_pass = "eager"
                return self.model.prefill_logits(ids, row=self.staging, start=start, snapshot=snapshot)
            if len(self._chunk_graphs) >= CHUNK_GRAPHS_KEPT:
                self._chunk_graphs.popitem(last=False)
            if self._chunk_pool is None:
                self._chunk_pool = torch.cuda.graph_pool_handle()
            graph = self._chunk_graphs[shape] = ChunkGraph(self.model, self.staging, ids.shape[1], start,
                                                           pool=self._chunk_pool, cut=cut)
            self.last_pass = "capture"
        self._chunk_graphs.move_to_end(shape)
        return graph.run(ids, None if snapshot is None else snapshot[1][0]).clone()

    def room(self, key) -> int:
        """Tokens the request can still take (step() appends one each time): its reserve (admit)
        less the positions it holds."""
        i = self.keys.index(key)
        return self.reserved[i] - self.lengths[i]

    def step(self, tokens: dict) -> dict:
        """One decode step: `tokens` maps every running request to its newest token (the one
        sampled from its last logits). Returns each request's next logits [vocab]."""
        self._check_open()
        if set(tokens) != set(self.keys):
            raise SlotError(f"step() needs a token for exactly the running requests {self.keys}, "
                            f"got {sorted(tokens, key=str)}")
        ids = torch.tensor([int(tokens[k]) for k in self.keys], dtype=torch.int64, device=self.device)
        logits = self.step_rows(ids)
        return {k: logits[r] for r, k in enumerate(self.keys)}

    def step_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step with each running row's newest token in `tokens` (int64 [running],
        row order, on the device; the rows are self.keys' order). Returns the logits
        [running, vocab]: a view of the step's static buffer, valid until the next step.
        Nothing here waits on the GPU (on a GPU: the step is queued behind the work before it)."""
        self._check_open()
        n = len(self.keys)
        if tuple(tokens.shape) != (n,) or tokens.dtype != torch.int64:
            raise SlotError(f"step_rows() needs int64 tokens [{n}] (one per running request), got "
                            f"{tokens.dtype} {tuple(tokens.shape)}")
        if not n:
            raise SlotError("step_rows(): no request is running")
        full = [(k, r) for k, length, r in zip(self.keys, self.lengths, self.reserved) if length >= r]
        if full:
            raise SlotError(f"request {full[0][0]!r} is full ({full[0][1]} positions): retire it")
        step = self._steps[next(b for b in self._steps if b >= n)]
        step.tokens[:n].copy_(tokens, non_blocking=True)
        if step.rows > n:
            step.tokens[n:].zero_()
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()         # the copy two steps back has left this buffer
        positions = self._positions[turn]
        positions[:n] = torch.tensor(self.lengths, dtype=torch.int32)
        positions[n:step.rows] = 0
        step.positions.copy_(positions[:step.rows], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        with torch.inference_mode():
            logits = self._run(step, 0)
        self.lengths = [length + 1 for length in self.lengths]
        return logits[:n]

    def _run(self, step, width: int):
        """step.run(), timed (last_timing) while timing is on."""
        if not self.timing:
            return step.run()
        out, mark = timed_call(step.run, self.device)
        self.last_timing = (step.rows, width, mark)
        return out

    @staticmethod
    def timing_ms(timing) -> float | None:
        """A last_timing's milliseconds (None for none); its step must have finished on the device."""
        return None if timing is None else marks_ms([timing[2]])

    def auto_policy(self):
        """Speculation "auto" for these slots (fq_spec.AutoPolicy): each bucket's plain step and
        verifies timed now (before any request is admitted: the steps write the rows' caches);
        policy.next_width(running) says the next step of that many requests: a verify of that
        many drafts, or 0 for a plain step; the caller checks each plain step's would-be drafts on
        the host (policy.observe_shadow), so the policy spends no verify on finding out."""
        if not self.k:
            raise SlotError("auto_policy(): these slots were opened without speculative_tokens")
        if self.keys or self._staged is not None:
            raise SlotError("auto_policy(): only before any request is admitted")
        costs = {}
        with torch.inference_mode():
            for rows, step in self._steps.items():
                costs[rows] = (time_ms(step.run, self.device),
                               {w: time_ms(self._verifies[rows, w].run, self.device) for w in self.widths})
        return BucketPolicy(costs)

    def verify_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """A speculative verify of the running rows: tokens [running, w + 1] int64 on the device (each
        row's newest token, then its w drafts, w one of widths), row r's tokens at positions
        lengths[r] .. + w. Returns the target's picks [running, w + 1] (picks[r, j]: its argmax after
        tokens[r, :j + 1]); then commit(kept) before any other step. Row r may keep at most
        verify_keep[r] positions (set here: the model's verify_keep; a pick past them is
        meaningless). Each row needs room for w + 1 positions."""
        self._check_open()
        n = len(self.keys)
        if not self.k:
            raise SlotError("verify_rows(): these slots were opened without speculative_tokens")
        k = tokens.shape[1] - 1 if tokens.dim() == 2 else -1
        if tokens.dim() != 2 or tokens.shape[0] != n or k not in self.widths or tokens.dtype != torch.int64:
            raise SlotError(f"verify_rows() needs int64 tokens [{n}, w + 1] for w in {self.widths}, "
                            f"got {tokens.dtype} {tuple(tokens.shape)}")
        if not n:
            raise SlotError("verify_rows(): no request is running")
        short = [key for key, length, r in zip(self.keys, self.lengths, self.reserved) if length + k + 1 > r]
        if short:
            raise SlotError(f"request {short[0]!r} has no room for a verify of {k + 1} positions")
        step = self._verifies[next(b for b in self._steps if b >= n), k]
        step.tokens[:n].copy_(tokens)
        step.tokens[n:].zero_()
        positions = torch.zeros(step.rows, dtype=torch.int32)
        positions[:n] = torch.tensor(self.lengths, dtype=torch.int32)
        self.verify_keep = self.model.verify_keep(positions, k + 1)[:n].tolist()
        step.positions.copy_(positions)
        with torch.inference_mode():
            picks = self._run(step, k)
        self._verified = (step.rows, step.positions.clone(), k)
        return picks[:n]

    def commit(self, kept: list) -> None:
        """After verify_rows: running row r keeps its first kept[r] positions (1 .. w + 1: its newest
        token and the drafts accepted); the model puts back what the rest changed (Qwen3.5's
        conv and recurrent states)."""
        if self._verified is None:
            raise SlotError("commit(): no verify to commit")
        rows, positions, k = self._verified
        n = len(self.keys)
        if len(kept) != n or any(not 1 <= m <= most for m, most in zip(kept, self.verify_keep)):
            rule = (f" (row by row at most {self.verify_keep}: a row from a chunk's close on is not run)"
                    if min(self.verify_keep) <= k else "")
            raise SlotError(f"commit() needs 1..{k + 1} kept positions for each of {n} rows{rule}, got {kept}")
        self._verified = None
        counts = torch.zeros(rows, dtype=torch.int64)
        counts[:n] = torch.tensor(kept, dtype=torch.int64)
        with torch.inference_mode():
            self.model.commit_verify(positions, counts.to(self.device))
        self.lengths = [length + m for length, m in zip(self.lengths, kept)]

    def retire(self, key) -> tuple | None:
        """Free a request's row (finished or cancelled); the last running row moves into it.
        Returns (last, row) when a row moved (a caller's own per-row buffers move likewise),
        else None."""
        if key is not None and key == self.staged:          # a request cancelled while being prefilled
            self._give_back(self.staging, self._staged[3])
            if self._staged[6] is not None:
                self.pool.drop_snapshot(self._staged[6])
            self._staged = None
            return None
        if key not in self.keys:
            return None
        row, last = self.keys.index(key), len(self.keys) - 1
        self.pool.release(self.pages[row])
        moved = None
        if row != last:
            with torch.inference_mode():
                self.model.copy_row(last, row, self.lengths[last])
            for held in (self.keys, self.lengths, self.reserved, self.pages):
                held[row] = held[last]
            moved = (last, row)
        for held in (self.keys, self.lengths, self.reserved, self.pages):
            held.pop()
        if self.page_size is not None:      # the vacated row back to the spare page (see __init__)
            self.model.block_table[last].fill_(self.num_pages)
        return moved


class BucketPolicy:
    """fq_spec.AutoPolicy with each bucket's costs: {rows: (plain ms, {drafts: verify ms})}; one
    running acceptance over all."""

    def __init__(self, costs: dict):
        self.costs = {rows: (plain, dict(verify)) for rows, (plain, verify) in sorted(costs.items())}
        plain, verify = self.costs[min(self.costs)]
        self.policy = AutoPolicy(verify, plain)
        self._bucket = min(self.costs)

    def next_width(self, running: int) -> int:
        """The next step of `running` requests: a verify of that many drafts, 0 a plain step."""
        bucket = next(b for b in self.costs if b >= running)
        if bucket != self._bucket:
            plain, verify = self.costs[bucket]
            self.policy.set_costs(verify, plain)
            self._bucket = bucket
        return self.policy.next_width()

    def observe_verify(self, accepted: int, rejected: int) -> None:
        self.policy.observe_verify(accepted, rejected)

    def observe_shadow(self, right: int, wrong: int) -> None:
        self.policy.observe_shadow(right, wrong)

    def observe_cost(self, rows: int, width: int, ms: float | None, weight: float = 0.25) -> None:
        """A step of bucket `rows` measured `ms` (width 0: a plain step): that bucket's cost moves
        `weight` of the way there (the contexts the server runs at, not the startup's position 0)."""
        if ms is None or not ms > 0 or rows not in self.costs:
            return
        plain, verify = self.costs[rows]
        if width:
            verify[width] += weight * (ms - verify[width])
        else:
            plain += weight * (ms - plain)
        self.costs[rows] = (plain, verify)
        if rows == self._bucket:
            self.policy.set_costs(verify, plain)

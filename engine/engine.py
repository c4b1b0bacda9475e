"""fastqwen's engine: greedy generation for Qwen3 and Qwen3.5 checkpoints, every token what
native Transformers would pick on the same prefix (within the platform's 2.0-logit margin), as
fast as one GPU allows.

`Engine(model_path)` loads a Hugging Face-layout checkpoint (no Transformers involved) and
`generate(input_ids, max_new_tokens)` yields one list of token ids per step. The model family
comes from config.json (fq_config): Qwen3 (fq_qwen3) or the hybrid Qwen3.5 (fq_qwen35), each
written once over an op set (fq_ops): Triton kernels on a GPU, their torch references elsewhere.
On a GPU the decode step is one CUDA graph, replayed with the host one step behind (fq_decode).

Options (keyword arguments; the contract's Engine(model_path) takes the defaults, which a
deployment can change through the environment variable beside each):

  backend       "auto"  the op set: "triton" (kernels, CUDA) or "torch" (references, any
                        device); "auto" picks triton on a GPU          FASTQWEN_BACKEND=torch|triton
  graphs        True    the decode step and short prompts as CUDA graphs  FASTQWEN_NO_GRAPHS=1
  pdl           True    programmatic dependent launch between the decode step's kernels, where
                        Triton (3.4+) and the GPU have it; process-wide    FASTQWEN_NO_PDL=1
  exact_decode  True    decode steps in the full forward's arithmetic: Qwen3's products and
                        attention at 7-32 sequences, Qwen3.5's GDN rule at every batch (native's
                        noise; docs/NUMERICS.md). False: the faster recurrent GDN step and
                        cuBLAS where it is faster                         FASTQWEN_EXACT_DECODE=0
  speculation   "off"   exact speculative decoding (fq_spec): "auto" (prompt lookup: a verify
                        of the width among 1-4 .. k drafts that pays best at the running
                        acceptance and the costs measured at this batch size, else a plain
                        step), "ngram" (prompt lookup), "recycle" (token recycling),
                        "mtp" (Qwen3.5's multi-token-prediction head), "oracle:<a>"
                        (measurement: drafts from a recorded plain run, right with
                        probability a); the same tokens as "off" (Qwen3.5: with exact
                        decode)                                     FASTQWEN_SPECULATION=auto
  speculative_tokens 4  tokens drafted per verify (1-16)
  speculative_token_map  the MTP head's draft vocabulary: a .pt (1-D tensor of token ids, as
                None    SGLang's) or .json (list) file, e.g. `fastqwen token-map`'s most frequent
                        tokens of a corpus; the head then reads only those rows of the LM head
                        (drafts only: the tokens emitted are the same)
                                                  FASTQWEN_SPECULATIVE_TOKEN_MAP=PATH

An explicit keyword argument wins over the environment.
"""
import gc
import os
import time

import torch

from fq_config import Qwen35Config, config_for
from fq_decode import DecodeRunner, PrefillGraph, SpecRunner
from fq_ops import ops_for
from fq_qwen3 import Qwen3Model
from fq_qwen35 import Qwen35Model
from fq_spec import (AutoPolicy, OracleDrafter, PromptLookup, SpecState, SpecStats, load_token_map, make_drafter,
                     marks_ms, parse_speculation, verify_observed, verify_widths)
from fq_weights import load_qwen35_weights, load_weights
from fqkernels import pdl as _pdl

# Cache capacities are rounded up to this, so calls of nearby lengths share
# one cache and one graph.
CAPACITY_GRANULE = 256
# Steps the GPU may run ahead of the host: step t+1 is queued before step t's
# tokens are read, so the host's .tolist() and yield overlap the GPU's work.
LOOKAHEAD = 2
# Prefills of at most this many tokens (batch x prompt) run as a CUDA graph per
# shape after the first call of that shape; larger ones are GPU-bound anyway.
PREFILL_GRAPH_TOKENS = 8192
# Qwen3.5's prompt pass launches more kernels a layer and keeps bigger workspaces in the graph's
# pool: its graphs pay up to 2,048 tokens, not at 8,192 (docs/PERFORMANCE.md).
QWEN35_PREFILL_GRAPH_TOKENS = 2048
PREFILL_GRAPHS_KEPT = 4
# Memory a server's slots leave free beside the weights and caches (a prompt pass's activations,
# cuBLAS workspaces), when plan_slots sizes them on a GPU.
SLOT_HEADROOM_BYTES = 3 * 2**30


def _rounded_capacity(positions: int) -> int:
    """The cache capacity allocated for `positions` positions."""
    return -(-positions // CAPACITY_GRANULE) * CAPACITY_GRANULE


def _option(value, env: str, from_env, default):
    """A keyword option: its value when given, else the environment variable's reading, else the default."""
    if value is not None:
        return value
    raw = os.environ.get(env)
    return default if raw in (None, "") else from_env(raw)


class Engine:
    def __init__(self, model_path: str, *, backend: str | None = None, graphs: bool | None = None,
                 pdl: bool | None = None, exact_decode: bool | None = None, speculation: str | None = None,
                 speculative_tokens: int | None = None, speculative_token_map: str | None = None):
        backend = _option(backend, "FASTQWEN_BACKEND", str, "auto")
        token_map = _option(speculative_token_map, "FASTQWEN_SPECULATIVE_TOKEN_MAP", str, None)
        graphs = _option(graphs, "FASTQWEN_NO_GRAPHS", lambda v: v != "1", True)
        pdl = _option(pdl, "FASTQWEN_NO_PDL", lambda v: v != "1", True)
        exact_decode = _option(exact_decode, "FASTQWEN_EXACT_DECODE", lambda v: v != "0", True)
        self.cfg = config_for(model_path)
        self.spec = self._speculation(_option(speculation, "FASTQWEN_SPECULATION", str, "off"), speculative_tokens,
                                      exact_decode)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # The reference runs with TF32 off; bf16 products accumulate in fp32 in
        # our kernels, so ask cuBLAS for the same (no reduced-precision split-K).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        _pdl.set_enabled(pdl)
        ops = ops_for(backend, self.device, exact_decode)
        with torch.inference_mode():
            if isinstance(self.cfg, Qwen35Config):
                # the MTP head: the mtp drafter's, and the oracle's where the checkpoint has one (its cost)
                mtp = self.spec.mode == "mtp" or (self.spec.mode == "oracle" and self.cfg.mtp_layers > 0)
                weights = load_qwen35_weights(model_path, self.cfg, self.device, mtp=mtp)
                # a mode that verifies every step sets where one sequence's products run, for the
                # engine's life: set_speculation keeps it
                self.model = Qwen35Model(self.cfg, weights, self.device, ops, exact_decode=exact_decode,
                                         verifies=self.spec.every_step)
            else:
                weights = load_weights(model_path, self.cfg, self.device)
                self.model = Qwen3Model(self.cfg, weights, self.device, ops)
            if token_map is not None:
                if not getattr(self.model, "has_mtp", False):
                    raise ValueError(f"speculative_token_map {token_map!r}: the map is the multi-token-prediction "
                                     f"head's draft vocabulary; speculation {self.spec.mode!r} on this checkpoint "
                                     f"runs no head (it needs a Qwen3.5 checkpoint with mtp.* and speculation "
                                     f"'mtp', or 'oracle')")
                self.model.set_draft_tokens(load_token_map(token_map, int(self.cfg.vocab_size)))
        self.exact_decode = exact_decode
        # The Triton op set's decode step and prompt pass read nothing on the host: graph-safe.
        self.use_graphs = self.device.type == "cuda" and ops.name == "triton" and bool(graphs)
        self.use_prefill_graphs = self.use_graphs
        qwen35 = isinstance(self.model, Qwen35Model)
        self.prefill_graph_tokens = QWEN35_PREFILL_GRAPH_TOKENS if qwen35 else PREFILL_GRAPH_TOKENS
        self._runner = None
        self._spec = None         # the SpecRunner over the current cache, when speculating
        self._spec_mode = None    # the Speculation its drafter was made for
        self._spec_host = {}      # (rows, columns) -> [pinned buffers, next]: a step's picks on the host
        self._prefill_graphs = {}  # (batch, prompt) -> PrefillGraph over the current cache
        self._host = None
        self._slots = None  # the open fq_slots.Slots, if any (generate() closes it)
        self.tuning = {}  # batch -> {matrix: (cuBLAS us, GEMV us)}, measured at warmup
        self._drafter = make_drafter(self.spec, int(self.cfg.vocab_size), model=self.model) if self.spec.on else None
        self._spec_stats = SpecStats()

    def _speculation(self, value, k, exact_decode: bool):
        """The parsed speculation option, or a ValueError where this checkpoint cannot run it."""
        spec = parse_speculation(value, k)
        if spec.mode == "mtp" and not isinstance(self.cfg, Qwen35Config):
            raise ValueError("speculation 'mtp' needs a Qwen3.5 checkpoint with its multi-token-prediction head "
                             "(a Qwen3 model has none)")
        if spec.on and isinstance(self.cfg, Qwen35Config) and not exact_decode:
            raise ValueError(f"speculation {spec.mode!r} on a Qwen3.5 model needs exact_decode (its verify drops "
                             f"rejected rows from the GDN chunk's rows; the recurrent step cannot)")
        return spec

    def set_speculation(self, speculation: str, speculative_tokens: int | None = None) -> None:
        """Another speculation mode for this loaded engine, its weights, caches and tuning kept (a
        bench's arms then compare bit for bit). "mtp" only where the head was loaded (an engine
        built with speculation "mtp", or "oracle" on a checkpoint with a head). Where one sequence's
        products run stays as built (Qwen3.5: the tensor cores when built to verify every step).
        Back to the mode whose drafter the current speculative runner holds, its drafter and graphs
        are kept (a bench alternating "off" with a mode times no capture)."""
        spec = self._speculation(speculation, speculative_tokens, self.exact_decode)
        if spec.on and self._spec is not None and self._spec_mode == spec:
            self._drafter = self._spec.drafter
        else:
            self._drafter = make_drafter(spec, int(self.cfg.vocab_size), model=self.model) if spec.on else None
        self.spec = spec

    def describe(self) -> dict:
        """What runs: the model family, its op set, whether the decode step and prompts are graphs,
        exact decode, the LM-head screen, one sequence's products' kernel and (Qwen3.5) the GDN
        rule's forms."""
        qwen35 = isinstance(self.model, Qwen35Model)
        backend = self.model.ops.name
        out = {"family": "qwen3.5" if qwen35 else "qwen3", "backend": backend,
               "decode_graph": self.use_graphs, "prefill_graphs": self.use_prefill_graphs,
               "pdl": _pdl.ENABLED, "exact_decode": self.exact_decode,
               "speculation": self.spec.mode if not self.spec.on else f"{self.spec.mode} (k={self.spec.k})",
               # one sequence's LM head screened through its int8 copy (fqkernels/lm_screen)
               "lm_screen": self.model.screen is not None}
        if backend == "triton":       # one sequence's products: a verify's rows share their tile (fq_ops)
            out["one_row_products"] = self.one_row_products()
        if getattr(self.model, "draft_ids", None) is not None:   # the MTP head's draft vocabulary
            out["draft_tokens"] = int(self.model.draft_ids.numel())
        if qwen35:
            out["gdn_prompt_rule"] = "kernels" if backend == "triton" else "reference"
            out["gdn_decode"] = "recurrent"
            if self.model.exact_decode:
                from fqkernels import gdn_exact_step

                out["gdn_decode"] = ("full forward's rows" + (f" ({gdn_exact_step.step_form()})"
                                                              if backend == "triton" else ""))
        return out

    def one_row_products(self) -> str:
        """Where one sequence's products run: "tensor cores", "fma", or "tensor cores: " and the
        products there where only some are (the LM head, screened at one row, counts as neither)."""
        moved = self.model.ops.one_row_tensor_cores
        layer_products = [p for p in self.model.decode_products() if p.name != "lm_head"]
        names = [p.name for p in layer_products if tuple(p.weights[0].shape) in moved]
        if not names:
            return "fma"
        return "tensor cores" if len(names) == len(layer_products) else "tensor cores: " + ", ".join(names)

    # ---- serving: continuous batching over the engine's caches ------------------------
    def plan_slots(self, max_len: int, max_slots: int | None = None, page_size: int | None = None,
                   share_prefixes: bool = True, state_snapshots: int | None = None,
                   memory_fraction: float | None = None) -> dict:
        """How many slots (and, with page_size, KV pages) fit: max_slots requests of up to max_len
        positions (None: as many as fit, at most fq_slots.DEFAULT_MAX_SLOTS; 16 on the CPU) in the
        memory left beside the weights under memory_fraction of the device (None: all of it), less
        SLOT_HEADROOM_BYTES. Returns the keyword arguments of `slots` (max_slots, max_len,
        page_size, num_pages, share_prefixes, state_snapshots); a request that cannot fit is a
        ValueError naming the sizes (fq_slots.fit_rows, fit_pages)."""
        from fq_slots import fit_pages, fit_rows, state_snapshots_for

        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        budget = None
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            cap = total * (memory_fraction or 1.0)
            budget = int(cap - torch.cuda.memory_reserved(self.device) - SLOT_HEADROOM_BYTES)
        model = self.model
        plan = {"max_len": max_len, "page_size": page_size, "num_pages": None, "share_prefixes": share_prefixes,
                "state_snapshots": state_snapshots}
        if page_size is None:           # the slots' rows, and one more: the staging row of a chunked prefill
            row = model.cache_bytes(1, max_len)
            plan["max_slots"] = fit_rows(max_slots, row, None if budget is None else budget - row, max_len)
            return plan
        snapshots = state_snapshots_for(model, page_size, share_prefixes, state_snapshots) or 0
        plan["max_slots"], plan["num_pages"] = fit_pages(page_size, max_slots, max_len, model.page_bytes(page_size),
                                                         getattr(model, "row_bytes", lambda: 0)(), budget, snapshots)
        return plan

    def slots(self, max_slots: int, max_len: int, page_size: int | None = None, num_pages: int | None = None,
              share_prefixes: bool = True, state_snapshots: int | None = None, speculative_tokens: int | None = None):
        """Continuous batching for a server (fq_slots.Slots): max_slots rows of max_len positions
        in this engine's caches, or with page_size a pool of num_pages pages of page_size
        positions read through each row's block table (None: max_slots rows' worth; with
        share_prefixes the pages of common prompt prefixes shared where the model allows; a
        Qwen3.5 model keeps state_snapshots of its GDN states for it, None: fq_slots' default),
        each step size's graph captured now (and with speculative_tokens k > 0 its verify of k drafts,
        with speculation "auto" of each of verify_widths(k): None takes k from this engine's
        speculation, 0 where it is off). The caches and graphs
        generate() made are dropped (and generate() makes its own again when called). plan_slots
        sizes these arguments."""
        from fq_slots import Slots

        self._drop_graphs()
        self._close_slots()
        if page_size is None:
            self._check_memory(max_slots + 1, max_len)         # and the staging row (fq_slots)
        else:
            self._check_paged_memory(max_slots, max_len, page_size, num_pages, share_prefixes, state_snapshots)
        if speculative_tokens is None:
            speculative_tokens = self.spec.k if self.spec.on else 0
        self._slots = Slots(self.model, self.device, max_slots, max_len, self.use_graphs, self._tune,
                            page_size=page_size, num_pages=num_pages, share_prefixes=share_prefixes,
                            state_snapshots=state_snapshots, speculative_tokens=speculative_tokens,
                            verify_widths=(verify_widths(speculative_tokens)
                                           if self.spec.mode == "auto" and speculative_tokens else None))
        return self._slots

    def _check_paged_memory(self, rows: int, max_len: int, page_size: int, num_pages: int | None,
                            share_prefixes: bool = True, state_snapshots: int | None = None) -> None:
        """The paged cache's pools (and Qwen3.5's per-row GDN states) must fit: a clear error first."""
        if self.device.type != "cuda":
            return
        self.model.allocate_cache(1, 2)      # generate()'s cache, if any, goes first
        torch.cuda.empty_cache()
        from fq_slots import default_pages, state_snapshots_for

        pages = default_pages(rows, max_len, page_size, num_pages) + 1   # and the spare one
        # the rows' GDN states (Qwen3.5), the staging row's and the snapshots'
        states = rows + 1 + (state_snapshots_for(self.model, page_size, share_prefixes, state_snapshots) or 0)
        need = pages * self.model.page_bytes(page_size) + states * getattr(self.model, "row_bytes", lambda: 0)()
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > free:
            raise ValueError(f"{pages} KV pages of {page_size} positions for {rows} rows need {need / 2**30:.1f} GiB; "
                             f"{free / 2**30:.1f} GiB is available on the device")

    def _close_slots(self) -> None:
        if self._slots is not None:
            self._slots.closed = True
            self._slots = None
            self.model.allocate_cache(1, 2)     # generate() sizes its own: the slots' rows go

    # ---- input checks: every problem is reported before any GPU work ---------------
    def _check(self, input_ids, max_new_tokens) -> torch.Tensor:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not isinstance(input_ids, (list, tuple)) or len(input_ids) == 0:
            raise ValueError("input_ids must be a non-empty list of token-id lists")
        lengths = {len(seq) if isinstance(seq, (list, tuple)) else -1 for seq in input_ids}
        if -1 in lengths:
            raise ValueError("input_ids must be a list of lists of ints")
        if len(lengths) != 1:
            raise ValueError(f"all sequences must have the same length, got lengths {sorted(lengths)}")
        if 0 in lengths:
            raise ValueError("sequences must hold at least one token")
        try:
            ids = torch.tensor(input_ids, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"input_ids must hold only ints ({exc})") from None
        if any(type(t) is not int for seq in input_ids for t in seq):
            bad = next(t for seq in input_ids for t in seq if type(t) is not int)
            raise ValueError(f"input_ids must hold only ints, found {bad!r} ({type(bad).__name__})")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")
        total = ids.shape[1] + max_new_tokens
        if total > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt {ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds the "
                             f"model's max_position_embeddings {self.cfg.max_position_embeddings}")
        return ids

    def generate(self, input_ids, max_new_tokens):
        """Yield `max_new_tokens` lists of greedy token ids, one id per sequence, in order."""
        ids = self._check(input_ids, max_new_tokens)
        self._close_slots()
        if self.spec.on:
            self._check_memory(ids.shape[0], ids.shape[1] + max_new_tokens + 2 * self.spec.k)
            return self._generate_spec(ids, max_new_tokens)
        self._check_memory(ids.shape[0], ids.shape[1] + max_new_tokens - 1)
        self._spec_stats = SpecStats()          # a plain call's: nothing left from an earlier one
        return self._generate(ids, max_new_tokens)

    @staticmethod
    def prompt_lookup(tokens=()) -> PromptLookup:
        """Prompt lookup on the host over `tokens` (extend() them as they come, draft(k)): the twin
        of the device drafter that "ngram" and "auto" use, for a caller that drafts, or checks what
        would have been drafted, itself (the server's scheduler)."""
        return PromptLookup(tokens)

    def spec_stats(self) -> dict:
        """The last generate() call's speculation (fq_spec.SpecStats): drafted and accepted tokens,
        acceptance, verify passes, tokens per verify row, host seconds drafting / verifying /
        recording (the oracle's plain run). All zero with speculation off."""
        return self._spec_stats.as_dict()

    def _check_memory(self, batch: int, positions: int) -> None:
        """A KV cache that cannot fit is a clear error, not an out-of-memory crash mid-call."""
        if self.device.type != "cuda" or self.model.cache_fits(batch, positions):
            return
        capacity = _rounded_capacity(positions)
        need = self.model.cache_bytes(batch, capacity)
        held = 0 if self.model.k_cache is None else self.model.cache_bytes(*self.model.k_cache.shape[1:4:2])
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > free + held:
            raise ValueError(f"batch {batch} x {capacity} positions needs {need / 2**30:.1f} GiB of KV cache; "
                             f"{(free + held) / 2**30:.1f} GiB is available on the device")

    # ---- the loop -----------------------------------------------------------------
    def _prepare_cache(self, batch: int, capacity: int) -> None:
        model = self.model
        if model.ensure_rope(capacity):
            self._drop_graphs()
        if not model.cache_fits(batch, capacity):
            self._drop_graphs()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            model.allocate_cache(batch, _rounded_capacity(capacity))

    def _prepare(self, batch: int, capacity: int) -> DecodeRunner:
        self._prepare_cache(batch, capacity)
        model = self.model
        if self._runner is None:
            self._tune(batch)
            self._runner = DecodeRunner(model, batch, self.use_graphs)
        return self._runner

    def _tune(self, rows: int) -> None:
        """On a GPU, once per row count: our GEMV or cuBLAS for each decode product (ops.tune)."""
        if self.device.type == "cuda" and rows not in self.tuning:
            self.tuning[rows] = self.model.ops.tune(self.model.decode_products(), rows)

    def _drop_graphs(self) -> None:
        """Forget every captured graph: they point at the cache and RoPE tables being replaced."""
        self._runner = None
        self._spec = None
        self._prefill_graphs = {}

    def _prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """First generated tokens [B]: replayed from this shape's prefill graph when
        there is one; else eager, capturing a graph for the next call of the shape."""
        batch, prompt = ids.shape
        if not self.use_prefill_graphs or batch * prompt > self.prefill_graph_tokens:
            return self.model.prefill(ids)
        graph = self._prefill_graphs.get((batch, prompt))
        if graph is not None:
            return graph.run(ids)
        first = self.model.prefill(ids)
        if len(self._prefill_graphs) >= PREFILL_GRAPHS_KEPT:
            self._prefill_graphs.clear()
        # The eager prefill's activations go back to the device before the graph
        # takes its own pool, so the two never count at once against peak memory.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        hidden = getattr(self.model, "hidden", None)     # the eager pass's states (an MTP head reads them)
        self._prefill_graphs[(batch, prompt)] = PrefillGraph(self.model, batch, prompt)
        if hidden is not None:
            self.model.hidden = hidden       # not the capture's: its buffer holds nothing until a replay
        return first

    def _host_buffer(self, steps: int, batch: int) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < steps or self._host.shape[1] != batch:
            pin = self.device.type == "cuda"
            self._host = torch.empty((steps, batch), dtype=torch.int64, pin_memory=pin)
        return self._host

    def _generate(self, ids: torch.Tensor, steps: int):
        batch, prompt = ids.shape
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a collection in the middle of the stream is a latency spike
        try:
            with torch.inference_mode():
                # positions [0, prompt + steps - 1) are written; the last token never is
                runner = self._prepare(batch, prompt + steps - 1)
            if self.device.type != "cuda":
                yield from self._generate_eager(runner, ids, steps)
                return
            with torch.inference_mode():
                host = self._host_buffer(steps, batch)
                events = [torch.cuda.Event() for _ in range(steps)]
                first = self._prefill(ids.to(self.device, non_blocking=True))
                runner.start(first, prompt)
                host[0].copy_(first, non_blocking=True)
                events[0].record()
            # The first token is read as soon as step 1 is queued (TTFT); after
            # that the GPU runs LOOKAHEAD steps ahead of the host.
            done = 0
            for t in range(1, steps + 1):
                if t < steps:
                    with torch.inference_mode():
                        runner.step()
                        host[t].copy_(runner.tokens, non_blocking=True)
                        events[t].record()
                while done < steps and (done == 0 or done <= t - LOOKAHEAD or t == steps):
                    events[done].synchronize()
                    yield host[done].tolist()
                    done += 1
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # nothing of this call runs on after it ends
            if gc_was_enabled:
                gc.enable()

    def _generate_eager(self, runner: DecodeRunner, ids: torch.Tensor, steps: int):
        """The CPU path: one step at a time, no graph, no lookahead."""
        with torch.inference_mode():
            first = self.model.prefill(ids.to(self.device))
            runner.start(first, ids.shape[1])
            tokens = first.tolist()
        yield tokens
        for _ in range(steps - 1):
            with torch.inference_mode():
                runner.step()
                tokens = runner.tokens.tolist()
            yield tokens

    # ---- speculation: draft, verify, keep the target's picks (fq_spec) ---------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _spec_runner_for(self, batch: int, prompt: int, steps: int) -> SpecRunner:
        """The SpecRunner of this (batch, k, drafter) holding prompt + steps positions: kept across
        calls, made (its graphs captured and timed at this call's prompt length) before this call's
        prompt pass. "auto" has a verify of each of verify_widths(k) and a plain step; the other
        modes a verify of k."""
        spec, runner = self.spec, self._spec
        auto = spec.mode == "auto"
        widths = verify_widths(spec.k) if auto else (spec.k,)
        if (runner is None or runner.batch != batch or runner.k != spec.k or runner.drafter is not self._drafter
                or runner.state.capacity < prompt + steps or runner.widths != widths
                or ("plain" in runner.graphs) != auto):
            self._spec = None
            state = SpecState(batch, _rounded_capacity(prompt + steps), spec.k, self.device)
            runner = self._spec = SpecRunner(self.model, self._drafter, state, self.use_graphs, plain=auto,
                                             widths=widths, context=prompt)
            self._spec_mode = spec
        return runner

    def _record_oracle(self, ids: torch.Tensor, steps: int, stats: SpecStats) -> None:
        """The oracle's plain run of the prompts it has not seen (not part of the timed loop's work)."""
        drafter, prompts = self._drafter, ids.tolist()
        drafter.set_prompts(prompts)
        missing = drafter.missing(prompts, steps)
        if missing:
            began = time.perf_counter()
            plain = [[] for _ in missing]
            for tokens in self._generate(ids[missing], steps):
                for seq, token in zip(plain, tokens):
                    seq.append(token)
            for b, seq in zip(missing, plain):
                drafter.record(prompts[b], seq)
            stats.record_s = time.perf_counter() - began

    def _generate_spec(self, ids: torch.Tensor, steps: int):
        """Speculative generation: each step is a verify (the drafter's k drafts and each sequence's
        last token as k + 1 decode rows, the target's picks up to the first rejected draft kept,
        all on the device: fq_decode.SpecRunner) or, for "auto", a verify of the width that pays
        best at the running acceptance or, where none pays, a plain decode step. The host reads
        each step's picks to yield them, and queues the next step before reading the last where
        that step is needed whatever the last emitted. A sequence
        that has its `steps` tokens emits nothing more (its verifies rewrite rows past its end)."""
        spec = self.spec
        batch, prompt = ids.shape
        stats = self._spec_stats = SpecStats(mode=spec.mode, k=spec.k)
        if isinstance(self._drafter, OracleDrafter):
            self._record_oracle(ids, steps, stats)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.inference_mode():
                # a finished sequence verifies in place: its rows reach k positions past its end
                self._prepare_cache(batch, prompt + steps + 2 * spec.k)
                self._tune(batch)      # the verify launches its products as the plain B-row step does
                runner = self._spec_runner_for(batch, prompt, steps)
                policy = None
                if spec.mode == "auto":
                    costs = runner.costs
                    policy = AutoPolicy({w: costs["draft_ms"] + costs[f"verify{w}_ms"] for w in runner.widths},
                                        costs["plain_ms"])
                dev_ids = ids.to(self.device)
                first = self._prefill(dev_ids)
                # As _generate: the first tokens' copy is queued, then the drafter's start and the
                # first step, and the host waits for the copy alone, so the device goes from the
                # prompt pass into the step (and the first tokens wait for no drafter).
                _, first_host, first_copied = self._spec_copy(first.view(-1, 1), 0)
                runner.state.start(dev_ids, first, steps)
                self._drafter.start(runner.state, prompt, steps)
                runner.start_timing()
                queue = []                           # steps queued and not read: (width, host copy, event, marks)
                if steps > 1:
                    queue.append(self._spec_step(runner, spec.k if policy is None else policy.next_width()))
                # "auto": prompt lookup on the host over each sequence, indexed while the device
                # runs the prompt pass; it checks what a plain step's draft would have been
                lookups = [PromptLookup(p) for p in ids.tolist()] if spec.mode == "auto" else None
            if first_copied is not None:
                first_copied.synchronize()
            first = first_host.view(-1).tolist()
            yield first
            if lookups is not None:
                for lookup, t in zip(lookups, first):
                    lookup.extend([t])
            out = [[t] for t in first]
            remaining = [steps - 1] * batch          # as of the last step the host has read
            done, began = 1, time.perf_counter()
            while done < steps:
                # queue the next step when the host has none queued, or when it is needed whatever
                # the queued one emits (some sequence needs more than a step can give)
                most = (queue[-1][0] + 1) if queue else spec.k + 1
                if not queue or (len(queue) < 2 and max(remaining) > most):
                    with torch.inference_mode():
                        queue.append(self._spec_step(runner, spec.k if policy is None else policy.next_width()))
                    continue
                width, host, event, marks = queue.pop(0)
                if event is not None:
                    event.synchronize()
                if policy is not None:         # the step's own device time (its events are done)
                    policy.observe_cost(width, marks_ms(marks))
                rows = host.tolist()
                drafted = accepted = rejected = right = wrong = 0
                # the rows each sequence could keep (a wide Qwen3.5 verify stops before a chunk's
                # close): drafts past them were not checked
                keep = self.model.verify_keep(torch.tensor([prompt + len(seq) - 1 for seq in out], dtype=torch.int32),
                                              width + 1).tolist() if width else None
                for b, row in enumerate(rows):
                    emit = row[-1]
                    if emit and lookups is not None:
                        if not width:      # the draft prompt lookup would have made, against the pick
                            hit = lookups[b].draft(1)[0] == row[0]
                            right, wrong = right + hit, wrong + (not hit)
                        lookups[b].extend(row[:emit])
                    if emit:
                        if width:       # drafts count where a sequence had room for them
                            room = min(remaining[b], keep[b])
                            drafted += min(width, room - 1)
                            accepted += emit - 1
                            rejected += verify_observed(emit, width, room)[1]
                            stats.verified_rows += 1
                            stats.emitted += emit
                        out[b].extend(row[:emit])
                        remaining[b] -= emit
                if width:
                    stats.verify_steps += 1
                    stats.width_steps[width] = stats.width_steps.get(width, 0) + 1
                    stats.drafted += drafted
                    stats.accepted += accepted
                    if policy is not None:
                        policy.observe_verify(accepted, rejected)
                else:
                    stats.plain_steps += 1
                    if policy is not None:
                        policy.observe_shadow(right, wrong)
                while done < steps and all(len(seq) > done for seq in out):
                    yield [seq[done] for seq in out]
                    done += 1
            stats.loop_s = time.perf_counter() - began
            self._sync()
            for name, ms in runner.times_ms().items():
                setattr(stats, name, ({w: round(v, 4) for w, v in ms.items()} if isinstance(ms, dict)
                                      else None if ms is None else round(ms, 4)))
        finally:
            self._sync()
            if gc_was_enabled:
                gc.enable()

    def _spec_step(self, runner: SpecRunner, width: int) -> tuple:
        """Queue a verify of `width` drafts (0: a plain step): (width, host copy of its packed picks
        and emit counts, the event after the copy, its timing marks)."""
        if width:
            picks, emit = runner.verify(width)
            packed = torch.cat([picks, emit.view(-1, 1)], dim=1)
        else:
            packed = runner.plain()
        return self._spec_copy(packed, width) + (runner.last_marks,)

    def _spec_copy(self, packed: torch.Tensor, width: int) -> tuple:
        """A step's packed picks and emit counts on their way to the host: (its width, 0 for a plain
        step; host tensor; the event after its copy, None on the CPU, where the copy is done)."""
        if self.device.type != "cuda":
            return width, packed.clone(), None
        # a ring of pinned buffers per shape: at most two steps are in flight, so a third is free
        ring = self._spec_host.get(tuple(packed.shape))
        if ring is None:
            ring = self._spec_host[tuple(packed.shape)] = [
                [torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True) for _ in range(3)], 0]
        host = ring[0][ring[1]]
        ring[1] = (ring[1] + 1) % 3
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return width, host, event

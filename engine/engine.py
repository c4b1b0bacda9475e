"""fastqwen's engine: greedy Qwen3 generation, exact to native Transformers'
argmax within the platform's margin, on one GPU. Qwen3.5 checkpoints (model_type
qwen3_5_text / qwen3_5) run through the same loop on fq_qwen35's model: on a GPU its
decode step (attention and GDN kernels) is one CUDA graph and its prompt pass runs the
chunked GDN kernels (as a graph per shape up to 2,048 tokens); on the CPU all of it runs
on the torch references.

`Engine(model_path)` loads a Hugging Face-layout Qwen3 checkpoint (no
Transformers involved); `generate(input_ids, max_new_tokens)` yields one list
of token ids per step. On a CUDA device the decode step is one CUDA graph of
fused Triton kernels and cuBLAS products; on the CPU the same model code runs
on the torch reference ops.

Switches (environment, read at load): FASTQWEN_NO_GRAPHS=1 (eager decode),
FASTQWEN_NO_PREFILL_GRAPHS=1 (eager prefill), FASTQWEN_NO_PDL=1 (no dependent
launch between the decode kernels; read when fqkernels is first imported),
FASTQWEN_QWEN35_BACKEND=torch|triton (Qwen3.5's op set, fq_qwen35.resolve_backend),
FASTQWEN_GDN_PLAN=name=value,... (the GDN prompt pass's launch plan, fqkernels/gdn.py PrefillPlan),
FASTQWEN_EXACT_DECODE=0 (turns off exact decode: from 7 to 32 sequences the Qwen3 decode
step is the full forward's, bit for bit, its products and attention in that order;
fqkernels/gemv.py EXACT). FASTQWEN_GRAPH_SNAPSHOT_PASSES=0 (serving, Qwen3.5: a prompt pass that
keeps a state snapshot runs eagerly, not as a chunk graph; read when slots are made, fq_slots).
FASTQWEN_GDN_EXACT_PREFILL=1 (Qwen3.5: the prompt pass's chunked rule in the reference's order of
operations, its bits; slower prompts; fqkernels/gdn_exact.py). FASTQWEN_GDN_EXACT_DECODE=0 (Qwen3.5:
the recurrent GDN decode step; by default each step computes the full forward's row of the chunked rule,
fqkernels/gdn_exact_step.py). FASTQWEN_LM_SCREEN=0 (one sequence's decode pick from the whole LM head's
product, not screened through its int8 copy; fqkernels/lm_screen.py).
"""
import gc
import json
import os

import torch

import fq_qwen35
from fq_config import ModelConfig
from fq_decode import DecodeRunner, PrefillGraph
from fq_model import Qwen3Model
from fq_ops import ops_for
from fq_weights import load_weights

# Cache capacities are rounded up to this, so calls of nearby lengths share
# one cache and one graph.
CAPACITY_GRANULE = 256
# Steps the GPU may run ahead of the host: step t+1 is queued before step t's
# tokens are read, so the host's .tolist() and yield overlap the GPU's work.
LOOKAHEAD = 2
# Prefills of at most this many tokens (batch x prompt) run as a CUDA graph per
# shape after the first call of that shape; larger ones are GPU-bound anyway.
PREFILL_GRAPH_TOKENS = 8192
# Qwen3.5's prompt pass launches more kernels a layer (its graph halves it at 1 x 512 on an
# H200, 13.5 against 25.8 ms) and keeps bigger workspaces in the graph's pool, for no gain
# at 8,192 tokens (within 1.5% at 4 x 2048 and 16 x 512): session 9, q35_check.json.
QWEN35_PREFILL_GRAPH_TOKENS = 2048
PREFILL_GRAPHS_KEPT = 4


def _rounded_capacity(positions: int) -> int:
    """The cache capacity allocated for `positions` positions."""
    return -(-positions // CAPACITY_GRANULE) * CAPACITY_GRANULE


def _model_type(model_path: str):
    """config.json's model_type, or None where it cannot be read (ModelConfig.from_dir then
    reports what is wrong, naming it)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return raw.get("model_type") if isinstance(raw, dict) else None


class Engine:
    def __init__(self, model_path: str):
        qwen35 = _model_type(model_path) in fq_qwen35.MODEL_TYPES
        self.cfg = fq_qwen35.Qwen35Config.from_dir(model_path) if qwen35 else ModelConfig.from_dir(model_path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # The reference runs with TF32 off; bf16 products accumulate in fp32 in
        # our kernels, so ask cuBLAS for the same (no reduced-precision split-K).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        with torch.inference_mode():
            if qwen35:  # the hybrid family (fq_qwen35.py): torch or triton backend
                backend = fq_qwen35.resolve_backend(self.device)
                self.model = fq_qwen35.Qwen35Model(
                    self.cfg, fq_qwen35.load_weights(model_path, self.cfg, self.device, pack=backend == "triton"),
                    self.device, backend)
            else:
                self.model = Qwen3Model(self.cfg, load_weights(model_path, self.cfg, self.device), self.device,
                                        ops_for(self.device))
        # Qwen3.5's decode step and prompt pass are graph-safe on its triton backend (no host reads).
        self.use_graphs = (self.device.type == "cuda" and (not qwen35 or self.model.backend == "triton")
                           and os.environ.get("FASTQWEN_NO_GRAPHS") != "1")
        self.use_prefill_graphs = self.use_graphs and os.environ.get("FASTQWEN_NO_PREFILL_GRAPHS") != "1"
        self.prefill_graph_tokens = QWEN35_PREFILL_GRAPH_TOKENS if qwen35 else PREFILL_GRAPH_TOKENS
        self._runner = None
        self._prefill_graphs = {}  # (batch, prompt) -> PrefillGraph over the current cache
        self._host = None
        self._slots = None  # the open fq_slots.Slots, if any (generate() closes it)
        self.tuning = {}  # batch -> {matrix: (cuBLAS us, GEMV us)}, measured at warmup

    def slots(self, max_slots: int, max_len: int, page_size: int | None = None, num_pages: int | None = None,
              share_prefixes: bool = True, state_snapshots: int | None = None):
        """Continuous batching for a server (fq_slots.Slots): max_slots rows of max_len positions
        in this engine's caches, or with page_size a pool of num_pages pages of page_size
        positions read through each row's block table (None: max_slots rows' worth; with
        share_prefixes the pages of common prompt prefixes shared where the model allows; a
        Qwen3.5 model keeps state_snapshots of its GDN states for it, None: fq_slots' default),
        each step size's graph captured now. The caches and graphs generate() made are dropped (and
        generate() makes its own again when called)."""
        from fq_slots import Slots

        self._drop_graphs()
        self._close_slots()
        if page_size is None:
            self._check_memory(max_slots + 1, max_len)         # and the staging row (fq_slots)
        else:
            self._check_paged_memory(max_slots, max_len, page_size, num_pages, share_prefixes, state_snapshots)
        self._slots = Slots(self.model, self.device, max_slots, max_len, self.use_graphs, self._tune,
                            page_size=page_size, num_pages=num_pages, share_prefixes=share_prefixes,
                            state_snapshots=state_snapshots)
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

    def describe(self) -> dict:
        """What runs: the model family, its op backend, whether the decode step is a graph."""
        qwen35 = isinstance(self.model, fq_qwen35.Qwen35Model)
        backend = self.model.backend if qwen35 else self.model.ops.name
        from fqkernels import gemv

        out = {"family": "qwen3.5" if qwen35 else "qwen3", "backend": backend,
               "decode_graph": self.use_graphs, "prefill_graphs": self.use_prefill_graphs,
               "exact_decode": gemv.EXACT and backend == "triton",
               # one sequence's LM head screened through its int8 copy (fqkernels/lm_screen)
               "lm_screen": getattr(self.model, "screen", None) is not None}
        if qwen35:     # the prompt pass's chunked rule: the reference's ops, the fast kernels, or the
            from fqkernels import gdn      # kernels in the reference's order (gdn_exact)

            out["gdn_prompt_rule"] = ("reference" if backend != "triton" else
                                      "exact kernels" if gdn.EXACT_PREFILL else "kernels")
            # the GDN decode step: the recurrent step, or the full forward's row (FASTQWEN_GDN_EXACT_DECODE)
            out["gdn_decode"] = "recurrent"
            if self.model.exact_decode:
                from fqkernels import gdn_exact_step

                out["gdn_decode"] = ("full forward's rows" + (f" ({gdn_exact_step.step_form()})"
                                                              if backend == "triton" else ""))
        return out

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
        self._check_memory(ids.shape[0], ids.shape[1] + max_new_tokens - 1)
        return self._generate(ids, max_new_tokens)

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
    def _prepare(self, batch: int, capacity: int) -> DecodeRunner:
        model = self.model
        if model.ensure_rope(capacity):
            self._drop_graphs()
        if not model.cache_fits(batch, capacity):
            self._drop_graphs()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            model.allocate_cache(batch, _rounded_capacity(capacity))
        if self._runner is None:
            self._tune(batch)
            self._runner = DecodeRunner(model, batch, self.use_graphs)
        return self._runner

    def _tune(self, rows: int) -> None:
        """On a GPU, once per row count: our GEMV or cuBLAS for each decode product (ops.tune)."""
        if self.device.type == "cuda" and rows not in self.tuning:
            self.tuning[rows] = self.model.ops.tune(self.model.w, rows)

    def _drop_graphs(self) -> None:
        """Forget every captured graph: they point at the cache and RoPE tables being replaced."""
        self._runner = None
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
        self._prefill_graphs[(batch, prompt)] = PrefillGraph(self.model, batch, prompt)
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

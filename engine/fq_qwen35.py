"""Qwen3.5 (hybrid: Gated DeltaNet layers and gated full-attention layers), behind the
same interface as fq_model.Qwen3Model: prefill over a fresh prompt, one decode step,
static caches.

Backends, chosen explicitly (never a silent fallback), reported as `model.backend`:
- "torch": every op the pure-torch reference (fqkernels/gdn.py and the references
  below), on any device, eager; the decode step reads the lengths on the host. The CPU
  default: its logits are Transformers 5.17's bit for bit (tests/test_engine_qwen35_cpu.py).
- "triton": the decode step's attention through fqkernels.decode_attention and each GDN
  layer's step through in_proj's GEMV with the conv and gates in its epilogue at batch 1
  (gdn.in_proj_conv_gates_step; at more rows, where cuBLAS runs in_proj, or with
  FASTQWEN_FUSE_IN_PROJ=0, gdn.conv_gates_step after the product), gdn.decode_step and (heads of 128)
  gdn.gated_rmsnorm; no host reads, so the engine captures the step as one CUDA graph.
  The prompt pass's conv through gdn.causal_conv_prefill, its rule through
  gdn.chunked_prefill, its gated norm through gdn.gated_rmsnorm; every residual add and the norm
  after it through fqkernels.rmsnorm (one_plus). An attention layer's q_proj, k_proj and v_proj
  are one packed matrix (one decode product; the prompt pass takes its row slices), its output
  gate one kernel (swiglu.sigmoid_gate_mul). Each decode product through our GEMV
  (fqkernels/gemv.py) where, timed at the decode batch (`ops.tune`, as the Qwen3 op set
  does), it beats cuBLAS; cuBLAS otherwise. The CUDA default.
FASTQWEN_QWEN35_BACKEND=torch|triton overrides the default. (flash-linear-attention is
not among the platform's modules, so it cannot be imported here: scripts/bench_gdn.py
compares its kernels with ours.)

The reference is Transformers 5.17.0's Qwen3_5ForCausalLM with its torch fallback
(../shared/QWEN35.md, checked against the source). Per layer, h += mixer(norm1(h)), then
h += MLP(norm2(h)), adds in BF16; every norm but the gated one is (1 + w): fp32 x *
rsqrt(mean x^2 + eps) * (1 + w) rounded once.
- Gated attention (every `full_attention` layer): q_proj gives per head [query | gate];
  (1 + w) q/k norms over head_dim; RoPE on the first head_dim * partial_rotary_factor
  dims (rotate-half, cos/sin of fp32 angles rounded to BF16; text positions make the
  interleaved M-RoPE plain RoPE); causal attention through SDPA with the K/V heads shared
  (enable_gqa, as 5.17's sdpa path); output times sigmoid(gate); o_proj.
- Gated DeltaNet (`linear_attention`): in_proj_qkv -> causal conv (width 4) + SiLU ->
  q | k | v heads; beta = sigmoid(b) in BF16, g = -exp(A_log) softplus(a + dt_bias) in
  fp32; q/k heads repeated to the value heads; the delta rule on an fp32 state (chunked
  over a prompt, one step at a time in decode, as the reference); gated RMSNorm with
  silu(z); out_proj.
Caches: K/V [L_attn, B, KVH, C, D] BF16 for the attention layers; per GDN layer the conv
state [B, conv_dim, 4] (the last 4 inputs of the conv) and the recurrent state
[B, Hv, Dk, Dv] fp32. Tokens of one call share their positions (the engine's contract).
With exact GDN decode (EXACT_DECODE, opt-in) a GDN layer's decode step is the full forward's
row of the chunked rule (fqkernels/gdn_exact_step.py): its recurrent state in the cache is then
the state at the start of the chunk the row's position is in, kept beside the chunk's rows so far
(self.rows), and a prompt pass runs its positions outside whole chunks through that step; the
step's program does the gated norm too where its grid takes the fused form (STEP_NORM).
State snapshots (allocate_snapshots): a sequence's conv and recurrent states after a given
position, taken by a prompt pass where that position is one of the rule's chunk boundaries
(the chunked kernels' and reference's starting state of that chunk: no pass of its own), and
put back into a row later; fq_slots shares a prompt prefix's pages with them.
"""
import json
import os
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from fqkernels import gdn, gdn_exact, gdn_exact_step
from fqkernels.argmax import argmax_reference
from fqkernels.rmsnorm import rmsnorm_one_plus_reference as _norm
from fqkernels.rope_kv import partial_rope_reference as _rotate
from fq_model import cached_kv, write_pages
from fq_ops import SDPA_BACKENDS, expand_kv, prefix_mask
from fqkernels.swiglu import sigmoid_gate_mul, sigmoid_gate_mul_reference

BACKENDS = ("torch", "triton")
# The triton backend's prompt pass runs its MLP over row slices of at most this many tokens.
MLP_ROWS = 8192
# The GDN step's conv and gates in in_proj's GEMV epilogue at batch 1 (the same bits as the
# separate kernel; FASTQWEN_FUSE_IN_PROJ=0 for the separate kernel, an A/B)
FUSE_IN_PROJ = os.environ.get("FASTQWEN_FUSE_IN_PROJ", "1") != "0"
# Exact GDN decode (the default since session 31; FASTQWEN_GDN_EXACT_DECODE=0 for the recurrent step):
# each GDN layer's decode step computes the full forward's row of the chunked rule
# (fqkernels/gdn_exact_step.py) instead of the recurrent step, its cache rows keeping the state at
# their chunk's start and the chunk's rows so far. Native's noise (the fast step's is ~2.8x it) at
# the public bars' speed: results/PERF_LOG.md, session 31.
EXACT_DECODE = os.environ.get("FASTQWEN_GDN_EXACT_DECODE", "1") != "0"
# With exact decode, the gated norm in the step's own program where a program holds a whole head
# (gdn_exact_step.fused_step's norm; the same bits), one kernel a GDN layer fewer
# (FASTQWEN_GDN_STEP_NORM: "1", "0" for the separate gated norm kernel, or "auto", the default:
# gdn_exact_step.norm_in_step's, in the step where its grid takes the fused form)
STEP_NORM = os.environ.get("FASTQWEN_GDN_STEP_NORM", "auto")
# The attention's output gate in the decode attention's merge of its splits (decode_attention's gate,
# one kernel a layer fewer) where the decode step's attention runs on the kernels
# (FASTQWEN_ATTN_GATE_IN_COMBINE=0 for the separate gate kernel). The same bits (its GPU test passed on
# the H200 in session 30 at B = 1 / 4 / 16); the B = 1 decode step -6 to -7 us (sessions 28, 30)
ATTN_GATE_IN_COMBINE = os.environ.get("FASTQWEN_ATTN_GATE_IN_COMBINE", "1") == "1"


def resolve_backend(device: torch.device, requested: str | None = None) -> str:
    """The backend for this device: `requested`, else FASTQWEN_QWEN35_BACKEND, else triton
    on CUDA and torch elsewhere. A name outside BACKENDS is an error naming it."""
    name = requested or os.environ.get("FASTQWEN_QWEN35_BACKEND") or ("triton" if device.type == "cuda" else "torch")
    if name not in BACKENDS:
        raise ValueError(f"Qwen3.5 backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Qwen3.5 backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1)")
    return name

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
# The released multimodal checkpoints keep the text model under this prefix and carry
# vision and multi-token-prediction weights the text engine does not run.
_WRAPPED = "model.language_model."
_SKIPPED = ("mtp.", "model.visual.", "visual.")


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_width: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    model_type = "qwen3_5_text"

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str) -> "Qwen35Config":
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "Qwen35Config":
        if raw.get("model_type") == "qwen3_5":
            tie = raw.get("tie_word_embeddings", raw.get("text_config", {}).get("tie_word_embeddings", False))
            raw = dict(raw.get("text_config") or {}, tie_word_embeddings=tie)
        def need(key):
            if key not in raw:
                raise ValueError(f"config.json: Qwen3.5 field {key!r} is missing")
            return raw[key]
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: rope_type {rope.get('rope_type')!r} is not supported (default only)")
        if raw.get("attention_bias", False):
            raise ValueError("config.json: attention_bias true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
        layers = int(need("num_hidden_layers"))
        types = tuple(raw.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                 for i in range(layers)])
        bad = sorted(set(types) - {"full_attention", "linear_attention"})
        if bad or len(types) != layers:
            raise ValueError(f"config.json: layer_types must list {layers} of full_attention / linear_attention, "
                             f"got {bad or len(types)}")
        head_dim = int(raw.get("head_dim", 256))
        partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
        for many, few in (("num_attention_heads", "num_key_value_heads"),
                          ("linear_num_value_heads", "linear_num_key_heads")):
            if int(need(few)) < 1 or int(need(many)) % int(need(few)):
                raise ValueError(f"config.json: {many} ({raw[many]}) must be a multiple of {few} ({raw[few]})")
        if int(head_dim * partial) % 2 or not 0 < partial <= 1:
            raise ValueError(f"config.json: partial_rotary_factor {partial} of head_dim {head_dim} must give an even "
                             "number of rotary dims")
        return cls(
            vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")), num_layers=layers, layer_types=types,
            num_heads=int(need("num_attention_heads")), num_kv_heads=int(need("num_key_value_heads")),
            head_dim=head_dim, rotary_dim=int(head_dim * partial), rope_theta=float(rope.get("rope_theta", 10000.0)),
            linear_k_heads=int(need("linear_num_key_heads")), linear_v_heads=int(need("linear_num_value_heads")),
            linear_k_dim=int(need("linear_key_head_dim")), linear_v_dim=int(need("linear_value_head_dim")),
            conv_width=int(raw.get("linear_conv_kernel_dim", 4)), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )


def load_weights(model_dir: str, cfg: Qwen35Config, device: torch.device, pack: bool = False) -> dict:
    """name -> BF16 tensor on the device, text-model names (`model.layers.3.self_attn.q_proj.weight`);
    the released wrapper's prefix is removed, its vision and MTP weights skipped (one line).
    pack: the triton backend's packed matrices (_pack_groups: gate | up, a GDN layer's qkv | z |
    b | a, an attention layer's q | k | v) are each read straight into their place in one device
    tensor, so the load's peak is the weights themselves (packing after the load held both
    copies: +4.4 GiB reserved on the 4B, session 9)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    where, skipped = {}, 0      # text-model name -> (file, stored name)
    for fname in files:
        with safe_open(os.path.join(model_dir, fname), framework="pt") as f:
            for name in f.keys():
                if name.startswith(_SKIPPED):
                    skipped += 1
                    continue
                where["model." + name[len(_WRAPPED):] if name.startswith(_WRAPPED) else name] = (fname, name)
    if skipped:
        print(f"fastqwen: skipped {skipped} vision / multi-token-prediction tensors", flush=True)
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in where
    missing = [n for n in _expected_names(cfg) if n not in where and not (n == "lm_head.weight" and tied)]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")
    groups = _pack_groups(cfg) if pack else {}
    packed_parts = {part for parts in groups.values() for part in parts}
    out = {}
    with ExitStack() as stack:
        handles = {fname: stack.enter_context(safe_open(os.path.join(model_dir, fname), framework="pt"))
                   for fname in files}

        def read(key):
            fname, stored = where[key]
            return handles[fname].get_tensor(stored)

        for key in where:
            if key not in packed_parts and not (key == "lm_head.weight" and tied):
                out[key] = read(key).to(device=device, dtype=torch.bfloat16)
        for packed, parts in groups.items():      # each part read from the shard into its rows
            tensors = [read(part) for part in parts]
            dest = torch.empty((sum(t.shape[0] for t in tensors),) + tuple(tensors[0].shape[1:]),
                               dtype=torch.bfloat16, device=device)
            row = 0
            for t in tensors:
                dest[row:row + t.shape[0]].copy_(t)
                row += t.shape[0]
            out[packed] = dest
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _pack_groups(cfg: Qwen35Config) -> dict:
    """The triton backend's packed matrices: name -> the names stacked into it, in order."""
    groups = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        groups[p + "mlp.gate_up.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        if cfg.layer_types[i] == "linear_attention":
            groups[p + "linear_attn.in_proj.weight"] = [p + f"linear_attn.in_proj_{n}.weight"
                                                        for n in ("qkv", "z", "b", "a")]
        else:
            groups[p + "self_attn.qkv_proj.weight"] = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
    return groups


def _expected_names(cfg: Qwen35Config) -> list:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        mixer = (["linear_attn." + s for s in ("dt_bias", "A_log", "conv1d.weight", "norm.weight", "out_proj.weight",
                                              "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                              "in_proj_a.weight")]
                 if kind == "linear_attention" else
                 ["self_attn." + s + ".weight" for s in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")])
        names += [p + s for s in mixer + ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                           "input_layernorm.weight", "post_attention_layernorm.weight"]]
    return names


class Qwen35Model:
    # A prompt prefix's pages are shared (fq_slots) together with the GDN states at its end,
    # kept as a snapshot (allocate_snapshots) at positions that are multiples of this.
    prefix_sharing = True
    snapshot_granule = gdn.CHUNK

    def __init__(self, cfg: Qwen35Config, weights: dict, device: torch.device, backend: str | None = None,
                 exact_decode: bool | None = None):
        self.cfg, self.w, self.device = cfg, weights, device
        self.backend = resolve_backend(device, backend)
        # exact_decode (None: EXACT_DECODE): the GDN decode step in the full forward's arithmetic.
        # Then a GDN layer's state in the cache is the state at the start of the chunk its row's
        # position is in, and self.rows[layer] the chunk's rows so far; a prompt pass leaves them so.
        self.exact_decode = EXACT_DECODE if exact_decode is None else exact_decode
        self.rows = None
        self.decode_tile = gdn.CHUNK // 2   # the full forward's cumulative-sum tile (_decode_tile)
        # layer index -> its slot in the attention layers' KV cache, or in the GDN layers' states
        self.attn_slot = {i: n for n, i in enumerate(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")}
        self.gdn_slot = {i: n for n, i in enumerate(i for i, t in enumerate(cfg.layer_types) if t == "linear_attention")}
        self.scale = cfg.head_dim ** -0.5
        if self.backend == "triton":
            self._pack()
        self.cos = self.sin = None
        self.k_cache = self.v_cache = self.conv_state = self.state = None
        self.snap_conv = self.snap_state = None     # allocate_snapshots
        self._capture = None                        # a prompt pass's snapshot: (offset, indices)
        # Paged form (allocate_paged_cache): the attention layers' caches are pools of pages,
        # [A, P, KVH, page, D], row b's position p in page block_table[b, p // page]; the GDN
        # states stay one row per sequence. None: rows of positions.
        self.block_table = None
        self.ops = _Products() if self.backend == "triton" else _TorchProducts()
        if self.backend == "triton":   # torch.argmax's picks, bit for bit, in two small kernels
            from fqkernels.argmax import argmax as triton_argmax

            self._argmax = triton_argmax
        else:
            self._argmax = argmax_reference
        # one sequence's decode pick without the whole LM head (fqkernels/lm_screen: the same pick)
        self.screen = None
        if self.backend == "triton" and device.type == "cuda":
            from fqkernels import lm_screen

            self.screen = lm_screen.for_model(self.w["lm_head.weight"])

    def _pack(self) -> None:
        """The triton backend's weights: per GDN layer the four input projections as one
        matrix (qkv | z | b | a), per attention layer q_proj, k_proj and v_proj as one
        (q | k | v), per layer gate and up as one (gate | up), packed in the weights dict
        itself, each original dropped as its pack is made. Packs the loader already made
        (load_weights(pack=True), what the engine loads) are kept as they are."""
        for packed, names in _pack_groups(self.cfg).items():
            if packed not in self.w:
                self.w[packed] = torch.cat([self.w.pop(n) for n in names])

    # ---- buffers -----------------------------------------------------------------
    def ensure_rope(self, length: int) -> bool:
        if self.cos is not None and self.cos.shape[0] >= length:
            return False
        c = self.cfg
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float) / c.rotary_dim))
        freqs = torch.arange(length, dtype=torch.float)[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.device, torch.bfloat16)
        self.sin = emb.sin().to(self.device, torch.bfloat16)
        return True

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Cache row dst becomes row src: its first `length` K/V positions and its GDN states
        (fq_slots moves the last running request into a freed row); in the paged form its block
        table row instead of its K/V (the pages stay where they are)."""
        if self.block_table is not None:
            self.block_table[dst] = self.block_table[src]
        else:
            self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
            self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]
        self.conv_state[:, dst] = self.conv_state[:, src]
        self.state[:, dst] = self.state[:, src]
        for rows in self.rows or ():
            rows.copy_row(src, dst)

    def cache_fits(self, batch: int, capacity: int) -> bool:
        return (self.k_cache is not None and self.block_table is None and self.k_cache.shape[1] == batch
                and self.k_cache.shape[3] >= capacity)

    def page_bytes(self, page: int) -> int:
        """Bytes of one page of `page` positions in every attention layer's K and V pools."""
        return 2 * len(self.attn_slot) * self.cfg.kv_size * page * 2

    def row_bytes(self) -> int:
        """Bytes of one sequence's GDN states (conv and recurrent), which are not paged."""
        return self.cache_bytes(1, 0)

    def cache_bytes(self, batch: int, capacity: int) -> int:
        c = self.cfg
        kv = 2 * len(self.attn_slot) * batch * c.kv_size * capacity * 2
        states = len(self.gdn_slot) * batch * (c.conv_dim * c.conv_width * 2
                                                 + c.linear_v_heads * c.linear_k_dim * c.linear_v_dim * 4)
        return kv + states + len(self.gdn_slot) * batch * self._rows_bytes()

    def _rows_bytes(self) -> int:
        """Bytes of one sequence's chunk rows in one GDN layer (exact decode; else 0)."""
        c = self.cfg
        if not self.exact_decode:
            return 0
        if self.backend == "triton":
            return gdn_exact_step.ChunkRows.row_bytes(c.linear_v_heads, c.linear_k_dim, c.linear_v_dim)
        return gdn_exact_step.ReferenceRows.row_bytes(c.linear_k_heads, c.linear_v_heads, c.linear_k_dim,
                                                      c.linear_v_dim)

    def _decode_tile(self, batch: int, capacity: int) -> int:
        """The cumulative sum's tile of a full forward over `capacity` positions of `batch`
        sequences (gdn_exact_step.scan_tile over its rows of 64)."""
        return gdn_exact_step.scan_tile(batch * self.cfg.linear_v_heads * max(1, -(-capacity // gdn.CHUNK)))

    def _allocate_rows(self, batch: int, capacity: int) -> None:
        """Exact decode's chunk rows for `batch` sequences in every GDN layer (one scratch shared by
        the layers' steps), and the decode's tile for `capacity` positions (_decode_tile)."""
        self.rows = None
        if not self.exact_decode:
            return
        c, dev = self.cfg, self.device
        self.decode_tile = self._decode_tile(batch, capacity)
        if self.backend == "triton":
            scratch = gdn_exact_step.ChunkRows.scratch_for(batch, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim, dev)
            self.rows = [gdn_exact_step.ChunkRows(batch, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim, dev,
                                                  scratch=scratch) for _ in self.gdn_slot]
        else:
            self.rows = [gdn_exact_step.ReferenceRows(batch, c.linear_k_heads, c.linear_v_heads, c.linear_k_dim,
                                                      c.linear_v_dim, dev) for _ in self.gdn_slot]

    def allocate_paged_cache(self, rows: int, pages: int, page: int, capacity: int) -> None:
        """The paged form: K and V pools of `pages` pages of `page` positions per attention layer,
        a block table of `rows` rows of capacity // page pages (int32, all page 0 until a row
        is given its pages), and the GDN states of `rows` sequences."""
        if capacity % page:
            raise ValueError(f"allocate_paged_cache: capacity {capacity} is not a multiple of the page size {page}")
        self.allocate_cache(rows, 0)
        self.decode_tile = self._decode_tile(rows, capacity)
        self.k_cache = self.v_cache = None
        c = self.cfg
        shape = (len(self.attn_slot), pages, c.num_kv_heads, page, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        self.block_table = torch.zeros((rows, capacity // page), dtype=torch.int32, device=self.device)

    def allocate_snapshots(self, n: int) -> None:
        """Room for n snapshots of one sequence's GDN states (conv and recurrent, every GDN layer):
        taken by prefill_logits(snapshot=) or save_snapshot, put back by load_snapshot. A new
        cache (allocate_cache) drops them."""
        c, G = self.cfg, len(self.gdn_slot)
        self.snap_conv = self.snap_state = None
        self.snap_conv = torch.zeros((n, G, c.conv_dim, c.conv_width), dtype=torch.bfloat16, device=self.device)
        self.snap_state = torch.zeros((n, G, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim), dtype=torch.float32,
                                      device=self.device)

    def save_snapshot(self, row: int, index: int) -> None:
        """Snapshot `index` becomes cache row `row`'s GDN states as they are."""
        self.snap_conv[index] = self.conv_state[:, row]
        self.snap_state[index] = self.state[:, row]

    def load_snapshot(self, index: int, row: int) -> None:
        """Cache row `row`'s GDN states become snapshot `index` (a prompt then goes on from the
        snapshot's position: prefill_logits with start)."""
        self.conv_state[:, row] = self.snap_conv[index]
        self.state[:, row] = self.snap_state[index]

    def allocate_cache(self, batch: int, capacity: int) -> None:
        c, dev = self.cfg, self.device
        self.k_cache = self.v_cache = self.conv_state = self.state = self.block_table = None
        self.snap_conv = self.snap_state = self.rows = None
        shape = (len(self.attn_slot), batch, c.num_kv_heads, capacity, c.head_dim)
        # zeros: the torch backend's masked attention over rows of other lengths (fq_slots) reads
        # past a row's length, where a mask cannot hide a NaN an empty buffer may hold
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        self.v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        self.conv_state = torch.zeros((len(self.gdn_slot), batch, c.conv_dim, c.conv_width),
                                      dtype=torch.bfloat16, device=dev)
        self.state = torch.zeros((len(self.gdn_slot), batch, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim),
                                 dtype=torch.float32, device=dev)
        self._allocate_rows(batch, capacity)

    # ---- forward passes ------------------------------------------------------------
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self._argmax(self.prefill_logits(ids))

    def prefill_logits(self, ids: torch.Tensor, row: int = 0, start: int = 0, snapshot: tuple | None = None
                       ) -> torch.Tensor:
        """Last-position BF16 logits [B, vocab] of fresh prompts ids [B, S]; fills every cache
        in rows [row, row + B) (a slot's own row: fq_slots). start > 0: ids are positions
        [start, start + S) of sequences whose first `start` positions those rows already hold
        (a prompt prefilled in chunks): the GDN layers go on from their conv and recurrent
        states, the attention layers' queries see the cached keys too. snapshot (position,
        indices): each sequence's GDN states after `position` are also kept as snapshot
        indices[b] (allocate_snapshots; a list, or an int64 tensor on the device), position - start
        a multiple of snapshot_granule in (0, S): the states the pass has there anyway."""
        B, S = ids.shape
        if snapshot is not None:
            at, indices = snapshot
            cut = at - start
            if self.snap_state is None or len(indices) != B or not 0 < cut < S or cut % self.snapshot_granule:
                raise ValueError(f"prefill_logits: a snapshot at {at} of {len(indices)} sequence(s) needs allocated "
                                 f"snapshots, one index per sequence ({B}) and a position past {start} by a multiple "
                                 f"of {self.snapshot_granule} below {start + S}")
            # indices may be the caller's int64 tensor on the device (a graph's static buffer: fq_decode.ChunkGraph)
            self._capture = (cut, indices if isinstance(indices, torch.Tensor)
                             else torch.tensor(indices, dtype=torch.int64, device=self.device))
        rows = slice(row, row + B)
        self.ensure_rope(start + S)
        cos, sin = self.cos[None, start:start + S], self.sin[None, start:start + S]     # [1, S, r]
        try:
            h = self._layers(ids, rows, lambda i, h: self._attention_prefill(i, h, cos, sin, rows, start), start)
        finally:
            self._capture = None
        return self._logits(h)

    def decode(self, tokens, positions, lengths, out=None):
        h = self._decode_hidden(tokens, positions, lengths)
        if self.screen is not None and h.shape[0] == 1:   # the LM head screened: argmax of its GEMV's logits
            return self.screen.argmax(h, out)
        nxt = self._argmax(self._logits(h))
        if out is None:
            return nxt
        out.copy_(nxt)
        return out

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self._logits(self._decode_hidden(tokens, positions, lengths))

    def _decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """A decode step up to the LM head: the final norm's output [B, hidden]."""
        if self.backend == "triton":      # the RoPE kernels read the tables at the positions themselves
            cos = sin = None
        else:
            cos, sin = self.cos[positions.long()].unsqueeze(1), self.sin[positions.long()].unsqueeze(1)  # [B, 1, r]
        step = lambda i, h: self._attention_step(i, h, cos, sin, positions, lengths)   # noqa: E731
        return self._layers(tokens[:, None], None, step, positions=positions)

    def _layers(self, ids: torch.Tensor, prompt_rows: slice | None, attention, start: int = 0,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Every decoder layer over the embeddings of ids [B, T]: the GDN mixer (chunked over a
        prompt filling cache rows prompt_rows, one step in decode: None) or attention(i, h), then
        the MLP, each behind its (1 + w) norm, adds in BF16 (a decode step's positions [B] go to the
        GDN step: exact decode's row in the chunk). Returns the final norm's output at
        each sequence's last position, [B, hidden]. On the triton backend the embedding lookup and
        the first norm are one kernel, and each residual add and the norm after it one kernel
        (fqkernels.rmsnorm, one_plus)."""
        eps, L = self.cfg.rms_norm_eps, self.cfg.num_layers
        ln = lambda i, kind: self.w[f"model.layers.{i}.{kind}.weight"]  # noqa: E731
        table = self.w["model.embed_tokens.weight"]
        if self.backend != "triton":
            x = table[ids]
            for i in range(L):
                h = _norm(x, ln(i, "input_layernorm"), eps)
                x = x + (self._gdn(i, h, prompt_rows, start, positions) if i in self.gdn_slot else attention(i, h))
                x = x + self._mlp(i, _norm(x, ln(i, "post_attention_layernorm"), eps))
            return _norm(x[:, -1], self.w["model.norm.weight"], eps)
        from fqkernels.rmsnorm import add_rmsnorm, embed_rmsnorm

        shape = (*ids.shape, table.shape[1])
        # rows: the residual stream, added to in place
        rows, h = embed_rmsnorm(ids.reshape(-1), table, ln(0, "input_layernorm"), eps, one_plus=True)
        h = h.view(shape)
        for i in range(L):
            mixed = self._gdn(i, h, prompt_rows, start, positions) if i in self.gdn_slot else attention(i, h)
            h = add_rmsnorm(rows, mixed.reshape(rows.shape), ln(i, "post_attention_layernorm"), eps,
                            one_plus=True).view(shape)
            nxt = ln(i + 1, "input_layernorm") if i + 1 < L else self.w["model.norm.weight"]
            h = add_rmsnorm(rows, self._mlp(i, h).reshape(rows.shape), nxt, eps, one_plus=True).view(shape)
        return h[:, -1]

    # ---- pieces ----------------------------------------------------------------------
    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """BF16 logits of final-normed rows."""
        return self.ops.linear(h, self.w["lm_head.weight"])

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        if self.backend == "triton":   # one product for gate | up, SiLU * up in one kernel (the same cast points)
            gate_up, down = self.w[p + "gate_up.weight"], self.w[p + "down_proj.weight"]
            rows = h.reshape(-1, h.shape[-1])
            if rows.shape[0] <= MLP_ROWS:
                return self.ops.linear(self.ops.linear_silu_mul(h, gate_up), down)
            # rows are independent: slices bound gate | up's activations (2 x 9216 x 2 B a token on
            # the 4B) at any prompt size; each slice's products are cuBLAS's at its row count
            out = torch.empty((rows.shape[0], down.shape[0]), dtype=h.dtype, device=h.device)
            for r0 in range(0, rows.shape[0], MLP_ROWS):
                out[r0:r0 + MLP_ROWS] = self.ops.linear(self.ops.linear_silu_mul(rows[r0:r0 + MLP_ROWS], gate_up), down)
            return out.view(*h.shape[:-1], down.shape[0])
        return F.linear(F.silu(F.linear(h, self.w[p + "gate_proj.weight"])) * F.linear(h, self.w[p + "up_proj.weight"]),
                        self.w[p + "down_proj.weight"])

    def _qkv_gate(self, i: int, h: torch.Tensor, cos, sin, rope_k: bool = True, positions=None):
        """q [B, H, T, D] and k, v [B, KVH, T, D] after norms and RoPE (k not rotated with
        rope_k False, triton backend: rope_store_kv rotates it on its way into the cache);
        gate [B, T, H, D], a view of q_proj's rows (per head [query | gate]). positions (triton
        backend, T = 1): the RoPE kernel reads the tables there, cos and sin unused."""
        c, p = self.cfg, f"model.layers.{i}.self_attn."
        B, T, _ = h.shape
        qp, k, v = self._qkv_proj(p, h)
        q, gate = torch.chunk(qp.view(B, T, -1, 2 * c.head_dim), 2, dim=-1)    # per head [query | gate]
        k = k.view(B, T, -1, c.head_dim)
        v = v.view(B, T, -1, c.head_dim).transpose(1, 2)
        if self.backend == "triton":
            # each head's (1 + w) norm one kernel row, read in place (q: the first D of each 2D), then
            # the partial RoPE
            from fqkernels.rmsnorm import rmsnorm
            from fqkernels.rope_kv import partial_rope

            q = rmsnorm(q.reshape(B * T, -1, c.head_dim), self.w[p + "q_norm.weight"], c.rms_norm_eps, one_plus=True)
            k = rmsnorm(k.reshape(B * T, -1, c.head_dim), self.w[p + "k_norm.weight"], c.rms_norm_eps, one_plus=True)
            if positions is not None:
                q = partial_rope(q, self.cos, self.sin, positions=positions)
            else:
                cs, sn = (t.expand(B, T, -1).reshape(B * T, -1) for t in (cos, sin))
                q = partial_rope(q, cs, sn)
                k = partial_rope(k, cs, sn) if rope_k else k
            return q.view(B, T, -1, c.head_dim).transpose(1, 2), k.view(B, T, -1, c.head_dim).transpose(1, 2), v, gate
        q = _norm(q, self.w[p + "q_norm.weight"], c.rms_norm_eps).transpose(1, 2)
        k = _norm(k, self.w[p + "k_norm.weight"], c.rms_norm_eps).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v, gate

    def _qkv_proj(self, p: str, h: torch.Tensor):
        """An attention layer's q_proj (per head [query | gate]), k_proj and v_proj outputs
        [B, T, *]. On the triton backend from the packed q | k | v matrix: a decode-sized call
        (at most _Products.GEMV_MAX_ROWS rows) is one product, its columns split (views); a
        prompt pass runs cuBLAS on the pack's row slices, the separate products' shapes, so
        their bits. Three products on the references."""
        if self.backend != "triton":
            return tuple(self.ops.linear(h, self.w[p + f"{n}_proj.weight"]) for n in "qkv")
        c = self.cfg
        sizes = [2 * c.num_heads * c.head_dim, c.kv_size, c.kv_size]
        w = self.w[p + "qkv_proj.weight"]
        if h.numel() // h.shape[-1] <= _Products.GEMV_MAX_ROWS:
            return torch.split(self.ops.linear(h, w), sizes, dim=-1)
        return tuple(F.linear(h, part) for part in torch.split(w, sizes))

    def _attention_prefill(self, i: int, h, cos, sin, rows: slice, start: int = 0):
        B, S, _ = h.shape
        q, k, v, gate = self._qkv_gate(i, h, cos, sin)
        slot = self.attn_slot[i]
        if self.block_table is not None:
            write_pages(self.k_cache[slot], self.v_cache[slot], self.block_table[rows], k, v, start)
        else:
            self.k_cache[slot, rows, :, start:start + S], self.v_cache[slot, rows, :, start:start + S] = k, v
        if start:   # a continued prompt: the cached keys and these, the causal mask at the bottom right
            kc, vc = cached_kv(self.k_cache[slot], self.v_cache[slot], self.block_table, rows, start + S)
            mask = prefix_mask(start, start + S, h.device)
            if h.is_cuda:   # the memory-efficient kernel (flash takes no mask) on K/V repeated per query head
                group = q.shape[1] // kc.shape[1]
                with sdpa_kernel(SDPA_BACKENDS):
                    attn = F.scaled_dot_product_attention(q, expand_kv(kc, group), expand_kv(vc, group),
                                                          attn_mask=mask, scale=self.scale)
            else:
                attn = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=self.scale, enable_gqa=True)
            return self._attention_out(i, attn.transpose(1, 2), gate)
        # 5.17's sdpa path: no mask on an unpadded causal prompt, K/V heads shared by GQA
        # inside SDPA (enable_gqa), not repeated (repeating gives other bits on the CPU). The
        # backends named as the platform's torch 2.5.1 picks them: flash attention, never cuDNN's
        # (newer torch picks that first on sm90: other bits, and a plan built per batch shape,
        # ~0.5 s each time a server's group of prompts has a new size; fastqwen/numerics.py).
        with sdpa_kernel(SDPA_BACKENDS):
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return self._attention_out(i, attn.transpose(1, 2), gate)

    def _attention_step(self, i: int, h, cos, sin, positions, lengths):
        B = h.shape[0]
        slot = self.attn_slot[i]
        paged = self.block_table is not None
        # the first B rows: this call's sequences (paged: the layer's pools, read through the table)
        kc, vc = (self.k_cache[slot], self.v_cache[slot]) if paged else (self.k_cache[slot, :B], self.v_cache[slot, :B])
        table = {"block_table": self.block_table[:B]} if paged else {}
        if self.backend == "triton":
            from fqkernels.decode_attention import decode_attention
            from fqkernels.rope_kv import qk_norm_partial_rope_store, rope_store_kv

            c, p = self.cfg, f"model.layers.{i}.self_attn."
            # the packed q | k | v product, then one kernel: each q and k head's (1 + w) norm and
            # partial RoPE, the key and value into the caches at the positions
            # (past GEMV_MAX_ROWS rows _qkv_proj takes the separate products: the separate kernels then)
            q = None
            if B <= _Products.GEMV_MAX_ROWS:
                y = self.ops.linear(h, self.w[p + "qkv_proj.weight"]).view(B, -1)
                q = qk_norm_partial_rope_store(y, self.w[p + "q_norm.weight"], self.w[p + "k_norm.weight"],
                                               self.cos, self.sin, positions, kc, vc, c.rms_norm_eps, c.num_heads,
                                               c.num_kv_heads, **table)
            if q is not None:
                gate = y[:, :2 * c.num_heads * c.head_dim].view(B, 1, c.num_heads, 2 * c.head_dim)[..., c.head_dim:]
            else:   # this torch's order of the norm's mean is not the fused kernel's: the separate kernels
                q, k, v, gate = self._qkv_gate(i, h, None, None, rope_k=False, positions=positions)
                rope_store_kv(k[:, :, 0], v[:, :, 0], self.cos, self.sin, positions, kc, vc, **table)
                q = q[:, :, 0]
            if ATTN_GATE_IN_COMBINE:    # attn * sigmoid(gate) from the attention itself
                attn = decode_attention(q, kc, vc, lengths, self.scale, gate=gate[:, 0], **table)
                return self.ops.linear(attn.view(B, 1, -1), self.w[f"model.layers.{i}.self_attn.o_proj.weight"])
            attn = decode_attention(q, kc, vc, lengths, self.scale, **table)   # [B, H, D], lengths on device
            return self._attention_out(i, attn.unsqueeze(1), gate)
        q, k, v, gate = self._qkv_gate(i, h, cos, sin)
        rows = torch.arange(B, device=h.device)
        if paged:   # written into the pages at each row's position, then the rows gathered back as [B, KVH, C, D]
            pos, page = positions.long(), kc.shape[2]
            pages = self.block_table[:B].long()[rows, pos // page]
            kc[pages, :, pos % page] = k[:, :, 0]
            vc[pages, :, pos % page] = v[:, :, 0]
            kc, vc = cached_kv(kc, vc, self.block_table, slice(0, B), self.block_table.shape[1] * page)
        else:
            kc[rows, :, positions.long()] = k[:, :, 0]
            vc[rows, :, positions.long()] = v[:, :, 0]
        attn = sdpa_over_prefix(q, kc, vc, lengths, self.scale)
        return self._attention_out(i, attn.transpose(1, 2), gate)

    def _attention_out(self, i: int, attn, gate):
        """o_proj(attn * sigmoid(gate)), attn and gate [B, T, H, D] (views): on the triton backend
        one kernel reading both in place (swiglu.sigmoid_gate_mul, the torch ops' bits), on the
        torch backend the reference's ops on both flattened to [B, T, H * D]."""
        gate_mul = sigmoid_gate_mul if self.backend == "triton" else sigmoid_gate_mul_reference
        return self.ops.linear(gate_mul(attn, gate), self.w[f"model.layers.{i}.self_attn.o_proj.weight"])

    def _gdn(self, i: int, h: torch.Tensor, prompt_rows: slice | None, start: int = 0,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """GDN layer i over h: a prompt pass filling cache rows prompt_rows (start > 0: going on
        from the rows' conv and recurrent states), or (None) one decode step of the first B rows
        at `positions`."""
        prompt = prompt_rows is not None
        if not prompt and self.backend == "triton":
            return self._gdn_step_kernels(i, h, positions)
        c, p = self.cfg, f"model.layers.{i}.linear_attn."
        B, T, _ = h.shape
        slot = self.gdn_slot[i]
        rows = prompt_rows if prompt else slice(0, B)    # the cache rows of this call's sequences
        mixed, z, b, a = self._in_proj(p, h)                                        # mixed [B, T, conv_dim]
        conv_w = self.w[p + "conv1d.weight"].squeeze(1)
        kernels = prompt and self.backend == "triton"
        carried = not prompt or start > 0          # the rows' states go on (a decode step, a continued prompt)
        capture = self._capture if prompt else None
        if capture is not None:   # the conv's state after `cut` positions: the last conv_width inputs then
            cut, width = capture[0], c.conv_width
            if cut >= width:
                seen = mixed[:, cut - width:cut].transpose(1, 2)
            else:
                before = self.conv_state[slot, rows] if carried else torch.zeros_like(self.conv_state[slot, rows])
                seen = torch.cat([before[..., cut:], mixed[:, :cut].transpose(1, 2).to(before.dtype)], dim=-1)
            self.snap_conv[capture[1], slot] = seen.to(self.snap_conv.dtype)
        if kernels:   # in_proj's output read in place by the gates, the conv + SiLU and the gated norm
            g, beta = gdn.gates(a, b, self.w[p + "A_log"], self.w[p + "dt_bias"])
            mixed, new_conv = gdn.causal_conv_prefill(mixed, conv_w,
                                                      conv_state=self.conv_state[slot, rows] if carried else None)
        else:
            g, beta = gdn.gates_reference(a, b, self.w[p + "A_log"], self.w[p + "dt_bias"])
            mixed, new_conv = gdn.causal_conv_reference(mixed.transpose(1, 2), conv_w,
                                                        self.conv_state[slot, rows] if carried else None)
            mixed = mixed.transpose(1, 2)
        self.conv_state[slot, rows].copy_(new_conv)
        kd = c.linear_k_heads * c.linear_k_dim
        q, k, v = torch.split(mixed, [kd, kd, c.linear_v_heads * c.linear_v_dim], dim=-1)
        q, k = q.reshape(B, T, -1, c.linear_k_dim), k.reshape(B, T, -1, c.linear_k_dim)
        v = v.reshape(B, T, -1, c.linear_v_dim)
        if prompt:   # q, k heads shared by index (the kernels read them in place from the conv's rows),
            # the state written into its cache rows; the reference's ops on the torch backend, the fast
            # kernels on the triton backend, or with gdn.EXACT_PREFILL the kernels in the reference's
            # order (gdn_exact: its bits)
            if not kernels:
                rule = gdn.chunked_prefill_reference
            else:
                rule = gdn_exact.chunked_prefill_exact if gdn.EXACT_PREFILL else gdn.chunked_prefill
            if self.exact_decode:
                o = self._exact_decode_prompt(rule, slot, rows, q, k, v, g, beta, start, carried, capture)
            else:
                at = None if capture is None else (capture[0] // gdn.CHUNK, torch.empty_like(self.state[slot, rows]))
                o, _ = rule(q, k, v, g, beta, state_out=self.state[slot, rows],
                            initial_state=self.state[slot, rows] if carried else None, capture=at)
                if capture is not None:
                    self.snap_state[capture[1], slot] = at[1]
        elif self.exact_decode:     # the full forward's row on the reference's ops
            o = gdn_exact_step.reference_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], positions,
                                              self.state[slot, rows], self.rows[slot].narrow(0, B))[:, None]
        else:        # one decode step on the reference's ops (the triton backend's step: _gdn_step_kernels)
            q, k = gdn.expand_heads(q, c.linear_v_heads), gdn.expand_heads(k, c.linear_v_heads)
            o, state = gdn.delta_rule_recurrent_reference(q, k, v, g, beta, state=self.state[slot, rows])
            self.state[slot, rows].copy_(state)
        if kernels and c.linear_v_dim == 128:    # z's heads read in place from in_proj's rows
            o = gdn.gated_rmsnorm(o.reshape(-1, 128), z.reshape(B * T, -1), self.w[p + "norm.weight"], c.rms_norm_eps)
        else:
            o = gdn.gated_rmsnorm_reference(o.reshape(-1, c.linear_v_dim), z.reshape(-1, c.linear_v_dim),
                                            self.w[p + "norm.weight"], c.rms_norm_eps)
        return self.ops.linear(o.reshape(B, T, -1), self.w[p + "out_proj.weight"])

    def _exact_decode_prompt(self, rule, slot: int, rows: slice, q, k, v, g, beta, start: int, carried: bool,
                             capture) -> torch.Tensor:
        """A prompt pass's rule with exact decode on ([B, T, Hv, Dv] out): the positions before the
        prompt's first chunk boundary (a prompt going on inside a chunk) and after its last one go
        through the decode step one at a time, so the cache rows end as decode leaves them (the
        state at the last chunk's start and that chunk's rows so far); the whole chunks between
        through `rule`, the fast prompt rule, from the state the steps before left. A snapshot
        (capture: cut, indices) is taken at one of those chunks' boundaries."""
        C, T = gdn.CHUNK, v.shape[1]
        state = self.state[slot, rows]
        chunk_rows = self.rows[slot].narrow(rows.start, rows.stop - rows.start)
        step, kw = ((gdn_exact_step.fused_step, {"tile": self.decode_tile}) if self.backend == "triton"
                    else (gdn_exact_step.reference_step, {}))
        head = min(-start % C, T)
        body = (T - head) // C * C
        if capture is not None and (capture[0] - head) % C:
            raise ValueError(f"prefill_logits: with exact decode a snapshot must sit at a chunk boundary, not "
                             f"position {start + capture[0]}")
        if not carried and not body:
            state.zero_()
        parts = []
        if head:
            parts.append(gdn_exact_step.run_rows(step, q[:, :head], k[:, :head], v[:, :head], g[:, :head],
                                                 beta[:, :head], start, state, chunk_rows, **kw))
        if body:
            cut = None if capture is None else (capture[0] - head) // C
            at = None if cut is None or cut * C == body else (cut, torch.empty_like(state))
            part = slice(head, head + body)
            o, _ = rule(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state_out=state,
                        initial_state=state if carried else None, capture=at)
            parts.append(o)
            if capture is not None:
                self.snap_state[capture[1], slot] = state if at is None else at[1]
        if head + body < T:
            tail = slice(head + body, T)
            parts.append(gdn_exact_step.run_rows(step, q[:, tail], k[:, tail], v[:, tail], g[:, tail], beta[:, tail],
                                                 start + head + body, state, chunk_rows, **kw))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _in_proj(self, p: str, h: torch.Tensor):
        """A GDN layer's four input projections (qkv for the conv, z, b, a): one product of the
        packed matrix on the triton backend, four on the references."""
        if self.backend != "triton":
            return tuple(F.linear(h, self.w[p + f"in_proj_{n}.weight"]) for n in ("qkv", "z", "b", "a"))
        c = self.cfg
        sizes = [c.conv_dim, c.linear_v_heads * c.linear_v_dim, c.linear_v_heads, c.linear_v_heads]
        return torch.split(self.ops.linear(h, self.w[p + "in_proj.weight"]), sizes, dim=-1)

    def _gdn_step_kernels(self, i: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step of GDN layer i on the kernels: h [B, 1, hidden] -> [B, 1, hidden].
        The conv and recurrent states (exact decode: the chunk's rows) are updated in place."""
        c, p = self.cfg, f"model.layers.{i}.linear_attn."
        B = h.shape[0]
        slot = self.gdn_slot[i]
        conv_state, conv_w = self.conv_state[slot, :B], self.w[p + "conv1d.weight"].squeeze(1)
        w_in = self.w[p + "in_proj.weight"]
        # the conv and gates in the product's epilogue at batch 1: measured 25 us a step faster there,
        # and slower at batch 4 and 16 (the 4B's tensor-core tiles; PERF_LOG, session 13)
        config = self.ops.gemv_config(1, w_in) if FUSE_IN_PROJ and B == 1 else None
        if config is not None and config.split_k == 1:
            mixed, z, beta, g = gdn.in_proj_conv_gates_step(h[:, 0].contiguous(), w_in, conv_state, conv_w,
                                                            self.w[p + "A_log"], self.w[p + "dt_bias"],
                                                            c.linear_v_heads * c.linear_v_dim, config)
        else:
            mixed, z, b, a = self._in_proj(p, h[:, 0])      # column slices of one product: mixed [B, conv_dim]
            mixed, g, beta = gdn.conv_gates_step(mixed, conv_state, conv_w, a, b, self.w[p + "A_log"],
                                                 self.w[p + "dt_bias"])
        kd = c.linear_k_heads * c.linear_k_dim
        q, k, v = torch.split(mixed, [kd, kd, c.linear_v_heads * c.linear_v_dim], dim=-1)
        q, k, v = q.reshape(B, -1, c.linear_k_dim), k.reshape(B, -1, c.linear_k_dim), v.reshape(B, -1, c.linear_v_dim)
        step_norm = False
        if self.exact_decode:
            rows = self.rows[slot].narrow(0, B)
            # the gated norm in the step's own program (a program a head; the gated norm kernel's bits)
            step_norm = c.linear_v_dim == rows.block_v == 128 and (STEP_NORM == "1" or (
                STEP_NORM == "auto" and gdn_exact_step.norm_in_step(B, c.linear_v_heads, 128, 128, h.device)))
            o = gdn_exact_step.fused_step(q, k, v, g, beta, positions, self.state[slot, :B], rows,
                                          tile=self.decode_tile,
                                          norm=(z, self.w[p + "norm.weight"], c.rms_norm_eps) if step_norm else None)
        else:
            o = gdn.decode_step(q, k, v, g, beta, self.state[slot, :B])
        if not step_norm:
            if c.linear_v_dim == 128:        # the kernel's width; it reads z's heads in place
                o = gdn.gated_rmsnorm(o.reshape(-1, 128), z, self.w[p + "norm.weight"], c.rms_norm_eps)
            else:
                o = gdn.gated_rmsnorm_reference(o.reshape(-1, c.linear_v_dim), z.reshape(-1, c.linear_v_dim),
                                                self.w[p + "norm.weight"], c.rms_norm_eps)
        return self.ops.linear(o.reshape(B, 1, -1), self.w[p + "out_proj.weight"])


def sdpa_over_prefix(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lengths: torch.Tensor, scale: float):
    """The torch reference's decode attention: one query a sequence, q [B, H, 1, D], over its
    cached prefix, kc and vc [B, KVH, >= max(lengths), D] (K/V heads shared by GQA inside SDPA),
    unmasked when every sequence has the same length (always, in the engine's calls), as 5.17's
    cached step; a mask otherwise. Returns [B, H, 1, D]."""
    L = int(lengths.max())
    mask = None
    if int(lengths.min()) != L:
        mask = (torch.arange(L, device=q.device)[None, :] < lengths.long()[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, kc[:, :, :L], vc[:, :, :L], attn_mask=mask, scale=scale, enable_gqa=True)


class _TorchProducts:
    """The torch backend's products: cuBLAS (the reference's F.linear), nothing to tune."""

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def tune(self, weights, rows: int) -> dict:
        return {}


# The decode products of a Qwen3.5 checkpoint on the triton backend, by their weights' names
# (the packed ones: _pack); True where SiLU * up is fused into the product.
_DECODE_PRODUCTS = {"linear_attn.in_proj.weight": False, "linear_attn.out_proj.weight": False,
                    "self_attn.qkv_proj.weight": False, "self_attn.o_proj.weight": False,
                    "mlp.gate_up.weight": True, "mlp.down_proj.weight": False, "lm_head.weight": False}


class _Products:
    """The triton backend's products: our GEMV where `tune` found it faster than cuBLAS for
    that matrix at that many rows (the decode batch) or, with exact decode (gemv.EXACT, 7-32
    rows), where its config sums in the full forward's order, cuBLAS (F.linear) everywhere else,
    the prompt pass included. The choice is made before the decode step is captured."""

    GEMV_MAX_ROWS = 64

    def __init__(self):
        from fqkernels import gemv
        from fqkernels.swiglu import silu_mul

        self._gemv, self._silu_mul = gemv, silu_mul
        self.use_gemv = {}  # (fused SiLU, rows, N, K) -> bool

    def gemv_config(self, rows: int, w: torch.Tensor):
        """Our GEMV's config for w at `rows` rows where `linear` runs it, else None (cuBLAS)."""
        if not self.use_gemv.get((False, rows) + tuple(w.shape)):
            return None
        return self._gemv.select_config(w.shape[0], w.shape[1], False, rows)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w.T: our GEMV where tune chose it, else cuBLAS."""
        rows = x.numel() // x.shape[-1]
        if self.use_gemv.get((False, rows) + tuple(w.shape)):
            return self._gemv.linear(x.reshape(rows, -1).contiguous(), w).view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w)

    def linear_silu_mul(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) with the reference's cast points, w_gate_up = gate | up."""
        rows = x.numel() // x.shape[-1]
        if self.use_gemv.get((True, rows) + tuple(w_gate_up.shape)):
            out = self._gemv.linear_silu_mul(x.reshape(rows, -1).contiguous(), w_gate_up)
        else:
            out = self._silu_mul(F.linear(x.reshape(rows, -1), w_gate_up))
        return out.view(*x.shape[:-1], w_gate_up.shape[0] // 2)

    def tune(self, weights: dict, rows: int, reps: int = 5) -> dict:
        """For a decode batch of `rows`, time cuBLAS against our GEMV on every decode matrix
        (each over all layers' copies in one CUDA graph, so weights stream from HBM as in the
        step) and keep the faster. Returns {matrix: (cublas_us, gemv_us)}."""
        from fq_ops import _time_over

        if rows > self.GEMV_MAX_ROWS:
            return {}
        report = {}
        for suffix, fused in _DECODE_PRODUCTS.items():
            ws = [w for name, w in weights.items() if name.endswith(suffix)]
            if not ws:
                continue
            x = torch.randn(rows, ws[0].shape[1], device=ws[0].device).to(torch.bfloat16)
            if fused:
                ours, theirs = (lambda w: self._gemv.linear_silu_mul(x, w),
                                lambda w: self._silu_mul(F.linear(x, w)))
            else:
                ours, theirs = lambda w: self._gemv.linear(x, w), lambda w: F.linear(x, w)
            t_theirs = _time_over(theirs, ws, reps)
            try:
                t_ours = _time_over(ours, ws, reps)
            except Exception as exc:  # noqa: BLE001 - a GEMV that cannot run here leaves cuBLAS, said in the report
                report[suffix.rsplit(".", 1)[0]] = (round(t_theirs, 2), f"gemv failed: {type(exc).__name__}: {exc}"[:200])
                self.use_gemv[(fused, rows) + tuple(ws[0].shape)] = False
                continue
            # exact decode (gemv.EXACT, 7-32 rows, as the Qwen3 op set): an in-order GEMV sums as
            # the full forward's large-M product does, cuBLAS at decode rows does not; take it
            # whatever the times say
            exact = self._gemv.exact_rows(rows) and self._gemv.in_order(
                self._gemv.select_config(ws[0].shape[0], ws[0].shape[1], fused, rows))
            self.use_gemv[(fused, rows) + tuple(ws[0].shape)] = exact or t_ours < t_theirs
            report[suffix.rsplit(".", 1)[0]] = (round(t_theirs, 2), round(t_ours, 2))
        return report

"""Llama-family target forward (Llama 2/3, SmolLM2, Qwen2-style qkv bias) over a slot KV cache.

Weights are plain tensors with fused projections (q|k|v and gate|up, one matmul each) to keep
per-step operator count low: at batch 1 a decode step is bound by per-op overhead, not FLOPs.
The forward also hands out, with no extra pass, the EAGLE-3 auxiliary states (outputs of layers
`aux_layers`, concatenated) and the final post-norm state of every token it processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open

from tide.kernels import ops as kernel_ops
from tide.layers import (
    Linear,
    add_rms_norm,
    apply_rope,
    grouped_attention,
    pad_keys,
    rms_norm,
    rope_inv_freq,
    rope_table,
    silu_mul,
    tree_attention,
)
from tide.quant import quantized_linear
from tide.target import TargetFiles


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        # transformers 5 nests RoPE settings in `rope_parameters`; 4.x uses rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 has biases on q/k/v only; Llama's `attention_bias` adds them there too.
            attention_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def aux_layers(self) -> tuple[int, int, int]:
        """Layers whose outputs EAGLE-3 drafts consume: SGLang's and vLLM's default choice.

        Needs at least 4 layers (L - 4 >= 0); entries may repeat for small L (e.g. L = 6)."""
        n = self.num_layers
        if n < 4:
            raise ValueError(f"EAGLE-3 capture needs a target with >= 4 layers, this one has {n}")
        return (1, n // 2 - 1, n - 4)


@dataclass
class ForwardBatch:
    """One padded forward over B sequences with up to q new tokens each.

    positions[b, j] = start_b + j. Rows j >= new_tokens[b] are padding: computed, written into
    the cache beyond the sequence's length (harmless), and ignored by the caller.
    `kv_len` = max over b of (start_b + q): how much of each cache row attention reads.
    """

    input_ids: torch.Tensor  # [B, q] long
    positions: torch.Tensor  # [B, q] long
    slots: torch.Tensor  # [B] long, KV-cache rows
    kv_len: int
    mask: torch.Tensor | None  # [B, 1, q, kv_len] bool (True = attend) or None (batch 1 decode)
    slot_range: tuple[int, int] | None = None  # set when slots == range(a, b): cache read is a view
    logits_rows: torch.Tensor | None = None  # rows of the flattened [B*q] to compute logits for
    capture: bool = False  # also return aux + final states for every token
    # Set when the slots are not one range but lie within range(a, b) = `slot_span`, not too sparse:
    # decode/verify attention then reads the span as a view (every slot in it, in slot order) and
    # each sequence takes its row `slots - a`, instead of gathering its keys and values (a copy of
    # the batch's whole cache every layer: at batch 32 with 640 keys a step took 190 ms gathered,
    # 141 ms over the span, 117 ms with contiguous slots).
    slot_span: tuple[int, int] | None = None
    # Prompt tokens (the engine's prefill): with quantized weights they take the float projections
    # (LlamaModel.prefill_linears); without, this changes nothing.
    prefill: bool = False
    tree: TreeRows | None = None  # set for the verification of draft trees (ModelRunner.run_tree)


@dataclass
class TreeRows:
    """Where a tree-verification forward puts its rows (tide.engine.tree; one tree per sequence, a
    chain being a tree without branches).

    Row j of sequence b is tree node j (node 0, the root, is the sequence's pending token). Its RoPE
    position (`ForwardBatch.positions[b, j]`) is start_b + depth(j); its key and value go to cache
    index `cache_index[b, j]` = start_b + j, where no other node's go, and the forward's mask shows
    row j the cached tokens and its own ancestors only. tide.kernels' attention computes such a row
    over its visible keys moved together (compact_visible), so it gets the bits plain decoding of
    the node's path gets; without the kernels `tide.layers.tree_attention` places each node's path
    where plain decoding holds it. After verification the runner moves the accepted path's rows to
    start_b + depth (ModelRunner.keep_paths). For a chain, node j is at depth j: the plain
    verification layout."""

    cache_index: torch.Tensor  # [B, q] long
    paths: torch.Tensor  # [B, q, P] long: paths[b, j, a] = node at depth a on the path to node j (j past it)
    starts: torch.Tensor  # [B] long: each root's cache index (the sequence's cached length)


class KVCache:
    """Per-layer K/V tensors [slots, kv_heads, max_len, head_dim]; a sequence owns one slot.

    Rolling back rejected tokens is free: the owner just shortens the sequence's length, and
    later writes overwrite the stale positions.

    On CPU the cache is float32 whatever the model dtype: decode attention computes in float32
    (tide.layers.grouped_attention), and converting the gathered bf16 keys and values every layer
    of every step cost more than reading twice the bytes (batch-32 generation on the reference
    model: 394-398 vs 331-373 tok/s, same tokens). Storing a bf16 value as float32 is exact, so
    results are bit-identical; the cost is twice the cache memory.
    """

    def __init__(self, cfg: LlamaConfig, num_slots: int, max_len: int, dtype: torch.dtype, device) -> None:
        max_len = pad_keys(max_len)  # decode attention reads keys in whole blocks (tide.layers.pad_keys)
        shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        if torch.device(device).type == "cpu":
            dtype = torch.float32  # see the class docstring
        self.max_len = max_len
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


# Most rows one lm_head GEMM gets. On the Intel AMX machines (oneDNN bf16), a row's logits from a
# GEMM of 33 or more rows differ in the last bit from the same row in a GEMM of 1-32 rows (measured
# for the reference model's 49152 x 576 head: M = 1..32 agree, 33, 48, 64 do not). Verification
# of a batch (B x (γ + 1) rows) must give each row the bits plain decoding gives it, so larger row
# counts go in blocks of this many. On machines where every M agrees it costs one more pass over
# the head per 32 rows, only in verification of large batches.
LOGITS_BLOCK_ROWS = 32


def logits_head(weight: torch.Tensor) -> Linear:
    """The lm_head as `vocab_logits` uses it. float32 on CPU: MKL's GEMM (F.linear) gives a row
    other bits in a GEMM of 3 or more rows than of 2 on the Intel AMX machines (the reference
    49152 x 576 head from 16 rows on, a 256 x 64 head from 3), which would let verification diverge
    from plain decoding; oneDNN's pre-packed GEMM is row-invariant there (M = 2..64), at 7.1 vs
    5.4 ms for 2 rows of the reference head. bf16: whichever of F.linear and oneDNN's pre-packed
    GEMM is faster on this CPU, when the two give the same bits (`_faster_head`)."""
    if weight.dtype == torch.float32:
        return Linear(weight, pack_wide=True)
    return _faster_head(weight)


def _faster_head(weight: torch.Tensor) -> Linear:
    """Pre-packed (oneDNN) or F.linear for a bf16 head, timed here on 2 rows (a decode step's).
    The reference model's head on the Intel AMX machines: F.linear 3.5 ms, packed 4.2; on a Zen 4
    guest: F.linear 3.2 ms, packed 1.7. Both are row-invariant up to LOGITS_BLOCK_ROWS; packing is
    taken only if it gives F.linear's bits for 2 to LOGITS_BLOCK_ROWS rows of a probe, so the
    choice never changes a token. ~20 head passes once per model load. Where tide.kernels' bf16
    GEMM serves (Linear's first choice), it serves the head too: no choice to make."""
    plain = Linear(weight)
    if plain.row_exact:
        return plain
    packed = Linear(weight, pack_wide=True)
    if packed.packed is None or plain.packed is not None:
        return plain
    shuffle = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(0))  # not the global RNG
    probe = torch.linspace(-2, 2, LOGITS_BLOCK_ROWS * weight.shape[1]).reshape(LOGITS_BLOCK_ROWS, -1)[:, shuffle]
    probe = probe.to(weight.dtype)
    with torch.inference_mode():
        for m in (2, 3, 8, LOGITS_BLOCK_ROWS):
            if not torch.equal(plain(probe[:m]), packed(probe[:m])):
                return plain
        rows = probe[:2]
        best = {}
        for name, lin in (("plain", plain), ("packed", packed)):
            lin(rows)  # warm-up
            t0 = time.perf_counter()
            for _ in range(5):
                lin(rows)
            best[name] = time.perf_counter() - t0
    return packed if best["packed"] < best["plain"] else plain


def vocab_logits(rows: torch.Tensor, head) -> torch.Tensor:
    """rows [R, H] @ head[V, H].T in GEMMs of 2 to LOGITS_BLOCK_ROWS rows (batch-invariant). A lone
    row goes as two, as in the projections (see Linear): MKL's float32 GEMV rounds differently
    from its GEMM. A `row_exact` head takes any number of rows in one GEMM."""
    row_exact = getattr(head, "row_exact", False)
    if rows.shape[0] == 1 and rows.device.type == "cpu" and not row_exact:
        return head(rows.expand(2, -1))[:1]
    R = rows.shape[0]
    if R <= LOGITS_BLOCK_ROWS or row_exact:
        return head(rows)
    starts = list(range(0, R, LOGITS_BLOCK_ROWS))
    if R - starts[-1] == 1:  # never a block of one row (the GEMV path): end on 2
        starts[-1] -= 1
    return torch.cat([head(rows[a:b]) for a, b in zip(starts, [*starts[1:], R], strict=True)])


class LlamaModel:
    """The target model: weights + a forward over the slot cache."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device,
                 weight_format: str = "float") -> None:
        """`weight_format`: "float" (weights in `dtype`), or "int8" / "int4" (tide.quant, on CPU: the
        projections stored narrow, and with int8 the lm_head; the embedding and norms stay in `dtype`)."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.weight_format = weight_format
        quantized = weight_format != "float"
        if quantized and self.device.type != "cpu":
            raise ValueError(f"{weight_format} weights run on CPU kernels only, not on {self.device}")

        converted: dict[str, torch.Tensor] = {}

        def tensor(name: str) -> torch.Tensor:  # one copy per name: a tied lm_head shares the embedding's
            if name not in converted:
                converted[name] = weights[name].to(device=device, dtype=dtype)
            return converted[name]

        def linear(names: list[str], bias_names: list[str] | None = None, head: bool = False, fmt: str = "float"):
            # Quantize from the checkpoint's own values (float32 for a converted GGUF), not from a
            # bf16 rounding of them; float weights are concatenated in `dtype`. With int4 the
            # lm_head stays in `dtype`, as AWQ and GPTQ keep it: in 4-bit groups the reference
            # model's head (Q8_0 in its GGUF) changed 9 % of next-token argmaxes (tide bench weights).
            bias = torch.cat([tensor(n) for n in bias_names]) if bias_names else None
            if fmt != "float" and not (head and fmt == "int4"):
                return quantized_linear(torch.cat([weights[n].float() for n in names]), bias, fmt, dtype)
            w = tensor(names[0]) if len(names) == 1 else torch.cat([tensor(n) for n in names])
            return logits_head(w) if head else Linear(w, bias, keep_weight=False)

        self.embed = tensor("model.embed_tokens.weight")
        self.norm = tensor("model.norm.weight")
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings or "lm_head.weight" not in weights \
            else "lm_head.weight"
        self.head = linear([head_name], head=True, fmt=weight_format)
        self.lm_head = getattr(self.head, "weight", None)  # [V, H] in `dtype` when the head is not quantized
        # Per layer (ln1, qkv, o, ln2, gate|up, down): the projections decode and verification use.
        self.layers = []
        # With quantized weights, prompts (ForwardBatch.prefill) go through float copies of the
        # projections and head: the CPU kernels widen the weights for every row, so a 500-token
        # prompt ran ~6x slower than in bf16 (time to first token 2.5 s against 0.5 s at 16 streams),
        # while decoding, one weight pass a step, gains 1.5-1.9x. A prompt token never takes the
        # decode path or the reverse, so plain decoding and verification still see the same bits.
        self.prefill_linears: list[tuple] = []
        self.prefill_head = linear([head_name], head=True) if quantized else self.head
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{x}_proj" for x in ("q", "k", "v")]
            names = ([n + ".weight" for n in attn], [p + "self_attn.o_proj.weight"],
                     [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [p + "mlp.down_proj.weight"])
            bias = [n + ".bias" for n in attn] if cfg.attention_bias else None
            qkv, o, gate_up, down = (linear(n, bias if j == 0 else None, fmt=weight_format)
                                     for j, n in enumerate(names))
            self.layers.append((tensor(p + "input_layernorm.weight"), qkv, o,
                                tensor(p + "post_attention_layernorm.weight"), gate_up, down))
            if quantized:
                self.prefill_linears.append(tuple(linear(n, bias if j == 0 else None) for j, n in enumerate(names)))
        # A lone decode row goes through the projections as two (see `forward`) unless every one of
        # them gives a row the same bits whatever the row count (the quantized kernels, and
        # tide.kernels' bf16 GEMM: `row_exact`).
        self._pair_single_row = self.device.type == "cpu" and not all(
            getattr(lin, "row_exact", False) for layer in self.layers for lin in layer[1:3] + layer[4:])
        # Each layer's projections as tide.kernels' decode_layer takes them, where all four run on
        # the kernels (then a decode or verification layer is one call: see `forward`).
        self._layer_args = self._kernel_layer_args([layer[1:3] + layer[4:] for layer in self.layers])
        self._prefill_layer_args = self._kernel_layer_args(self.prefill_linears) if quantized else self._layer_args
        # Whether decoding's projections run on tide.kernels' GEMMs (then on the kernels' own threads:
        # ModelRunner.decode_threads).
        self.projections_on_kernels = self._layer_args is not None
        self._inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.ensure_positions(cfg.max_position_embeddings)
        self._aux = cfg.aux_layers if cfg.num_layers >= 4 else ()

    @staticmethod
    def _kernel_layer_args(layers) -> list[tuple] | None:
        args = [tuple(getattr(lin, "kernel_args", None) for lin in projections) for projections in layers]
        return args if args and all(a is not None for layer in args for a in layer) else None

    def ensure_positions(self, n: int) -> None:
        """Make the RoPE tables cover positions [0, n) (the cache may hold slack rows past the context)."""
        if getattr(self, "cos", None) is not None and self.cos.shape[0] >= n:
            return
        cos, sin = rope_table(self._inv_freq, n)
        self.cos, self.sin = cos.to(device=self.device, dtype=self.dtype), sin.to(device=self.device, dtype=self.dtype)

    @classmethod
    def load(cls, target: TargetFiles, dtype: torch.dtype = torch.bfloat16, device="cpu",
             weight_format: str = "float") -> LlamaModel:
        cfg = LlamaConfig.from_hf(target.config)
        weights: dict[str, torch.Tensor] = {}
        for file in target.safetensors_files():
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    weights[name] = f.get_tensor(name)
        return cls(cfg, weights, dtype, device, weight_format)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(self.cfg, num_slots, max_len, self.dtype, self.device)

    # Up to this many query tokens per sequence use `grouped_attention` (decode and verify);
    # longer forwards (prefill) use SDPA's flash kernel unless the kernels' attention is built.
    SMALL_Q = 16

    def _grouped_prefill(self, fused) -> bool:
        """Prompt chunks take the kernels' attention where their projections are on the kernels too
        (then a prompt runs on the kernels' threads alone: ModelRunner.prefill_threads)."""
        return fused is not None and fused.has_decode_attention and self._prefill_layer_args is not None

    @property
    def split_invariant_prefill(self) -> bool:
        """Whether a prompt token's KV entries and states are the same bits wherever its prompt's
        chunks were cut: every prompt projection is row-exact (tide.kernels' GEMMs: a row's output
        never depends on the other rows) and attention is tide.kernels' (each query row computed on
        its own over its visible keys). SDPA's flash kernel blocks by shape, so without the kernels
        only prompts cut at the same places agree. The prefix cache (tide.engine.scheduler) reuses
        a cached prefix at any token where this holds, and at whole prefill chunks elsewhere."""
        if self.device.type != "cpu" or not self._grouped_prefill(kernel_ops()):
            return False
        layers = self.prefill_linears or [layer[1:3] + layer[4:] for layer in self.layers]
        return all(getattr(lin, "row_exact", False) for layer in layers for lin in layer)

    @property
    def decode_matches_prefill(self) -> bool:
        """Whether a token fed by decoding (or verification) leaves the KV entries a prompt chunk
        would: prefill split-invariant and the same projections both ways (quantized weights take
        float projections for prompts: LlamaModel.prefill_linears)."""
        return self.split_invariant_prefill and not self.prefill_linears

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, cache: KVCache):
        """Return (logits [R, V] for `fb.logits_rows` (all rows if None), final [B, q, H] post-norm
        states or None, aux [B, q, 3H] or None)."""
        cfg = self.cfg
        B, q = fb.input_ids.shape
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # A lone row (batch-1 decode) goes through the projections as two identical rows: oneDNN's
        # single-row GEMV path rounds differently from the GEMM path every M >= 2 shares, and
        # plain decoding must give the bits verification (several rows) gives. Padding the stream
        # here costs one copy per layer (the attention output) instead of one per projection.
        pair = B * q == 1 and self._pair_single_row
        x = F.embedding(fb.input_ids.expand(1, 2) if pair else fb.input_ids, self.embed)
        cos_rows, sin_rows = self.cos[fb.positions], self.sin[fb.positions]  # [B, q, hd]
        cos, sin = cos_rows.unsqueeze(1), sin_rows.unsqueeze(1)  # [B, 1, q, hd]
        # RoPE and the cache writes as one kernel (tide.kernels) where the cache is the CPU's float32 one
        fused = kernel_ops() if self.device.type == "cpu" and cache.k[0].dtype == torch.float32 else None
        tree = fb.tree
        small = q <= self.SMALL_Q or tree is not None
        # Prompt chunks too take the kernels' attention where it is built (`split_invariant_prefill`).
        grouped = small or self._grouped_prefill(fused)
        bias = None
        kv_len = fb.kv_len
        span = fb.slot_span if small and fb.slot_range is None and tree is None else None
        write_at = fb.positions if tree is None else tree.cache_index  # cache index of each row's key and value
        if grouped:
            kv_len = pad_keys(kv_len)
            if fb.mask is not None or kv_len != fb.kv_len:
                visible = fb.mask[:, 0] if fb.mask is not None else torch.ones((B, q, fb.kv_len), dtype=torch.bool)
                visible = F.pad(visible, (0, kv_len - fb.kv_len), value=False)
                bias = torch.zeros(visible.shape, dtype=torch.float32, device=x.device)
                bias = bias.masked_fill_(~visible.to(x.device), float("-inf"))  # [B, q, L]
            if span is not None:
                rows = fb.slots - span[0]  # each sequence's row in the span
                span_bias = torch.zeros((span[1] - span[0], q, kv_len), dtype=torch.float32, device=x.device)
                span_bias[rows] = bias if bias is not None else 0.0  # rows of idle slots: garbage in, ignored
                bias = span_bias
        single = B == 1 and fb.slot_range is not None and fused is None and tree is None  # torch-op cache write
        if single:
            s0, p0 = fb.slot_range[0], int(fb.positions[0, 0])
        a, b = fb.slot_range or span or (0, 0)
        aux: dict[int, torch.Tensor] = {}
        prefill_float = fb.prefill and bool(self.prefill_linears)
        # Few query tokens a sequence, every projection on the kernels: one kernel call a layer
        # (tide.kernels' decode_layer: the same kernels in the same order as the loop below).
        layer_args = self._prefill_layer_args if prefill_float else self._layer_args
        one_call = (fused is not None and small and span is None and not pair and layer_args is not None
                    and fused.has_decode_attention and x.dtype == torch.bfloat16)
        slot_lo, slot_hi = fb.slot_range or (-1, -1)
        # Each residual add is fused with the norm after it (add_rms_norm): the MLP's output waits
        # in `delta` for the next layer's input norm, or the final norm.
        delta = None
        for i, (ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj) in enumerate(self.layers):
            if one_call:
                x, delta = fused.decode_layer(x, delta, ln1, ln2, cfg.rms_norm_eps, *layer_args[i], cache.k[i],
                                              cache.v[i], cos_rows, sin_rows, fb.slots, write_at, slot_lo,
                                              slot_hi, kv_len, bias, nh, nkv)
                if fb.capture and i in self._aux:
                    x, delta = x + delta, None
                    aux[i] = x
                continue
            if prefill_float:
                qkv_proj, o_proj, gate_up_proj, down_proj = self.prefill_linears[i]
            if delta is None:
                h = rms_norm(x, ln1, cfg.rms_norm_eps)
            else:
                x, h = add_rms_norm(x, delta, ln1, cfg.rms_norm_eps)
            qkv = qkv_proj(h)[:, :1] if pair else qkv_proj(h)
            kc, vc = cache.k[i], cache.v[i]
            if fused is not None:  # the same bits as the torch ops below, in one pass
                qh = fused.rope_kv_cache(qkv, cos_rows, sin_rows, kc, vc, fb.slots, write_at, nh, nkv)
            else:
                # RoPE on q and k heads together: one rotation for both.
                qk = apply_rope(qkv[..., :(nh + nkv) * hd].view(B, q, nh + nkv, hd).transpose(1, 2), cos, sin)
                qh, kh = qk[:, :nh], qk[:, nh:]
                vh = qkv[..., (nh + nkv) * hd:].view(B, q, nkv, hd).transpose(1, 2)
                if single:
                    kc[s0, :, p0:p0 + q] = kh[0]
                    vc[s0, :, p0:p0 + q] = vh[0]
                else:
                    kc[fb.slots[:, None], :, write_at] = kh.transpose(1, 2).to(kc.dtype)
                    vc[fb.slots[:, None], :, write_at] = vh.transpose(1, 2).to(vc.dtype)
            if fb.slot_range is not None or span is not None:
                keys, values = kc[a:b, :, :kv_len], vc[a:b, :, :kv_len]
            else:
                keys, values = kc[fb.slots, :, :kv_len], vc[fb.slots, :, :kv_len]
            if tree is not None:
                attn = tree_attention(qh, keys, values, bias, fb.positions, tree.paths, tree.starts)
            elif span is not None:
                q_span = qh.new_zeros((b - a, *qh.shape[1:]))
                q_span[rows] = qh
                attn = grouped_attention(q_span, keys, values, bias)[rows]
            elif grouped:
                attn = grouped_attention(qh, keys, values, bias)
            else:
                attn = F.scaled_dot_product_attention(qh, keys.to(qh.dtype), values.to(qh.dtype), attn_mask=fb.mask,
                                                      enable_gqa=nkv != nh)
            attn = attn.transpose(1, 2).reshape(B, q, nh * hd)
            x, h = add_rms_norm(x, o_proj(attn.expand(1, 2, -1).contiguous() if pair else attn), ln2,
                                cfg.rms_norm_eps)
            delta = down_proj(silu_mul(gate_up_proj(h)))
            if fb.capture and i in self._aux:
                x, delta = x + delta, None
                aux[i] = x[:, :1] if pair else x
        if delta is None:
            final = rms_norm(x, self.norm, cfg.rms_norm_eps)
        else:
            x, final = add_rms_norm(x, delta, self.norm, cfg.rms_norm_eps)
        final = final[:, :1] if pair else final
        flat = final.view(B * q, -1)
        rows = flat if fb.logits_rows is None else flat.index_select(0, fb.logits_rows)
        logits = vocab_logits(rows, self.prefill_head if fb.prefill else self.head)
        if not fb.capture:
            return logits, None, None
        if len(self._aux) != 3:
            raise ValueError("hidden-state capture needs a target with >= 4 layers")
        return logits, final, torch.cat([aux[i] for i in self._aux], dim=-1)

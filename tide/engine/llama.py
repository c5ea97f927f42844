"""The target forward over a slot KV cache, for every family tide.engine.families describes
(Llama 2/3.x, SmolLM2, Mistral, Qwen 2/2.5/3, Gemma 2/3, Phi-3, OLMo 2): one generic forward,
the families' differences read from a per-architecture description and the checkpoint's config.

Weights are plain tensors with fused projections (q|k|v and gate|up, one matmul each) to keep
per-step operator count low: at batch 1 a decode step is bound by per-op overhead, not FLOPs.
The forward also hands out, with no extra pass, the EAGLE-3 auxiliary states (outputs of layers
`aux_layers`, concatenated) and the final post-norm state of every token it processes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tide.allocator import zeros_on_demand
from tide.engine.families import LLAMA, Family, UnsupportedModel, family_for, layer_types
from tide.kernels import ops as kernel_ops
from tide.layers import (
    Linear,
    add_rms_norm,
    apply_rope,
    eager_attention,
    grouped_attention,
    pad_keys,
    rms_norm,
    rope_attention_factor,
    rope_inv_freq,
    rope_table,
    silu_mul,
    tree_attention,
)
from tide.quant import Int8Linear, quantized_linear
from tide.target import TargetFiles
from tide.tensor_mapping import TensorMapping


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
    # What the family description and the config add (the defaults are Llama's).
    architecture: str = "LlamaForCausalLM"
    family: Family = LLAMA
    layer_types: tuple[str, ...] = ()  # "full_attention" / "sliding_attention" per layer; () = all full
    sliding_window: int | None = None  # a sliding layer's query sees keys at positions > its own - this
    local_rope: tuple[float, dict | None] | None = None  # (theta, scaling) of sliding layers (Gemma 3)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    attn_scale: float | None = None  # query_pre_attn_scalar ** -0.5 (Gemma) where not head_dim ** -0.5
    activation: str = "silu"  # "silu" or "gelu_tanh" of the gate, times up

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        arch, family = family_for(cfg)
        eos = cfg.get("eos_token_id")
        if cfg.get("text_config"):  # multimodal Gemma 3: its text decoder's config
            cfg = {**cfg["text_config"], "architectures": [arch]}
        # transformers 5 nests RoPE settings in `rope_parameters` (keyed by layer type for Gemma 3);
        # 4.x uses rope_theta / rope_scaling (and Gemma 3's rope_local_base_freq).
        params = dict(cfg.get("rope_parameters") or {})
        local_rope = None
        if family.rope_per_layer_type and "full_attention" in params:
            local = dict(params.get("sliding_attention") or {})
            params = dict(params["full_attention"])
            local_rope = _rope(cfg, local)
        elif family.rope_per_layer_type:
            local_rope = (float(cfg.get("rope_local_base_freq", 10000.0)), None)
        theta, scaling = _rope(cfg, params)
        heads = int(cfg["num_attention_heads"])
        if eos is None:
            eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        n_layers = int(cfg["num_hidden_layers"])
        types = layer_types(cfg, family, n_layers)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") is not False else None
        if window is None or "sliding_attention" not in types:
            types, window = (), None
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                      "gelu_new": "gelu_tanh"}.get(act)
        if activation is None:
            raise UnsupportedModel(f"{arch}: activation {act!r} (the engine has silu and gelu-tanh)")
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        qpas = cfg.get("query_pre_attn_scalar")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 has biases on q/k/v only; Llama's `attention_bias` adds them there too.
            attention_bias=bool(cfg.get("attention_bias", False)) or family.qkv_bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            family=family,
            layer_types=types,
            sliding_window=int(window) if window is not None else None,
            local_rope=local_rope,
            attn_softcap=_float_or_none(cfg.get("attn_logit_softcapping")),
            final_softcap=_float_or_none(cfg.get("final_logit_softcapping")),
            attn_scale=float(qpas) ** -0.5 if qpas is not None and float(qpas) != head_dim else None,
            activation=activation,
        )

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def aux_layers(self) -> tuple[int, int, int]:
        """Layers whose outputs EAGLE-3 drafts consume: SGLang's and vLLM's default choice.

        Needs at least 4 layers (L - 4 >= 0); entries may repeat for small L (e.g. L = 6)."""
        n = self.num_layers
        if n < 4:
            raise ValueError(f"EAGLE-3 capture needs a target with >= 4 layers, this one has {n}")
        return (1, n // 2 - 1, n - 4)


def _float_or_none(x) -> float | None:
    return None if x is None else float(x)


def _rope(cfg: dict, params: dict) -> tuple[float, dict | None]:
    """(theta, scaling or None) from a rope_parameters dict (transformers 5) or the 4.x fields, with
    the config-level values a scaling reads filled in (original_max_position_embeddings: Phi-3 keeps
    it beside rope_scaling; the factor of YaRN and LongRoPE when omitted: max / original)."""
    params = dict(params)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise UnsupportedModel(f"{cfg.get('architectures')}: partial rotary embeddings (partial_rotary_factor "
                               f"< 1) are missing from the engine's RoPE")
    scaling = dict(cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else {}))
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return theta, None
    if "original_max_position_embeddings" not in scaling and cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if scaling.get("factor") is None and scaling.get("original_max_position_embeddings"):
        scaling["factor"] = cfg.get("max_position_embeddings", 4096) / scaling["original_max_position_embeddings"]
    return theta, scaling


@dataclass(frozen=True)
class LayerExtras:
    """What a family adds to a decoder layer: q/k RMSNorm weights ([head_dim] per head, or the
    whole projection's for OLMo 2) and post-norms of the attention's and the MLP's outputs."""

    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    attn_out: torch.Tensor | None
    mlp_out: torch.Tensor | None

    @property
    def empty(self) -> bool:
        return all(t is None for t in (self.q_norm, self.k_norm, self.attn_out, self.mlp_out))


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


def kv_cache_dtype(model_dtype: torch.dtype, device, head_dim: int) -> torch.dtype:
    """The KV cache's element type for a model computing in `model_dtype` on `device`.

    On CPU, bf16 where the model computes in bf16 and tide.kernels' attention is built and takes
    the head size (a multiple of 16, at most 256: tide.layers._kernel_attention): its keys
    and values are bf16 already (the projections' and RoPE's outputs), so bf16 holds them exactly,
    and the kernels widen them to float32 in registers, so results are the bits a float32 cache
    gives, at half the memory (docs/results/model-sizes: the memory beside llama-server's f16
    cache). Else float32: decode attention on torch ops computes in float32 (tide.layers.
    grouped_attention), and converting the gathered bf16 keys and values every layer of every step
    cost more than reading twice the bytes (batch-32 generation on the reference model: 394-398 vs
    331-373 tok/s, same tokens). Elsewhere (GPU) the model dtype."""
    if torch.device(device).type != "cpu":
        return model_dtype
    kern = kernel_ops()
    if (model_dtype == torch.bfloat16 and kern is not None and kern.has_decode_attention
            and head_dim % 16 == 0 and head_dim <= 256):
        return torch.bfloat16
    return torch.float32


class KVCache:
    """Per-layer K/V tensors [slots, kv_heads, max_len, head_dim]; a sequence owns one slot.

    Rolling back rejected tokens is free: the owner just shortens the sequence's length, and
    later writes overwrite the stale positions. The element type is `kv_cache_dtype`'s.
    """

    def __init__(self, cfg: LlamaConfig, num_slots: int, max_len: int, dtype: torch.dtype, device) -> None:
        max_len = pad_keys(max_len)  # decode attention reads keys in whole blocks (tide.layers.pad_keys)
        shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        dtype = kv_cache_dtype(dtype, device, cfg.head_dim)
        self.max_len = max_len
        # Held as written (tide.allocator.zeros_on_demand): a cache sized for every slot's full context
        # takes memory for the tokens cached (docs/results/model-sizes, "every slot full").
        self.k = [zeros_on_demand(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.v = [zeros_on_demand(shape, dtype, device) for _ in range(cfg.num_layers)]

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
    # Where the kernel serves, only its packed copy is kept: an untied head's [V, H] tensor would
    # be a second copy (101 MB at the 0.5B Llama shape, 403 MB at 8B in bf16); a tied one stays the embedding's.
    plain = Linear(weight, keep_weight=False)
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


def _gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up from a fused gate|up output (Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


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


PREFILL_WEIGHTS = ("auto", "float", "shared")
# "auto" keeps float copies of quantized projections for prompts while they take at most this
# share of the memory available at load: a 1.5B model's bf16 copies (3 GB) on a 24 GB machine, not
# a 3B's or an 8B's (6 and 16 GB), which leave the KV cache and the rest of the stack too little.
PREFILL_COPY_SHARE = 0.25


def prefill_copy_bytes(cfg: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes of float copies of every projection and the lm_head in `dtype`."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return (cfg.num_layers * per_layer + cfg.vocab_size * h) * dtype.itemsize


def prefill_weights_for(choice: str, cfg: LlamaConfig, dtype: torch.dtype, weight_format: str = "int8") -> str:
    """"float" or "shared" for `choice` (see LlamaModel). "auto": "shared" for int8 weights where
    tide.kernels' GEMM widens each weight tile once for a prompt's rows (`int8_prompts_widened`,
    the AVX512_BF16 path: 512-token prompts at 0.96x the bf16 copies' speed with a third of the
    weight memory, docs/results/model-sizes); else "float" unless the copies would take more than
    PREFILL_COPY_SHARE of the memory available now (unknown: "float"). int4 prompts on torch's
    int4 kernel ran at 0.45x the copies' speed."""
    if choice not in PREFILL_WEIGHTS:
        raise ValueError(f"prefill weights must be one of {PREFILL_WEIGHTS}, got {choice!r}")
    if choice != "auto":
        return choice
    kern = kernel_ops()
    if weight_format == "int8" and kern is not None and getattr(kern, "int8_prompts_widened", False):
        return "shared"
    from tide.memory import available_bytes

    found = available_bytes()
    return "float" if found is None or prefill_copy_bytes(cfg, dtype) <= PREFILL_COPY_SHARE * found[0] else "shared"


# TIDE_WEIGHTS=auto serves float weights (the compute dtype) while they take at most this share of
# the memory available at load, else int8, else int4: an 8B model's bf16 weights (15 GB) on a
# 24 GB machine leave too little for the KV cache and the rest of the stack; its int8 (7.5 GB) do not.
AUTO_FLOAT_SHARE = 0.5


def auto_weight_format(cfg: LlamaConfig, dtype: torch.dtype, device) -> str:
    """"float", "int8" or "int4" for TIDE_WEIGHTS=auto (see AUTO_FLOAT_SHARE): off the CPU, and
    where the memory is unknown, "float"."""
    from tide import quant
    from tide.memory import available_bytes

    found = available_bytes()
    if torch.device(device).type != "cpu" or found is None:
        return "float"
    budget = AUTO_FLOAT_SHARE * found[0]
    float_bytes = prefill_copy_bytes(cfg, dtype) + cfg.vocab_size * cfg.hidden_size * dtype.itemsize  # + embedding
    for fmt, share in (("float", 1.0), ("int8", 0.5), ("int4", 0.25)):  # of the float bytes, roughly
        if float_bytes * share <= budget and (fmt == "float" or quant.supported(fmt)):
            return fmt
    return "int4"


class RenamedTensors(TensorMapping):
    """`source`'s tensors under other names (new -> source name), read at each access."""

    def __init__(self, source: Mapping[str, torch.Tensor], names: dict[str, str]) -> None:
        self._source, self._names = source, names

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._source[self._names[name]]

    def q8_0_rows(self, name: str) -> torch.Tensor | None:
        """The source's raw Q8_0 rows of `name` (a GGUF file's: tide.gguf_tensors), else None."""
        rows = getattr(self._source, "q8_0_rows", None)
        return None if rows is None else rows(self._names[name])


class LlamaModel:
    """The target model: weights + a forward over the slot cache."""

    def __init__(self, cfg: LlamaConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device,
                 weight_format: str = "float", prefill_weights: str = "auto") -> None:
        """`weight_format`: "float" (weights in `dtype`), or "int8" / "int4" (tide.quant, on CPU: the
        projections stored narrow, and with int8 the lm_head; the embedding and norms stay in `dtype`).
        `prefill_weights` (quantized weights only): "float" keeps float copies of the projections for
        prompts, "shared" runs prompts on the quantized ones, "auto" keeps the copies where they fit
        (`prefill_weights_for`)."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.weight_format = weight_format
        quantized = weight_format != "float"
        if quantized and self.device.type != "cpu":
            raise ValueError(f"{weight_format} weights run on CPU kernels only, not on {self.device}")
        self.prefill_weights = (prefill_weights_for(prefill_weights, cfg, dtype, weight_format) if quantized
                                else "shared")
        copies = self.prefill_weights == "float"

        converted: dict[str, torch.Tensor] = {}
        q8_0_rows = getattr(weights, "q8_0_rows", None)

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
            if fmt == "int8" and q8_0_rows is not None:  # int8 from a Q8_0 file: no float values
                raws = [q8_0_rows(n) for n in names]
                if all(r is not None for r in raws):
                    return Int8Linear.from_q8_0(raws, bias, dtype)
            if fmt != "float" and not (head and fmt == "int4"):
                return quantized_linear(torch.cat([weights[n].float() for n in names]), bias, fmt, dtype)
            if head:  # through `tensor`: a tied head is the embedding's storage
                return logits_head(tensor(names[0]))
            # Projections are converted here, not kept by `tensor`: a kept copy of each would double
            # a float model's memory until the load ends.
            parts = [weights[n].to(device=device, dtype=dtype) for n in names]
            return Linear(parts[0] if len(parts) == 1 else torch.cat(parts), bias, keep_weight=False)

        fam = cfg.family

        def norm(name: str | None) -> torch.Tensor | None:  # an RMSNorm weight as rms_norm takes it
            if name is None:
                return None
            if fam.norm_offset == 0.0:
                return tensor(name)
            # Gemma's zero-centred weights scale by (1 + w): added once here, in float32, then rounded.
            return (weights[name].float() + fam.norm_offset).to(device=device, dtype=dtype)

        self.embed = tensor("model.embed_tokens.weight")
        self.norm = norm("model.norm.weight")
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings or "lm_head.weight" not in weights \
            else "lm_head.weight"
        self.head = linear([head_name], head=True, fmt=weight_format)
        # Per layer (ln1, qkv, o, ln2, gate|up, down): the projections decode and verification use.
        self.layers = []
        # With quantized weights, prompts (ForwardBatch.prefill) may go through float copies of the
        # projections and head (`prefill_weights_for` decides): int4's torch kernel ran 512-token
        # prompts at 0.45x the copies' speed, while decoding, one weight pass a step, gains 1.5-1.9x.
        # A prompt token never takes the decode path or the reverse, so plain decoding and
        # verification still see the same bits. Where the copies do not fit (an 8B model's are 16 GB
        # in bf16), or the int8 kernel serves prompts near bf16 speed, prompts share the quantized ones.
        self.prefill_linears: list[tuple] = []
        self.prefill_head = linear([head_name], head=True) if copies else self.head
        # Per layer, what the family adds to the Llama layer (q/k norms, post-norms), or None.
        self.extras: list[LayerExtras | None] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = [p + n for n in fam.qkv]
            names = ([n + ".weight" for n in attn], [p + "self_attn.o_proj.weight"],
                     [p + n + ".weight" for n in fam.gate_up], [p + "mlp.down_proj.weight"])
            bias = [n + ".bias" for n in attn] if cfg.attention_bias else None
            qkv, o, gate_up, down = (linear(n, bias if j == 0 else None, fmt=weight_format)
                                     for j, n in enumerate(names))
            role = {r: p + n + ".weight" for r, n in fam.norms.items()}
            # ln1 / ln2: the attention's and the MLP's pre-norms (None for OLMo 2's post-norm layers).
            self.layers.append((norm(role.get("attn_in")), qkv, o, norm(role.get("mlp_in")), gate_up, down))
            qk = (p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight") if fam.qk_norm else (None, None)
            extra = LayerExtras(*(norm(n) for n in (*qk, role.get("attn_out"), role.get("mlp_out"))))
            self.extras.append(None if extra.empty else extra)
            if copies:
                self.prefill_linears.append(tuple(linear(n, bias if j == 0 else None) for j, n in enumerate(names)))
        # A lone decode row goes through the projections as two (see `forward`) unless every one of
        # them gives a row the same bits whatever the row count (the quantized kernels, and
        # tide.kernels' bf16 GEMM: `row_exact`).
        self._pair_single_row = self.device.type == "cpu" and not all(
            getattr(lin, "row_exact", False) for layer in self.layers for lin in layer[1:3] + layer[4:])
        # Each layer's projections as tide.kernels' decode_layer takes them, where all four run on
        # the kernels (then a decode or verification layer is one call: see `forward`).
        self._layer_args = self._kernel_layer_args([layer[1:3] + layer[4:] for layer in self.layers])
        self._prefill_layer_args = self._kernel_layer_args(self.prefill_linears) if copies else self._layer_args
        # Whether decoding's projections run on tide.kernels' GEMMs (then on the kernels' own threads:
        # ModelRunner.decode_threads).
        self.projections_on_kernels = self._layer_args is not None
        # Whether a decode layer may be tide.kernels' decode_layer, which computes Llama's layer only:
        # families with q/k norms, sandwich or post norms, (1 + w) norms, sliding windows, soft-caps,
        # another attention scale or gelu take the per-op loop (on the kernels' ops where they apply;
        # see tide.engine.families for which family takes which path).
        self._fused_layer = (fam.fused_layer_ok and not cfg.layer_types and cfg.attn_softcap is None
                             and cfg.attn_scale is None and cfg.activation == "silu")
        self._ropes = {"global": (cfg.rope_theta, cfg.rope_scaling)}
        if cfg.local_rope is not None:
            self._ropes["local"] = cfg.local_rope
        self.cos = None
        self.ensure_positions(cfg.max_position_embeddings)
        # Per layer for the per-op loop: (extras or None, sliding?, RoPE table): Gemma 3's sliding
        # layers take the local base. Looked up once here, not per layer per step.
        self._layer_plan = [(self.extras[i], cfg.sliding(i), "local" if cfg.local_rope and cfg.sliding(i) else "global")
                            for i in range(cfg.num_layers)]
        self._aux = cfg.aux_layers if cfg.num_layers >= 4 else ()

    @staticmethod
    def _kernel_layer_args(layers) -> list[tuple] | None:
        args = [tuple(getattr(lin, "kernel_args", None) for lin in projections) for projections in layers]
        return args if args and all(a is not None for layer in args for a in layer) else None

    def ensure_positions(self, n: int) -> None:
        """Make the RoPE tables cover positions [0, n) (the cache may hold slack rows past the context):
        `cos`/`sin` for full-attention layers, `tables["local"]` for Gemma 3's sliding layers."""
        if self.cos is not None and self.cos.shape[0] >= n:
            return
        self.tables = {}
        for name, (theta, scaling) in self._ropes.items():
            cos, sin = rope_table(rope_inv_freq(self.cfg.head_dim, theta, scaling), n)
            factor = rope_attention_factor(scaling, self.cfg.max_position_embeddings)
            if factor != 1.0:  # YaRN / LongRoPE scale cos and sin (transformers' attention_scaling)
                cos, sin = cos * factor, sin * factor
            self.tables[name] = (cos.to(device=self.device, dtype=self.dtype),
                                 sin.to(device=self.device, dtype=self.dtype))
        self.cos, self.sin = self.tables["global"]

    @classmethod
    def load(cls, target: TargetFiles, dtype: torch.dtype = torch.bfloat16, device="cpu",
             weight_format: str = "float", prefill_weights: str = "auto") -> LlamaModel:
        """A target's model: a HF directory's (any number of safetensors shards, any float dtype) or a
        GGUF file's (tide.gguf_tensors, dequantized per tensor as it is converted). The decoder's
        weights are read under their own prefix (`model.`, or a multimodal Gemma 3's
        `model.language_model.` / `language_model.model.`, its vision tower left unread) and named
        `model.` here; the stop tokens are the config's and generation_config.json's."""
        cfg = LlamaConfig.from_hf(target.config)
        eos = tuple(dict.fromkeys((*cfg.eos_token_ids, *target.generation_eos_ids())))
        cfg = replace(cfg, eos_token_ids=eos)
        tensors = target.tensors()
        embed = next((n for n in tensors if n.endswith("embed_tokens.weight") and "vision" not in n), None)
        if embed is None:
            raise UnsupportedModel(f"{target.path}: no embed_tokens.weight in its checkpoint")
        prefix = embed[:-len("embed_tokens.weight")]
        wanted = {"model." + n[len(prefix):]: n for n in tensors if n.startswith(prefix)}
        head = next((n for n in tensors if n.split(".")[-2:] == ["lm_head", "weight"] and "vision" not in n), None)
        if head is not None:
            wanted["lm_head.weight"] = head
        # Read as the constructor asks for each tensor: it holds one checkpoint tensor at a time
        # beyond what it keeps (an 8B GGUF dequantized whole would be 32 GB of float32).
        weights = RenamedTensors(tensors, wanted)
        return cls(cfg, weights, dtype, device, weight_format, prefill_weights)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(self.cfg, num_slots, max_len, self.dtype, self.device)

    # Up to this many query tokens per sequence use `grouped_attention` (decode and verify);
    # longer forwards (prefill) use SDPA's flash kernel unless the kernels' attention is built.
    SMALL_Q = 16

    def _grouped_prefill(self, fused) -> bool:
        """Prompt chunks take the kernels' attention where their projections are on the kernels too
        (then a prompt runs on the kernels' threads alone: ModelRunner.prefill_threads). Soft-capped
        attention (Gemma 2) has no kernel: its prompts take `eager_attention`."""
        return (fused is not None and fused.has_decode_attention and self._prefill_layer_args is not None
                and self.cfg.attn_softcap is None)

    @property
    def lm_head(self) -> torch.Tensor | None:
        """[V, H] in `dtype` when the head is not quantized (unpacked where only the kernel's layout is
        kept: a copy, for checks and the trainer's head, never on the serving path); else None."""
        dense = getattr(self.head, "dense_weight", None)
        return dense() if dense is not None else None

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

    def _qk_norm(self, qkv: torch.Tensor, extra: LayerExtras) -> torch.Tensor:
        """qkv [.., (nh + 2 nkv) hd] with q and k RMS-normalised: per head (Qwen 3, Gemma 3) or over
        the whole projection (OLMo 2). Before RoPE, so the fused RoPE + cache-write kernel still applies."""
        cfg = self.cfg
        nq, nk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qp, kp, vp = qkv.split([nq, nk, nk], dim=-1)
        if cfg.family.qk_norm == "head":
            lead, hd = qp.shape[:-1], cfg.head_dim
            qp = rms_norm(qp.reshape(*lead, -1, hd).contiguous(), extra.q_norm, cfg.rms_norm_eps).reshape(*lead, nq)
            kp = rms_norm(kp.reshape(*lead, -1, hd).contiguous(), extra.k_norm, cfg.rms_norm_eps).reshape(*lead, nk)
        else:
            qp = rms_norm(qp.contiguous(), extra.q_norm, cfg.rms_norm_eps)
            kp = rms_norm(kp.contiguous(), extra.k_norm, cfg.rms_norm_eps)
        return torch.cat([qp, kp, vp], dim=-1)

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
        if cfg.family.embed_scale:  # Gemma: sqrt(hidden), rounded to the compute dtype as transformers does
            x = x * torch.tensor(cfg.hidden_size ** 0.5, dtype=x.dtype)
        # RoPE rows of each table at the batch's positions: [B, q, hd], and [B, 1, q, hd] for apply_rope.
        ropes = {}
        for name, (c, s_) in self.tables.items():
            c, s_ = c[fb.positions], s_[fb.positions]
            ropes[name] = (c, s_, c.unsqueeze(1), s_.unsqueeze(1))
        cos_rows, sin_rows, cos, sin = ropes["global"]
        # RoPE and the cache writes as one kernel (tide.kernels) where the cache is the CPU's (kv_cache_dtype)
        fused = (kernel_ops() if self.device.type == "cpu" and cache.k[0].dtype in (torch.float32, torch.bfloat16)
                 else None)
        tree = fb.tree
        small = q <= self.SMALL_Q or tree is not None
        # Prompt chunks too take the kernels' attention where it is built (`split_invariant_prefill`).
        grouped = small or self._grouped_prefill(fused)
        bias = None
        kv_len = fb.kv_len
        span = fb.slot_span if small and fb.slot_range is None and tree is None else None
        write_at = fb.positions if tree is None else tree.cache_index  # cache index of each row's key and value
        window = cfg.sliding_window
        # Sliding-window layers (Mistral, Qwen, Gemma) see keys at index > position - window only,
        # on top of the batch's mask (for tree rows index-based too: a node's ancestors lie within
        # the window while the window is longer than the tree is deep, as every real model's is).
        slides = window is not None and int(fb.positions.max()) - window >= 0
        window_bias = window_mask = None
        if grouped:
            kv_len = pad_keys(kv_len)

            def to_bias(visible: torch.Tensor) -> torch.Tensor:  # [B, q, L] bool -> additive 0 / -inf
                out = torch.zeros(visible.shape, dtype=torch.float32, device=x.device)
                out = out.masked_fill_(~visible.to(x.device), float("-inf"))
                if span is None:
                    return out
                span_bias = torch.zeros((span[1] - span[0], q, kv_len), dtype=torch.float32, device=x.device)
                span_bias[fb.slots - span[0]] = out  # rows of idle slots: garbage in, ignored
                return span_bias

            if fb.mask is not None or kv_len != fb.kv_len or slides:
                visible = fb.mask[:, 0] if fb.mask is not None else torch.ones((B, q, fb.kv_len), dtype=torch.bool)
                visible = F.pad(visible, (0, kv_len - fb.kv_len), value=False)
                bias = to_bias(visible)
                if slides:
                    keys_at = torch.arange(kv_len, device=visible.device)
                    window_bias = to_bias(visible & (keys_at > fb.positions[:, :, None].to(visible.device) - window))
            if span is not None:
                rows = fb.slots - span[0]  # each sequence's row in the span
                if bias is None:
                    bias = torch.zeros((span[1] - span[0], q, kv_len), dtype=torch.float32, device=x.device)
        elif slides:
            base = fb.mask if fb.mask is not None else torch.ones((B, 1, q, kv_len), dtype=torch.bool)
            keys_at = torch.arange(kv_len, device=base.device)
            window_mask = base & (keys_at > fb.positions[:, None, :, None].to(base.device) - window)
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
                    and fused.has_decode_attention and x.dtype == torch.bfloat16 and self._fused_layer)
        softcap, scale, silu = cfg.attn_softcap, cfg.attn_scale, cfg.activation == "silu"
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
            extra, sliding, table = self._layer_plan[i]
            if ln1 is None:  # OLMo 2: no pre-norm, the residual stream itself
                x, delta = (x if delta is None else x + delta), None
                h = x
            elif delta is None:
                h = rms_norm(x, ln1, cfg.rms_norm_eps)
            else:
                x, h = add_rms_norm(x, delta, ln1, cfg.rms_norm_eps)
            qkv = qkv_proj(h)[:, :1] if pair else qkv_proj(h)
            if extra is not None and extra.q_norm is not None:
                qkv = self._qk_norm(qkv, extra)
            layer_bias = window_bias if sliding and slides and grouped else bias
            cos_rows, sin_rows, cos, sin = ropes[table]
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
            if scale is not None:  # every attention below scales by head_dim ** -0.5: fold the rest into q
                qh = qh * (scale * hd ** 0.5)
            if tree is not None:
                attn = tree_attention(qh, keys, values, layer_bias, fb.positions, tree.paths, tree.starts,
                                      window if sliding else None, softcap)
            elif span is not None:
                q_span = qh.new_zeros((b - a, *qh.shape[1:]))
                q_span[rows] = qh
                attn = grouped_attention(q_span, keys, values, layer_bias, softcap)[rows]
            elif grouped:
                attn = grouped_attention(qh, keys, values, layer_bias, softcap)
            else:
                mask = window_mask if sliding and window_mask is not None else fb.mask
                if softcap is not None:
                    attn = eager_attention(qh, keys, values, mask, softcap)
                else:
                    attn = F.scaled_dot_product_attention(qh, keys.to(qh.dtype), values.to(qh.dtype), attn_mask=mask,
                                                          enable_gqa=nkv != nh)
            attn = attn.transpose(1, 2).reshape(B, q, nh * hd)
            out = o_proj(attn.expand(1, 2, -1).contiguous() if pair else attn)
            if extra is not None and extra.attn_out is not None:  # Gemma's and OLMo 2's post-attention norm
                out = rms_norm(out, extra.attn_out, cfg.rms_norm_eps)
            if ln2 is None:
                x = x + out
                h = x
            else:
                x, h = add_rms_norm(x, out, ln2, cfg.rms_norm_eps)
            gate_up = gate_up_proj(h)
            delta = down_proj(silu_mul(gate_up) if silu else _gelu_tanh_mul(gate_up))
            if extra is not None and extra.mlp_out is not None:
                delta = rms_norm(delta, extra.mlp_out, cfg.rms_norm_eps)
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
        if cfg.final_softcap is not None:  # Gemma 2
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        if not fb.capture:
            return logits, None, None
        if len(self._aux) != 3:
            raise ValueError("hidden-state capture needs a target with >= 4 layers")
        return logits, final, torch.cat([aux[i] for i in self._aux], dim=-1)

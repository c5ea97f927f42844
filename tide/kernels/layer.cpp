// One decoder layer of a decode or verification forward (few query tokens a sequence) in one call:
// the same kernels LlamaModel.forward calls one by one from Python, in the same order, so the same
// bits. Why: at batch 1 the reference model's step spent ~1.5 ms of ~14 ms in the Python between
// those ~11 calls a layer (argument checks, dispatch, views), 30 layers a step.
#include <torch/extension.h>

#include <tuple>

// cpu_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& d,
                                                      const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor rope_kv_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
                            const torch::Tensor& positions, int64_t hq, int64_t hkv);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& bias);
#endif
// gemm.cpp
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias);

namespace {

// A projection as tide.layers.Linear / tide.quant.Int8Linear hand it over (`kernel_args`):
// (packed weight, float32 scale for int8 or None, float32 bias or None).
using Projection = std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>;

torch::Tensor project(const Projection& p, const torch::Tensor& x) {
  const auto& [w, scale, bias] = p;
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.has_value(), "decode_layer: an int8 projection needs its scale");
    return int8_linear(x, w, *scale, bias);
  }
  return bf16_linear(x, w, bias);
}

}  // namespace

// decode_layer(x [B, q, H], delta [B, q, H] or None (the previous layer's MLP output, not yet added),
// ln1, ln2 [H], eps, qkv, o, gate_up, down (Projection), k_cache/v_cache [S, Hkv, Lmax, D] float32 or bf16,
// cos/sin [B, q, D], slots [B], positions [B, q], slot_lo, slot_hi (the slots are range(lo, hi); -1:
// gather rows `slots`), kv_len (keys read, padded), bias [B, q, kv_len] or None, Hq, Hkv)
// -> (x + delta + attention, MLP output): the residual stream and this layer's `delta`.
std::tuple<torch::Tensor, torch::Tensor> decode_layer(
    const torch::Tensor& x_in, const c10::optional<torch::Tensor>& delta, const torch::Tensor& ln1,
    const torch::Tensor& ln2, double eps, const Projection& qkv, const Projection& o, const Projection& gate_up,
    const Projection& down, torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& cos,
    const torch::Tensor& sin, const torch::Tensor& slots, const torch::Tensor& positions, int64_t slot_lo,
    int64_t slot_hi, int64_t kv_len, const c10::optional<torch::Tensor>& bias, int64_t hq, int64_t hkv) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  torch::Tensor x = x_in, h;
  if (delta.has_value() && delta->defined()) {
    std::tie(x, h) = add_rms_norm(x, *delta, ln1, eps);
  } else {
    h = rms_norm(x, ln1, eps);
  }
  const auto q = rope_kv_cache(project(qkv, h), cos, sin, k_cache, v_cache, slots, positions, hq, hkv);
  torch::Tensor keys, values;
  if (slot_lo >= 0) {
    keys = k_cache.slice(0, slot_lo, slot_hi).slice(2, 0, kv_len);
    values = v_cache.slice(0, slot_lo, slot_hi).slice(2, 0, kv_len);
  } else {
    keys = k_cache.slice(2, 0, kv_len).index_select(0, slots);  // copies kv_len keys a slot, not the whole row
    values = v_cache.slice(2, 0, kv_len).index_select(0, slots);
  }
  const int64_t B = x.size(0), T = x.size(1), D = q.size(3);
  const auto attn = decode_attention(q, keys, values, bias).transpose(1, 2).reshape({B, T, hq * D});
  std::tie(x, h) = add_rms_norm(x, project(o, attn), ln2, eps);
  return {x, project(down, silu_mul(project(gate_up, h)))};
#else
  TORCH_CHECK(false, "decode_layer needs AVX-512 or AVX2");
#endif
}

// draft_layer: one EAGLE-3 draft layer pass (tide.eagle3.model's docstring) for few query tokens a
// sequence, over the drafter's float32 cache, in one call: at batch 1 the same pass as ~35 torch ops
// took ~0.6 ms a draft step on a Zen 4 guest, most of it dispatch around GEMMs of a few microseconds.
// ids [B, q] target ids (the token after each state), embed [V, H] (the target's), hidden [B, q, H];
// ln_in, ln_hidden, ln_post [H]; qkv reads the 2H-wide embedding ⊕ hidden; cos/sin [B, q, D] at the
// rows' positions; write_at [B, q] the cache row of each new key and value; bias [B, q, kv_len]
// (0 or -inf: which cached keys each row sees). -> out [B, q, H], pre-norm (fed back as hidden).
torch::Tensor draft_layer(const torch::Tensor& ids, const torch::Tensor& embed, const torch::Tensor& hidden,
                          const torch::Tensor& ln_in, const torch::Tensor& ln_hidden, const torch::Tensor& ln_post,
                          double eps, const Projection& qkv, const Projection& o, const Projection& gate_up,
                          const Projection& down, torch::Tensor& k_cache, torch::Tensor& v_cache,
                          const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
                          const torch::Tensor& write_at, int64_t kv_len, const torch::Tensor& bias, int64_t hq,
                          int64_t hkv) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const int64_t B = hidden.size(0), T = hidden.size(1), H = hidden.size(2);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == B && ids.size(1) == T && embed.size(1) == H,
              "draft_layer: ids [B, q], hidden [B, q, H], embed [V, H]");
  const auto embeds = embed.index_select(0, ids.reshape({-1}).to(at::kLong)).view({B, T, H}).to(hidden.scalar_type());
  const auto x = torch::cat({rms_norm(embeds, ln_in, eps), rms_norm(hidden, ln_hidden, eps)}, -1);
  const auto q = rope_kv_cache(project(qkv, x), cos, sin, k_cache, v_cache, slots, write_at, hq, hkv);
  const auto keys = k_cache.slice(2, 0, kv_len).index_select(0, slots);
  const auto values = v_cache.slice(2, 0, kv_len).index_select(0, slots);
  const int64_t D = q.size(3);
  const auto attn = decode_attention(q, keys, values, bias).transpose(1, 2).reshape({B, T, hq * D});
  const auto [h, normed] = add_rms_norm(hidden.contiguous(), project(o, attn), ln_post, eps);
  return h + project(down, silu_mul(project(gate_up, normed)));
#else
  TORCH_CHECK(false, "draft_layer needs AVX-512 or AVX2");
#endif
}

// One Llama-style decoder layer as a single op on the CPU, for any number of rows.
//
// At batch 1 a SmolLM2 decode step spent more time between kernels than in them: ~20 torch calls
// per layer, each a Python frame, argument parsing and a dispatch, about 4 ms of a 7.5 ms step.
// At 64 rows those calls still cost ~2-3 ms of a ~48 ms step. This op runs the same sequence from
// C++: the kernels it calls are the ones the Python path calls (core_cpu_ops rms_norm / rotary,
// core_cpu_gemv int4 / int8 or oneDNN's packed GEMM, core_cpu paged_attention, found through the
// dispatcher) and the glue is the same (core_cpu_ops store_kv and add_rms_norm, ATen add, silu, mul), so every
// intermediate is rounded where the Python path rounds it and the outputs are equal.
//
//   x = x + residual; h = rms_norm(x, in_norm); q, k, v = split(qkv(h)); q, k = rotary(q, k)
//   k_cache[loc] = k; v_cache[loc] = v; a = paged_attention(q, ...)
//   x = x + o(a); h = rms_norm(x, post_norm); return x, down(silu(gate(h)) * up(h))
//
// The layer's output is the sum of the two; the model hands it to the next layer as its residual
// (added in the same pass as that layer's first norm) instead of adding it here.
//
// Each linear is (a, b, bias, dense) with a kind and a row threshold: below max_rows, kind 0 = int4
// (a = codes, b = scales/zeros) and 1 = int8 (a = codes, b = per-row scales) run the gemv kernels;
// otherwise (and always for kind 2) the GEMM multiplies by `dense`, oneDNN-packed or plain.
// An empty bias is none.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace {

using Rms = at::Tensor(const at::Tensor&, const at::Tensor&, double, double);
using Rot = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, int64_t);
using Mm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Lin = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                       c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
using AddRms = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double);
using Store = void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Attn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, double, int64_t, double);

template <typename F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Ops {
  c10::TypedOperatorHandle<Rms> rms = op<Rms>("core_cpu_ops::rms_norm");
  c10::TypedOperatorHandle<Rot> rot = op<Rot>("core_cpu_ops::rotary");
  c10::TypedOperatorHandle<AddRms> add_rms = op<AddRms>("core_cpu_ops::add_rms_norm");
  c10::TypedOperatorHandle<Store> store = op<Store>("core_cpu_ops::store_kv");
  c10::TypedOperatorHandle<Attn> attn = op<Attn>("core_cpu::paged_attention");
  c10::TypedOperatorHandle<Lin> onednn = op<Lin>("mkldnn::_linear_pointwise");
};

const Ops& ops() {
  static const Ops o;  // the libraries are loaded before the first call (the Python side checks)
  return o;
}

// The gemv kernels (AVX512-BF16 only), looked up on first use: fp32 and dense layers never need them.
const c10::TypedOperatorHandle<Mm>& gemv(int64_t kind) {
  static const auto int4 = op<Mm>("core_cpu_gemv::int4_mm");
  static const auto int8 = op<Mm>("core_cpu_gemv::int8_mm");
  return kind == 0 ? int4 : int8;
}

using Pair = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const at::Tensor&);
const c10::TypedOperatorHandle<Pair>& gemv_pair(int64_t kind) {
  static const auto int4 = op<Pair>("core_cpu_gemv::int4_mm_pair");
  static const auto int8 = op<Pair>("core_cpu_gemv::int8_mm_pair");
  return kind == 0 ? int4 : int8;
}

bool has_bias(const at::TensorList& lin, int64_t i) {
  const at::Tensor& bias = lin[4 * i + 2];
  return bias.defined() && bias.numel();
}

at::Tensor linear(const Ops& o, const at::Tensor& x, const at::TensorList& lin, int64_t i, int64_t kind, int64_t max_rows) {
  const at::Tensor& a = lin[4 * i];
  const at::Tensor& b = lin[4 * i + 1];
  const at::Tensor& bias = lin[4 * i + 2];
  const at::Tensor& dense = lin[4 * i + 3];
  if (kind < 2 && x.size(0) < max_rows) {
    at::Tensor y = gemv(kind).call(x, a, b);
    return has_bias(lin, i) ? y.add(bias) : y;
  }
  const std::optional<at::Tensor> opt_bias = has_bias(lin, i) ? std::optional<at::Tensor>(bias) : std::nullopt;
  if (dense.is_mkldnn()) return o.onednn.call(x.contiguous(), dense, opt_bias, "none", c10::List<std::optional<at::Scalar>>(), "");
  return at::linear(x, dense, opt_bias);
}

std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& in_norm, const at::Tensor& post_norm, double eps,
                        at::TensorList lin, at::IntArrayRef kinds, at::IntArrayRef max_rows, const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t rotary_dim, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& out_loc, const at::Tensor& kv_indices, const at::Tensor& seq_lens,
                        const at::Tensor& extend_lens, double scale, int64_t window, double cap) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layer: x [rows, hidden] contiguous");
  TORCH_CHECK(!residual || residual->sizes() == x.sizes(), "decode_layer: residual [rows, hidden]");
  TORCH_CHECK(lin.size() == 20 && kinds.size() == 5 && max_rows.size() == 5, "decode_layer: five linears (qkv, o, gate, up, down)");
  const Ops& o = ops();
  const int64_t m = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x0 = x, h;  // the layer's input (x + residual, the previous layer's deferred add) and its norm
  if (residual) {
    std::tie(x0, h) = o.add_rms.call(x, residual->contiguous(), in_norm, eps, 0.0);
  } else {
    h = o.rms.call(x, in_norm, eps, 0.0);
  }
  const at::Tensor qkv = linear(o, h, lin, 0, kinds[0], max_rows[0]);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({m, num_heads, head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({m, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({m, num_kv_heads, head_dim});
  auto [qr, kr] = o.rot.call(positions, q, k, cos, sin, rotary_dim);
  at::Tensor kc = k_cache, vc = v_cache;
  o.store.call(kc, vc, out_loc, kr, v);
  const at::Tensor a = o.attn.call(qr, k_cache, v_cache, kv_indices, seq_lens, extend_lens, scale, window, cap);
  auto [x1, h1] = o.add_rms.call(x0, linear(o, a.view({m, q_size}), lin, 1, kinds[1], max_rows[1]), post_norm, eps, 0.0);
  at::Tensor gate, up;
  if (kinds[2] == kinds[3] && kinds[2] < 2 && m < max_rows[2] && m < max_rows[3] && !has_bias(lin, 2) && !has_bias(lin, 3) &&
      (kinds[2] == 1 || lin[4 * 2 + 1].size(1) == lin[4 * 3 + 1].size(1))) {  // one gemv pass for both (same kernel, same results)
    std::tie(gate, up) = gemv_pair(kinds[2]).call(h1, lin[4 * 2], lin[4 * 2 + 1], lin[4 * 3], lin[4 * 3 + 1]);
  } else {
    gate = linear(o, h1, lin, 2, kinds[2], max_rows[2]);
    up = linear(o, h1, lin, 3, kinds[3], max_rows[3]);
  }
  const at::Tensor act = at::silu(gate).mul_(up);
  return {x1, linear(o, act, lin, 4, kinds[4], max_rows[4])};
}

}  // namespace

TORCH_LIBRARY(core_cpu_decode, m) {
  m.def("decode_layer(Tensor x, Tensor? residual, Tensor in_norm, Tensor post_norm, float eps, Tensor[] lin, int[] kinds, int[] max_rows, "
        "Tensor positions, Tensor cos, Tensor sin, int rotary_dim, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_loc, Tensor kv_indices, Tensor seq_lens, "
        "Tensor extend_lens, float scale, int window, float cap) -> (Tensor, Tensor)");
}

// CompositeExplicitAutograd: the oneDNN-packed weights among the arguments carry another dispatch key
TORCH_LIBRARY_IMPL(core_cpu_decode, CompositeExplicitAutograd, m) { m.impl("decode_layer", &decode_layer); }

// One Llama-style decoder layer for a few rows (decode at batch 1-3) as a single op on the CPU.
//
// At batch 1 a SmolLM2 decode step spent more time between kernels than in them: ~20 torch calls
// per layer, each a Python frame, argument parsing and a dispatch, about 4 ms of a 7.5 ms step.
// This op runs the same sequence from C++: the kernels it calls are the ones the Python path
// calls (core_cpu_ops rms_norm / rotary, core_cpu_gemv int4 / int8, core_cpu paged_attention,
// found through the dispatcher) and the glue is the same ATen ops (index_copy_, add, silu, mul),
// so every intermediate is rounded where the Python path rounds it and the outputs are equal.
//
//   h = rms_norm(x, in_norm); q, k, v = split(qkv(h)); q, k = rotary(q, k)
//   k_cache[loc] = k; v_cache[loc] = v; a = paged_attention(q, ...)
//   x = x + o(a); h = rms_norm(x, post_norm); x = x + down(silu(gate(h)) * up(h))
//
// Each linear is (kind, a, b, bias): kind 0 = int4 (a = codes, b = scales/zeros), 1 = int8
// (a = codes, b = per-row scales); an undefined bias is none.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace {

using Rms = at::Tensor(const at::Tensor&, const at::Tensor&, double, double);
using Rot = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, int64_t);
using Mm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Attn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, double, int64_t, double);

template <typename F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Ops {
  c10::TypedOperatorHandle<Rms> rms = op<Rms>("core_cpu_ops::rms_norm");
  c10::TypedOperatorHandle<Rot> rot = op<Rot>("core_cpu_ops::rotary");
  c10::TypedOperatorHandle<Mm> int4 = op<Mm>("core_cpu_gemv::int4_mm");
  c10::TypedOperatorHandle<Mm> int8 = op<Mm>("core_cpu_gemv::int8_mm");
  c10::TypedOperatorHandle<Attn> attn = op<Attn>("core_cpu::paged_attention");
};

const Ops& ops() {
  static const Ops o;  // the libraries are loaded before the first call (the Python side checks)
  return o;
}

at::Tensor linear(const Ops& o, const at::Tensor& x, const at::TensorList& lin, int64_t i, int64_t kind) {
  const at::Tensor& a = lin[3 * i];
  const at::Tensor& b = lin[3 * i + 1];
  const at::Tensor& bias = lin[3 * i + 2];
  at::Tensor y = kind == 0 ? o.int4.call(x, a, b) : o.int8.call(x, a, b);
  return bias.defined() && bias.numel() ? y.add(bias) : y;
}

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& in_norm, const at::Tensor& post_norm, double eps,
                        at::TensorList lin, at::IntArrayRef kinds, const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t rotary_dim, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& out_loc, const at::Tensor& kv_indices, const at::Tensor& seq_lens,
                        const at::Tensor& extend_lens, double scale, int64_t window, double cap) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layer: x [rows, hidden] contiguous");
  TORCH_CHECK(lin.size() == 15 && kinds.size() == 5, "decode_layer: five linears (qkv, o, gate, up, down)");
  const Ops& o = ops();
  const int64_t m = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const at::Tensor h = o.rms.call(x, in_norm, eps, 0.0);
  const at::Tensor qkv = linear(o, h, lin, 0, kinds[0]);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({m, num_heads, head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({m, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({m, num_kv_heads, head_dim});
  auto [qr, kr] = o.rot.call(positions, q, k, cos, sin, rotary_dim);
  k_cache.index_copy_(0, out_loc, kr);
  v_cache.index_copy_(0, out_loc, v);
  const at::Tensor a = o.attn.call(qr, k_cache, v_cache, kv_indices, seq_lens, extend_lens, scale, window, cap);
  const at::Tensor x1 = x.add(linear(o, a.view({m, q_size}), lin, 1, kinds[1]));
  const at::Tensor h1 = o.rms.call(x1, post_norm, eps, 0.0);
  const at::Tensor act = at::silu(linear(o, h1, lin, 2, kinds[2])).mul_(linear(o, h1, lin, 3, kinds[3]));
  return x1.add(linear(o, act, lin, 4, kinds[4]));
}

}  // namespace

TORCH_LIBRARY(core_cpu_decode, m) {
  m.def("decode_layer(Tensor x, Tensor in_norm, Tensor post_norm, float eps, Tensor[] lin, int[] kinds, "
        "Tensor positions, Tensor cos, Tensor sin, int rotary_dim, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_loc, Tensor kv_indices, Tensor seq_lens, "
        "Tensor extend_lens, float scale, int window, float cap) -> Tensor");
}

TORCH_LIBRARY_IMPL(core_cpu_decode, CPU, m) { m.impl("decode_layer", &decode_layer); }

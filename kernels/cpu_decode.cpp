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
// (a = codes, b = scales/minimums) and 1 = int8 (a = codes, b = per-row scales) run the gemv kernels;
// otherwise (and always for kind 2) the GEMM multiplies by `dense`, oneDNN-packed or plain.
// An empty bias is none.

#include "cpu_attention.h"
#include "cpu_gemv.h"
#include "cpu_rows.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <sleef.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <omp.h>
#include <string>
#include <tuple>
#include <vector>

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
                        const at::Tensor&, double, int64_t, double, bool);

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

// The gemv kernels (bf16: AVX512-BF16 and VNNI; fp32: AVX2), looked up on first use: dense layers never need them.
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
                        const at::Tensor& extend_lens, double scale, int64_t window, double cap, bool batch_invariant) {
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
  const at::Tensor a = o.attn.call(qr, k_cache, v_cache, kv_indices, seq_lens, extend_lens, scale, window, cap, batch_invariant);
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

// ---- The whole decoder stack in one call, for a few rows of activations and packed weights ----
//
// With every linear on the gemv kernels (a few rows, int4 / int8 weights), a batch-1 step of
// SmolLM2 spent about half its time outside the kernels: a Python call and ~10 dispatches per
// layer, their allocations, five OpenMP forks and joins per layer (the worker sleeping between
// them), and the one thread's serial parts. DecodeStack runs every layer in one OpenMP parallel
// region. The threads share each weight's 16-row blocks (the same block kernels, so the same
// bits; a bias is added to each block as it is done) and the attention's tasks (the `cpu`
// backend's kernel, kernels/cpu_attention.h, planned once for all layers). Below kSplitRows rows
// each thread computes the row loops between the GEMMs (residual adds, norms, group sums, the
// gated activation) itself, in its own buffers: a few microseconds of duplicated arithmetic
// instead of a barrier and a waiting thread each; from kSplitRows the threads share the rows out
// and meet before each GEMM too. Otherwise the threads meet only after each GEMM (every thread
// needs all of its output), after the rotary embedding and the cache store (rows shared out), and
// after the attention. Buffers are allocated once per call.
//
// The activations are bf16 (AVX512-BF16 builds) or float32 (AVX2 builds: what --dtype auto picks
// on a CPU without native bf16); the weights' scales, the norms and the caches are in the same dtype.
//
// A stack built with the model's final norm and a packed LM head also runs those in the same region
// (run_head): at batch 1 the norm and the head as two more ops cost ~0.15 ms of a ~6 ms step
// besides the head's own reading, which is a third of the step's bytes.

// The phases of a stack call that DecodeStack's profiling times (see set_profiling), in the order
// of profile()'s values.
enum Phase { kSetup, kRows, kGemm, kGemmWait, kRotary, kAttention, kHead, kArgmax, kJoin, kPhases };
const char* const kPhaseNames[kPhases] = {"setup", "rows", "gemm", "gemm_wait", "rotary", "attention", "head", "argmax", "join"};

inline double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The calling thread's (the team's thread 0) clock over a call's phases: mark(p) adds the time
// since the last mark to phase p. Inert (acc null) on the other threads and without profiling.
struct PhaseClock {
  double* acc = nullptr;
  double last = 0.0;
  void mark(Phase p) {
    if (acc == nullptr) return;
    const double t = seconds();
    acc[p] += t - last;
    last = t;
  }
};

#ifdef CORE_GEMV_ANY
using namespace core_gemv;
using namespace core_rows;
using bf16 = c10::BFloat16;

// E's values as the gemv kernels read them: bf16 bits or float.
template <typename E>
using Bits = std::conditional_t<std::is_same_v<E, float>, float, uint16_t>;
template <typename E>
inline const Bits<E>* raw(const E* p) { return reinterpret_cast<const Bits<E>*>(p); }
template <typename E>
inline Bits<E>* raw(E* p) { return reinterpret_cast<Bits<E>*>(p); }

// The kernels of this build for activations of dtype st.
inline bool has_kernels(at::ScalarType st) {
#ifdef CORE_GEMV_BF16
  if (st == at::kBFloat16) return true;
#endif
#ifdef CORE_GEMV_F32
  if (st == at::kFloat) return true;
#endif
  return false;
}

// A layer's packed linear (kind 0 int4, 1 int8; the head also 3, int8 blocks; cpu_gemv.h's Weight),
// checked: scales and bias in st (int8 blocks: fp16 scales).
Weight packed(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, int64_t kind, int64_t N, int64_t K,
              int64_t layer, const char* name, at::ScalarType st, bool head = false) {
  TORCH_CHECK(kind == 0 || kind == 1 || (head && kind == 3), "DecodeStack: layer ", layer, " ", name, ": kind ", kind,
              head ? " is not int4 (0), int8 (1) or int8 blocks (3)" : " is not int4 (0) or int8 (1)");
  const at::ScalarType bt = kind == 0 ? core_gemv::sz_type(st) : kind == 3 ? at::kHalf : st;
  TORCH_CHECK(a.scalar_type() == at::kByte && a.is_contiguous() && b.scalar_type() == bt && b.is_contiguous(),
              "DecodeStack: layer ", layer, " ", name, ": uint8 codes and ", bt, " scales, contiguous");
  int64_t G = 1;
  if (kind == 0) {
    TORCH_CHECK(a.dim() == 4 && a.size(0) * 16 == N && a.size(1) * 8 == K && a.size(2) == 16 && a.size(3) == 4 &&
                    b.dim() == 4 && b.size(0) == N / 16 && b.size(2) == 2 && b.size(3) == 16 && b.size(1) > 0 &&
                    K % b.size(1) == 0 && (K / b.size(1)) % 32 == 0,
                "DecodeStack: layer ", layer, " ", name, ": int4 weight of ", N, " x ", K, " expected");
    G = b.size(1);
  } else if (kind == 3) {
    TORCH_CHECK(a.dim() == 4 && a.size(0) * 16 == N && a.size(1) * 4 == K && a.size(2) == 16 && a.size(3) == 4 &&
                    K % 32 == 0 && b.dim() == 3 && b.size(0) == N / 16 && b.size(1) == K / 32 && b.size(2) == 16,
                "DecodeStack: ", name, ": int8-blocks weight of ", N, " x ", K, " expected");
    G = K / 32;
  } else {
    TORCH_CHECK(a.dim() == 4 && a.size(0) * 16 == N && a.size(1) * 4 == K && a.size(2) == 16 && a.size(3) == 4 &&
                    K % 32 == 0 && b.dim() == 1 && b.size(0) == N,
                "DecodeStack: layer ", layer, " ", name, ": int8 weight of ", N, " x ", K, " expected");
  }
  const bool has = bias.defined() && bias.numel();
  TORCH_CHECK(!has || (bias.scalar_type() == st && bias.is_contiguous() && bias.numel() == N),
              "DecodeStack: layer ", layer, " ", name, ": bias of ", N, " ", st, " expected");
  return {kind, N, K, G, a.const_data_ptr<uint8_t>(), b.const_data_ptr(), has ? bias.const_data_ptr() : nullptr};
}

// Inside a parallel region, every thread: a share of the job's blocks; the threads leave in step,
// and with `meet` they start in step too (each thread prepared some rows of the job's x). The
// clock: what came before (the row loops, x quantized for the job) as kRows, this thread's blocks
// as `phase`, the waits for the others as kGemmWait.
template <typename F>
void blocks_shared(int64_t blocks, PhaseClock& clock, bool meet, Phase phase, F&& block) {
  clock.mark(kRows);
  if (meet) {
#pragma omp barrier
    clock.mark(kGemmWait);
  }
#pragma omp for schedule(static) nowait
  for (int64_t i = 0; i < blocks; ++i) block(i);
  clock.mark(phase);
#pragma omp barrier
  clock.mark(kGemmWait);
}

// ---- LoRA adapters (core/engine/lora/pool.py's LayerLoRA buffers, set_lora) on a stack's linears ----
//
// Row t of a forward with adapter slot s gets B_s (A_s x_t) added to each adapted linear's output,
// per part (qkv_proj's q, k, v each its own A rows and output span). The rank is small (16), so the
// FLOPs are few but the bytes are not: eight rank-16 adapters over SmolLM2's seven projections are
// 78 MB of bf16 a step, more than its int4 weights. So the loops stream them once each, inside the
// stack's thread team: before the GEMM the threads share out the shrinks h = A x (by A rows, for
// every row of its slot: each adapter's A is read once a step, sequentially; where the threads
// share out the rows, each its own rows, without meeting first), meet, then each adds the deltas
// of its own 16-column output blocks right after computing them, while the GEMM's weights stream
// (B is kept by blocks, [N / 16, slots, R, 16]: one thread's blocks are one run of memory). As the Python path (LayerLoRA: y += (x A^T) B^T in the activation dtype) h is
// rounded to the activation dtype and the delta is added to the output in float32, rounded once.
// Over int4 / int8 weights the pool keeps the adapters as int8 codes (half the bytes of bf16, a
// quarter of float32) with a power-of-two scale per A row and per B column (per part): the values
// are exactly the pool's dequantized ones, which the Python layers use, so only the sums' order
// differs. B's scales multiply h (exact: powers of two) rather than each code.

// One linear's adapters: A [slots, parts * R, K] and B by blocks [N / 16, slots, R, 16], in the
// stack's dtype; part p's outputs are the columns [spans[p][0], + spans[p][1]) (multiples of 16).
struct LoraWeight {
  const void* a = nullptr;  // null: the linear has no adapters
  const void* b = nullptr;
  const float *sa = nullptr, *sb = nullptr;  // int8 a and b: their scales, [slots, parts * R] each (null: E)
  int64_t slots = 0, parts = 0, R = 0, K = 0, N = 0;
  int64_t spans[3][2] = {};
  int64_t width() const { return parts * R; }  // h's values per row
  int part_of(int64_t n0) const {  // the part whose span holds column n0, or -1
    for (int p = 0; p < parts; ++p)
      if (n0 >= spans[p][0] && n0 < spans[p][0] + spans[p][1]) return p;
    return -1;
  }
};

// A forward's rows with adapters grouped by slot, and the shrinks' outputs.
struct LoraBatch {
  std::vector<int64_t> slot, start{0}, rows;  // group g: adapter slot[g], rows rows[start[g] .. start[g + 1])
  const int32_t* slot_of = nullptr;  // row t's slot (-1: none)
  float* h = nullptr;  // [2, M, width]: each row's h (gate's, then up's)
  int64_t width = 0, M = 0;
  int64_t groups() const { return static_cast<int64_t>(slot.size()); }
  float* h_of(int k) const { return h + k * M * width; }
};

// a . x over K values (K % 32 == 0, as every stack GEMM's), summed in float32 with two sums in
// flight: bf16 through AVX512-BF16's pair products (exact products, float32 sums), float32 and
// int8 weights through float32 FMAs (an int8 row's scale applied by the caller).
// out[block] += sum_r h[r] s[r] b[r] over a 16-column block b [R, 16] (s: int8 B's column scales;
// none for bf16 / float32 B), summed in float32 and rounded once into out.
inline core_attention::vf vload_w(const float* p) { return core_attention::vload(p); }
#if defined(__AVX512F__)
inline core_attention::vf vload_w(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__)
inline core_attention::vf vload_w(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif
inline core_attention::vf vload_x(const float* p) { return core_attention::vload(p); }
#ifdef CORE_GEMV_BF16
inline core_attention::vf vload_w(const uint16_t* p) { return bf16x16(p); }
inline core_attention::vf vload_x(const uint16_t* p) { return bf16x16(p); }
#endif

template <typename W, typename X>
inline float dot_fma(const W* a, const X* x, int64_t K) {
  using namespace core_attention;
  vf s0 = vzero(), s1 = vzero();
  int64_t k = 0;
  for (; k + 2 * CORE_SIMD <= K; k += 2 * CORE_SIMD)
    s0 = vfma(vload_w(a + k), vload_x(x + k), s0), s1 = vfma(vload_w(a + k + CORE_SIMD), vload_x(x + k + CORE_SIMD), s1);
  for (; k < K; k += CORE_SIMD) s0 = vfma(vload_w(a + k), vload_x(x + k), s0);
  return vsum(vadd(s0, s1));
}

inline float scaled(const float* h, const float* s, int64_t r) { return s ? h[r] * s[r] : h[r]; }

template <typename W>
inline void add_block_f32(const W* b, const float* h, const float* s, int64_t R, float* out) {
  using namespace core_attention;
  for (int c = 0; c < 16; c += CORE_SIMD) {
    vf s0 = vzero(), s1 = vzero();
    int64_t r = 0;
    for (; r + 2 <= R; r += 2)
      s0 = vfma(vset1(scaled(h, s, r)), vload_w(b + 16 * r + c), s0),
      s1 = vfma(vset1(scaled(h, s, r + 1)), vload_w(b + 16 * r + 16 + c), s1);
    if (r < R) s0 = vfma(vset1(scaled(h, s, r)), vload_w(b + 16 * r + c), s0);
    vstore(out + c, vadd(vload(out + c), vadd(s0, s1)));
  }
}

template <typename X>
inline float dot(const int8_t* a, const X* x, int64_t K) { return dot_fma(a, x, K); }
inline void add_block(const int8_t* b, const float* h, const float* s, int64_t R, float* out) {
  add_block_f32(b, h, s, R, out);
}

#ifdef CORE_GEMV_F32
inline float dot(const float* a, const float* x, int64_t K) { return dot_fma(a, x, K); }
inline void add_block(const float* b, const float* h, int64_t R, float* out) { add_block_f32(b, h, nullptr, R, out); }
#endif

#ifdef CORE_GEMV_BF16
inline float dot(const uint16_t* a, const uint16_t* x, int64_t K) {
  const auto pair = [&](__m512 s, int64_t k) {
    return _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(a + k), (__m512bh)_mm512_loadu_si512(x + k));
  };
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) s0 = pair(s0, k), s1 = pair(s1, k + 32);
  if (k < K) s0 = pair(s0, k);
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

template <typename W>
inline void add_block_bf16(const W* b, const float* h, const float* s, int64_t R, uint16_t* out) {
  __m512 s0 = widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(out))), s1 = _mm512_setzero_ps();
  int64_t r = 0;
  for (; r + 2 <= R; r += 2) {
    s0 = _mm512_fmadd_ps(_mm512_set1_ps(scaled(h, s, r)), vload_w(b + 16 * r), s0);
    s1 = _mm512_fmadd_ps(_mm512_set1_ps(scaled(h, s, r + 1)), vload_w(b + 16 * r + 16), s1);
  }
  if (r < R) s0 = _mm512_fmadd_ps(_mm512_set1_ps(scaled(h, s, r)), vload_w(b + 16 * r), s0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), f_bf16x16(_mm512_add_ps(s0, s1)));
}

inline void add_block(const uint16_t* b, const float* h, int64_t R, uint16_t* out) { add_block_bf16(b, h, nullptr, R, out); }
inline void add_block(const int8_t* b, const float* h, const float* s, int64_t R, uint16_t* out) {
  add_block_bf16(b, h, s, R, out);
}
#endif

// h's value r of one row: A's row `row` (slot * width + r) . x, in float32 (E: unrounded).
template <typename E>
inline float lora_dot(const LoraWeight& w, int64_t row, const E* x) {
  if (w.sa) return w.sa[row] * dot(static_cast<const int8_t*>(w.a) + row * w.K, raw(x), w.K);
  return dot(raw(static_cast<const E*>(w.a)) + row * w.K, raw(x), w.K);
}

// One GEMM's adapters: its weights (null: none), its input x [M, K] and where its h goes.
template <typename E>
struct LoraJob {
  const LoraWeight* w = nullptr;
  const E* x = nullptr;
  float* h = nullptr;
  int64_t items(const LoraBatch& lb) const { return w ? lb.groups() * w->width() : 0; }
};

// Every thread: its share of the jobs' shrinks h[t, j] = A_slot(t)[j] . x[t], rounded to E; no
// barrier (the GEMM's meeting follows). Where the threads shared out the rows of x (split), each
// its own rows [r0, r1), without meeting first; else an item is one A row for the rows of one slot.
template <typename E>
void lora_shrink(const LoraBatch& lb, bool split, int64_t r0, int64_t r1, const LoraJob<E>& j0, const LoraJob<E>& j1) {
  if (split) {
    for (const LoraJob<E>* j : {&j0, &j1}) {
      if (!j->w) continue;
      const LoraWeight& w = *j->w;
      for (int64_t t = r0; t < r1; ++t) {
        if (lb.slot_of[t] < 0) continue;
        const int64_t row = lb.slot_of[t] * w.width();
        for (int64_t r = 0; r < w.width(); ++r) j->h[t * lb.width + r] = rnd<E>(lora_dot(w, row + r, j->x + t * w.K));
      }
    }
    return;
  }
  const int64_t n0 = j0.items(lb), total = n0 + j1.items(lb);
#pragma omp for schedule(static) nowait
  for (int64_t i = 0; i < total; ++i) {
    const LoraJob<E>& j = i < n0 ? j0 : j1;
    const LoraWeight& w = *j.w;
    const int64_t item = i < n0 ? i : i - n0, g = item / w.width(), r = item % w.width();
    for (int64_t q = lb.start[g]; q < lb.start[g + 1]; ++q) {
      const int64_t t = lb.rows[q];  // (rounded as the Python path's E GEMM)
      j.h[t * lb.width + r] = rnd<E>(lora_dot(w, lb.slot[g] * w.width() + r, j.x + t * w.K));
    }
  }
}

// out[t, block nb] += B_slot(t)[block nb] h[t] (the block's part) for the rows with adapters.
template <typename E>
void lora_expand(const LoraBatch& lb, const LoraWeight& w, const float* h, E* out, int64_t nb) {
  const int p = w.part_of(nb * 16);
  if (p < 0) return;
  const int64_t at = nb * w.slots * w.R * 16;  // this block's codes of slot 0
  for (int64_t g = 0; g < lb.groups(); ++g)
    for (int64_t q = lb.start[g]; q < lb.start[g + 1]; ++q) {
      const int64_t t = lb.rows[q], blk = at + lb.slot[g] * w.R * 16;
      const float* ht = h + t * lb.width + p * w.R;
      if (w.sb)
        add_block(static_cast<const int8_t*>(w.b) + blk, ht, w.sb + lb.slot[g] * w.width() + p * w.R, w.R,
                  raw(out + t * w.N + nb * 16));
      else
        add_block(raw(static_cast<const E*>(w.b)) + blk, ht, w.R, raw(out + t * w.N + nb * 16));
    }
}

// Before a GEMM whose weights have adapters (a job's w not null): each thread its share of the
// shrinks (lora_shrink), timed as the GEMM's.
template <typename E>
void lora_before(const LoraBatch& lb, bool split, int64_t r0, int64_t r1, PhaseClock& clock, const LoraJob<E>& j0,
                 const LoraJob<E>& j1 = {}) {
  if (!j0.w && !j1.w) return;
  clock.mark(kRows);
  lora_shrink(lb, split, r0, r1, j0, j1);
  clock.mark(kGemm);
}

// A GEMM of the stack: out = x w, and out2 = x w2 when w2 is given (gate and up: one pass over both
// weights' blocks); a, a2 x as each weight's kernel reads it. With lb, each block of a weight with
// adapters (lw, lw2) gets its rows' deltas from their h (lh, lh2).
template <typename E>
struct Job {
  const Weight* w;
  Act a;
  E* out;
  const Weight* w2 = nullptr;
  Act a2 = {};
  E* out2 = nullptr;
  const LoraBatch* lb = nullptr;
  const LoraWeight *lw = nullptr, *lw2 = nullptr;
  const float *lh = nullptr, *lh2 = nullptr;
  int64_t blocks() const { return w->N / 16 + (w2 ? w2->N / 16 : 0); }
};

template <typename E>
void gemv_shared(const Job<E>& j, int64_t M, PhaseClock& clock, bool meet, Phase phase = kGemm) {
  const int64_t na = j.w->N / 16;
  blocks_shared(j.blocks(), clock, meet, phase, [&](int64_t i) {
    if (i < na) {
      weight_block(*j.w, j.a, raw(j.out), M, i);
      if (j.lw) lora_expand(*j.lb, *j.lw, j.lh, j.out, i);
    } else {
      weight_block(*j.w2, j.a2, raw(j.out2), M, i - na);
      if (j.lw2) lora_expand(*j.lb, *j.lw2, j.lh2, j.out2, i - na);
    }
  });
}

// Per-thread scratch for x as the kernels read it (cpu_gemv.h's Act): group sums, int8 codes, scales.
struct Scratch {
  float* xs;
  int8_t* xq;
  float* dx;
};

// Rows [r0, r1) of x [M, w.K] prepared for w in s (each row's codes, scales and group sums sit
// at its own offsets: threads may prepare disjoint rows of the same x).
template <typename E>
Act prep(const Weight& w, const E* x, int64_t r0, int64_t r1, const Scratch& s) {
  quantize_rows(raw(x + r0 * w.K), r1 - r0, w.K, w.G, s.xq + r0 * w.K, s.dx + r0 * (w.K / 32), s.xs + r0 * w.G);
  return {s.xq, s.dx, s.xs};
}

// From this many rows the threads share out the row loops between the GEMMs (see forward).
constexpr int64_t kSplitRows = 8;

#ifdef CORE_GEMV_BF16
// out = silu(g) * u over n elements, rounded as torch's silu and mul round them in bf16. torch's
// silu, run in one chunk (as it is below its grain size), takes whole 64-element steps through
// its vector loop, x / (1 + e^-x) with Sleef's exp, and the rest through the scalar formula.
void silu_mul(const bf16* g, const bf16* u, bf16* out, int64_t n) {
  const uint16_t *gr = raw(g), *ur = raw(u);
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  const int64_t nv = n / 64 * 64;
  alignas(64) float s[16];
  int64_t i = 0;
  for (; i < nv; i += 16) {
    const __m512 x = bf16x16(gr + i);
    const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(_mm512_set1_ps(-0.0f), x));
    _mm512_store_ps(s, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
#pragma omp simd
    for (int j = 0; j < 16; ++j) o[i + j] = f_bf16(rnd_bf16(s[j]) * bf16_f(ur[i + j]));
  }
  for (; i < n; ++i) {
    const float x = bf16_f(gr[i]);
    o[i] = f_bf16(rnd_bf16(x / (1.0f + std::exp(-x))) * bf16_f(ur[i]));
  }
}
#endif

#ifdef CORE_GEMV_F32
// The same for float32, as torch's float silu computes it: on an AVX-512 build its 16-lane vector
// loop, else the 8-lane AVX2 one, two vectors per step, the rest through the scalar formula.
void silu_mul(const float* g, const float* u, float* o, int64_t n) {
#if defined(__AVX512F__)
  const int64_t nv = n / 32 * 32;
  int64_t i = 0;
  for (; i < nv; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(_mm512_set1_ps(-0.0f), x));
    _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), _mm512_loadu_ps(u + i)));
  }
#else
  const int64_t nv = n / 16 * 16;
  int64_t i = 0;
  for (; i < nv; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(_mm256_set1_ps(-0.0f), x));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}
#endif

constexpr int kPerLayer = 17;  // in_norm, post_norm, then (a, b, bias) of qkv, o, gate, up, down
#endif  // CORE_GEMV_ANY

// The stack's weights, norms and caches, checked once (torch.classes.core_cpu_decode.DecodeStack,
// built when the model first plans it); run() is one decode or short-prefill forward.
class DecodeStack : public torch::CustomClassHolder {
 public:
  // head: empty, or (final norm weight, head codes, head scales) with head_kind 0 (int4), 1 (int8) or
  // 3 (int8 blocks: float32 logits), the final norm's eps final_eps.
  DecodeStack(std::vector<at::Tensor> layers, std::vector<int64_t> kinds, double eps, at::Tensor cos, at::Tensor sin,
              int64_t rotary_dim, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, double scale, int64_t window,
              std::vector<at::Tensor> head, int64_t head_kind, double final_eps)
      : layers_(std::move(layers)), k_caches_(std::move(k_caches)), v_caches_(std::move(v_caches)), head_(std::move(head)),
        cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), final_eps_(final_eps), scale_(scale), window_(window),
        rot_(rotary_dim), H(num_heads), Hkv(num_kv_heads), D(head_dim) {
#ifdef CORE_GEMV_ANY
    L = static_cast<int64_t>(k_caches_.size());
    TORCH_CHECK(L > 0 && static_cast<int64_t>(v_caches_.size()) == L && static_cast<int64_t>(layers_.size()) == kPerLayer * L &&
                    static_cast<int64_t>(kinds.size()) == 5 * L,
                "DecodeStack: per layer 17 tensors, 5 kinds, a K and a V cache");
    TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && rot_ % 2 == 0 && rot_ <= D, "DecodeStack: head shapes");
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat && cos_.is_contiguous() &&
                    sin_.is_contiguous() && cos_.dim() == 2 && cos_.size(1) == rot_ && sin_.sizes() == cos_.sizes(),
                "DecodeStack: float32 rotary caches [max_pos, rotary_dim]");
    dtype_ = layers_[0].scalar_type();
    TORCH_CHECK(has_kernels(dtype_), "DecodeStack: this build has no gemv kernels for ", dtype_,
                " activations (bf16: AVX512-BF16 and VNNI; float32: AVX2 and FMA)");
    hid = layers_[0].numel();
    qs = H * D, kvs = Hkv * D, nqkv = qs + 2 * kvs, I = layers_[2 + 3 * 2].size(0) * 16;
    const int64_t shapes[5][2] = {{nqkv, hid}, {hid, qs}, {I, hid}, {I, hid}, {hid, I}};
    const char* names[5] = {"qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    slots = k_caches_[0].size(0);
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* t = layers_.data() + kPerLayer * l;
      for (int i = 0; i < 2; ++i) {
        TORCH_CHECK(t[i].scalar_type() == dtype_ && t[i].is_contiguous() && t[i].numel() == hid,
                    "DecodeStack: layer ", l, ": norm weights of ", hid, " ", dtype_);
        norms_.push_back(t[i].const_data_ptr());
      }
      for (int i = 0; i < 5; ++i)
        lin_.push_back(packed(t[2 + 3 * i], t[3 + 3 * i], t[4 + 3 * i], kinds[5 * l + i], shapes[i][0], shapes[i][1], l,
                              names[i], dtype_));
      for (const at::Tensor& c : {k_caches_[l], v_caches_[l]})
        TORCH_CHECK(c.scalar_type() == dtype_ && c.is_contiguous() && c.dim() == 3 && c.size(0) == slots &&
                        c.size(1) == Hkv && c.size(2) == D,
                    "DecodeStack: layer ", l, ": ", dtype_, " caches [", slots, ", ", Hkv, ", ", D, "]");
    }
    TORCH_CHECK(head_.empty() || head_.size() == 3, "DecodeStack: head: (final norm, codes, scales) or nothing");
    if (!head_.empty()) {
      TORCH_CHECK(head_[0].scalar_type() == dtype_ && head_[0].is_contiguous() && head_[0].numel() == hid,
                  "DecodeStack: final norm weights of ", hid, " ", dtype_);
      const int64_t N = head_[1].dim() == 4 ? head_[1].size(0) * 16 : 0;
      head_w_ = packed(head_[1], head_[2], at::Tensor(), head_kind, N, hid, L, "lm_head", dtype_, true);
    }
    // The memory lin_, norms_ and head_w_ point into, held as such: a tensor moved afterwards
    // (set_, as kernels/cpu_decode.into_arena moves weights) leaves this stack's copy alive.
    for (const auto* ts : {&layers_, &head_})
      for (const at::Tensor& t : *ts)
        if (t.defined() && t.has_storage()) storages_.push_back(t.storage());
#else
    TORCH_CHECK(false, "DecodeStack: this build has no gemv kernels (AVX512-BF16, or AVX2 and FMA)");
#endif
  }

  // (h, mlp_out) of the last layer for x [rows, hidden] (the stack's dtype), as a chain of
  // decode_layer calls (the first without a residual) returns them; the cache rows of out_loc are written.
  // lora (every method's last argument; None: no adapters): int32 [rows], each row's adapter slot
  // of set_lora's buffers, -1 for none.
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& out_loc,
                                         const at::Tensor& kv_indices, const at::Tensor& seq_lens,
                                         const at::Tensor& extend_lens, const std::optional<at::Tensor>& lora) {
    const auto out = dispatch(false, x, positions, out_loc, kv_indices, seq_lens, extend_lens, lora);
    return {std::get<0>(out), std::get<1>(out)};
  }

  // (the final norm of the last layer's h + mlp_out, the head's logits [rows, vocab] of it) for x,
  // as rms_norm and the head's gemv op give them; the stack must have been built with a head.
  std::tuple<at::Tensor, at::Tensor> run_head(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& out_loc,
                                              const at::Tensor& kv_indices, const at::Tensor& seq_lens,
                                              const at::Tensor& extend_lens, const std::optional<at::Tensor>& lora) {
    TORCH_CHECK(!head_.empty(), "DecodeStack: built without a head");
    const auto out = dispatch(true, x, positions, out_loc, kv_indices, seq_lens, extend_lens, lora);
    return {std::get<0>(out), std::get<1>(out)};
  }

  // Profiling: with it on, every call adds the calling thread's wall time in each phase of the
  // stack (kPhaseNames: setting up and waking the threads; the row loops; its share of the layer
  // GEMMs and its waits for the other threads at their ends; rotary embedding and cache store; the
  // attention; its share of the head; the argmax; the threads' join) to profile()'s sums: the
  // split of a decode step that bench/bench_offline.py prints. Off, a phase's end costs a branch.
  // Turning it on or off clears the sums; not while a call runs.
  // --enable-deterministic-inference: the attention planned batch-invariant (core_attention::plan).
  void set_batch_invariant(bool on) { batch_invariant_ = on; }

  void set_profiling(bool on) {
    profiling_ = on;
    prof_.fill(0.0);
    prof_calls_ = 0;
  }

  // [calls, then the seconds of each phase in phase_names() order] since profiling was turned on.
  std::vector<double> profile() const {
    std::vector<double> out{static_cast<double>(prof_calls_)};
    out.insert(out.end(), prof_.begin(), prof_.end());
    return out;
  }

  std::vector<std::string> phase_names() const { return {std::begin(kPhaseNames), std::end(kPhaseNames)}; }

  // The adapters the calls' lora rows select (core/engine/lora/pool.py's LayerLoRA buffers, in
  // place: an adapter loaded into a slot later is read as it is): per layer and linear (qkv, o,
  // gate, up, down; 5 L entries) a [slots, parts * rank, K] and b [N / 16, slots, rank, 16] in the
  // stack's dtype (empty: no adapters), or int8 where the linear's sa and sb (5 L entries or none)
  // are its scales, float32 [slots, parts * rank] each, and spans 6 ints (part p's first output
  // column and width; width 0: no part p). No tensors: none bound.
  void set_lora(std::vector<at::Tensor> a, std::vector<at::Tensor> b, std::vector<at::Tensor> sa,
                std::vector<at::Tensor> sb, std::vector<int64_t> spans, int64_t slots, int64_t rank) {
#ifdef CORE_GEMV_ANY
    lora_.clear(), lora_tensors_.clear(), lora_slots_ = 0, lora_width_ = 0;
    if (a.empty()) return;
    TORCH_CHECK(static_cast<int64_t>(a.size()) == 5 * L && b.size() == a.size() &&
                    static_cast<int64_t>(spans.size()) == 30 * L && slots > 0 && rank > 0 &&
                    (sa.empty() || sa.size() == a.size()) && sb.size() == sa.size(),
                "DecodeStack: set_lora: per layer and linear an A, a B, 6 span ints (and the int8 ones' scales)");
    std::vector<LoraWeight> out(5 * L);
    for (int64_t i = 0; i < 5 * L; ++i) {
      if (!a[i].numel()) continue;
      LoraWeight& w = out[i];
      w.slots = slots, w.R = rank, w.N = lin_[i].N, w.K = lin_[i].K;
      for (; w.parts < 3 && spans[6 * i + 2 * w.parts + 1] > 0; ++w.parts) {
        const int64_t start = spans[6 * i + 2 * w.parts], size = spans[6 * i + 2 * w.parts + 1];
        TORCH_CHECK(start >= 0 && start % 16 == 0 && size % 16 == 0 && start + size <= w.N,
                    "DecodeStack: set_lora: linear ", i, ": part spans in 16-column blocks inside its ", w.N, " columns");
        w.spans[w.parts][0] = start, w.spans[w.parts][1] = size;
      }
      const bool q8 = !sa.empty() && sa[i].numel();
      const auto wt = q8 ? at::kChar : dtype_;
      TORCH_CHECK(w.parts > 0 && a[i].scalar_type() == wt && b[i].scalar_type() == wt && a[i].is_contiguous() &&
                      b[i].is_contiguous() && a[i].sizes() == at::IntArrayRef({slots, w.width(), w.K}) &&
                      b[i].sizes() == at::IntArrayRef({w.N / 16, slots, rank, 16}),
                  "DecodeStack: set_lora: linear ", i, ": ", wt, " A [", slots, ", ", w.width(), ", ", w.K,
                  "] and B [", w.N / 16, ", ", slots, ", ", rank, ", 16], contiguous");
      if (q8) {
        for (const at::Tensor& s : {sa[i], sb[i]})
          TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.sizes() == at::IntArrayRef({slots, w.width()}),
                      "DecodeStack: set_lora: linear ", i, ": int8 codes' scales float32 [", slots, ", ", w.width(), "]");
        w.sa = sa[i].const_data_ptr<float>(), w.sb = sb[i].const_data_ptr<float>();
        lora_tensors_.push_back(sa[i]), lora_tensors_.push_back(sb[i]);
      }
      w.a = a[i].const_data_ptr(), w.b = b[i].const_data_ptr();
      lora_width_ = std::max(lora_width_, w.width());
      lora_tensors_.push_back(a[i]), lora_tensors_.push_back(b[i]);
    }
    lora_ = std::move(out);
    lora_slots_ = slots;
#endif
  }

  // The token embedding table [vocab, hidden] (the stack's dtype) that decode() looks ids up in.
  void set_embedding(const at::Tensor& table) {
    TORCH_CHECK(table.dim() == 2 && table.size(1) == hid && table.scalar_type() == dtype_ && table.is_contiguous() &&
                    table.device().is_cpu(),
                "DecodeStack: embedding table [vocab, ", hid, "] contiguous ", dtype_, " on the CPU");
    embed_ = table;
  }

  // One decode step of B sequences from plain lists, where the engine's per-step Python calls
  // one method instead of ~8 torch ops (each ~5 us, and 20-50 us with the caches cold after a
  // step's weight stream): sequence b's token ids[b] at positions[b] (embedded through
  // set_embedding's table) into cache slot out_loc[b], its keys at the slots of kv_indices[b]
  // [:seq_lens[b]]. (hidden, logits, next): run_head's outputs for those rows, and each row's
  // argmax over its first `vocab` logits (core_cpu_ops.argmax's index: the greedy token).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> decode(const std::vector<int64_t>& ids,
                                                        const std::vector<int64_t>& positions,
                                                        const std::vector<int64_t>& out_loc, const at::Tensor& kv_indices,
                                                        const std::vector<int64_t>& seq_lens, int64_t vocab,
                                                        const std::optional<at::Tensor>& lora) {
#ifndef CORE_GEMV_ANY
    TORCH_CHECK(false, "DecodeStack: this build has no gemv kernels");
#else
    TORCH_CHECK(!head_.empty() && embed_.defined(), "DecodeStack: decode needs a head and an embedding table");
    const int64_t B = static_cast<int64_t>(ids.size());
    TORCH_CHECK(B > 0 && static_cast<int64_t>(positions.size()) == B && static_cast<int64_t>(out_loc.size()) == B &&
                    static_cast<int64_t>(seq_lens.size()) == B,
                "DecodeStack: decode: one id, position, slot and length per sequence (", B, " ids)");
    TORCH_CHECK(vocab > 0 && vocab <= head_w_.N, "DecodeStack: decode: vocab ", vocab, " outside 1..", head_w_.N);
    const std::vector<int64_t> ones(B, 1);
    return forward_any(true, embed(ids.data(), B), positions.data(), out_loc.data(), kv_indices, seq_lens.data(),
                       ones.data(), B, vocab, lora_slots(lora, B));
#endif
  }

  // Up to `steps` greedy decode steps of B sequences in one call, each step's argmax the next
  // step's ids: what `steps` calls of decode() with the engine's greedy sampling between them
  // compute, without the ~0.5 ms of Python a step costs around each (scheduling, sampling, result
  // processing, the streams; all with cold caches after the step's weight stream). Step k writes
  // sequence b's new key at out_loc[k * B + b] (position positions[b] + k) and attends to
  // kv_indices[b][:seq_lens[b] + k]. Stops after the first step that produces any of stop_ids
  // (the batch's EOS and stop tokens). The tokens, [steps run, B].
  at::Tensor decode_steps(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
                          const std::vector<int64_t>& out_loc, const at::Tensor& kv_indices,
                          const std::vector<int64_t>& seq_lens, int64_t vocab, int64_t steps,
                          const std::vector<int64_t>& stop_ids, const std::optional<at::Tensor>& lora) {
#ifndef CORE_GEMV_ANY
    TORCH_CHECK(false, "DecodeStack: this build has no gemv kernels");
#else
    TORCH_CHECK(!head_.empty() && embed_.defined(), "DecodeStack: decode_steps needs a head and an embedding table");
    const int64_t B = static_cast<int64_t>(ids.size());
    TORCH_CHECK(steps >= 1, "DecodeStack: decode_steps: steps ", steps, " < 1");
    TORCH_CHECK(B > 0 && static_cast<int64_t>(positions.size()) == B && static_cast<int64_t>(seq_lens.size()) == B &&
                    static_cast<int64_t>(out_loc.size()) == B * steps,
                "DecodeStack: decode_steps: one id, position and length per sequence and one slot per sequence and step (",
                B, " ids, ", steps, " steps)");
    TORCH_CHECK(vocab > 0 && vocab <= head_w_.N, "DecodeStack: decode_steps: vocab ", vocab, " outside 1..", head_w_.N);
    // every step's arguments checked before the first step writes the caches
    TORCH_CHECK(kv_indices.dim() == 2, "DecodeStack: decode_steps: kv_indices [B, columns]");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(seq_lens[b] >= 1 && seq_lens[b] + steps - 1 <= kv_indices.size(1) && positions[b] >= 0 &&
                      positions[b] + steps <= cos_.size(0),
                  "DecodeStack: decode_steps: sequence ", b, " (length ", seq_lens[b], ", position ", positions[b],
                  ") does not fit ", steps, " steps in the slot table's ", kv_indices.size(1),
                  " columns and the rotary cache's ", cos_.size(0), " positions");
    for (const int64_t loc : out_loc) TORCH_CHECK(loc >= 0 && loc < slots, "DecodeStack: slot ", loc, " outside the pool");
    const int32_t* lslot = lora_slots(lora, B);
    at::Tensor out = at::empty({steps, B}, at::TensorOptions().dtype(at::kLong));
    int64_t* po = out.data_ptr<int64_t>();
    std::vector<int64_t> pos(positions), sl(seq_lens), cur(ids);
    const std::vector<int64_t> ones(B, 1);
    int64_t k = 0;
    while (k < steps) {
      const at::Tensor next = std::get<2>(
          forward_any(true, embed(cur.data(), B), pos.data(), out_loc.data() + k * B, kv_indices, sl.data(), ones.data(), B, vocab,
                      lslot));
      const int64_t* pn = next.const_data_ptr<int64_t>();
      std::copy(pn, pn + B, po + k * B);
      ++k;
      bool stop = false;
      for (int64_t b = 0; b < B; ++b) {
        cur[b] = pn[b], ++pos[b], ++sl[b];
        stop = stop || std::find(stop_ids.begin(), stop_ids.end(), pn[b]) != stop_ids.end();
      }
      if (stop) break;
    }
    return out.narrow(0, 0, k);
#endif
  }

 private:
  // run / run_head: the tensors' layouts checked, then forward_any.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch(bool head, const at::Tensor& x, const at::Tensor& positions,
                                                          const at::Tensor& out_loc, const at::Tensor& kv_indices,
                                                          const at::Tensor& seq_lens, const at::Tensor& extend_lens,
                                                          const std::optional<at::Tensor>& lora) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dtype_ && x.size(1) == hid,
                "DecodeStack: x [rows, ", hid, "] contiguous ", dtype_);
    const int64_t M = x.size(0);
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == M &&
                    out_loc.scalar_type() == at::kLong && out_loc.is_contiguous() && out_loc.numel() == M,
                "DecodeStack: int64 positions and out_loc, one per row");
    TORCH_CHECK(seq_lens.is_contiguous() && extend_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong &&
                    extend_lens.scalar_type() == at::kLong && extend_lens.numel() == seq_lens.numel(),
                "DecodeStack: int64 seq_lens and extend_lens [B]");
    return forward_any(head, x, positions.const_data_ptr<int64_t>(), out_loc.const_data_ptr<int64_t>(), kv_indices,
                       seq_lens.const_data_ptr<int64_t>(), extend_lens.const_data_ptr<int64_t>(), seq_lens.numel(), 0,
                       lora_slots(lora, M));
  }

  // The slots of lora (int32 [rows]), checked against set_lora's buffers; null for None.
  const int32_t* lora_slots(const std::optional<at::Tensor>& lora, int64_t rows) const {
    if (!lora) return nullptr;
    TORCH_CHECK(lora->scalar_type() == at::kInt && lora->is_contiguous() && lora->numel() == rows && lora->device().is_cpu(),
                "DecodeStack: lora: int32 [", rows, "] adapter slots, one per row");
    const int32_t* s = lora->const_data_ptr<int32_t>();
    for (int64_t m = 0; m < rows; ++m)
      TORCH_CHECK(s[m] >= -1 && s[m] < lora_slots_, "DecodeStack: lora: slot ", s[m], " outside -1..", lora_slots_ - 1,
                  lora_slots_ ? "" : " (set_lora bound no adapters)");
    return s;
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_any(bool head, const at::Tensor& x, const int64_t* pos,
                                                             const int64_t* loc, const at::Tensor& kv_indices,
                                                             const int64_t* sl, const int64_t* el, int64_t B,
                                                             int64_t vocab, const int32_t* lslot) {
#ifdef CORE_GEMV_BF16
    if (dtype_ == at::kBFloat16) return forward<bf16>(head, x, pos, loc, kv_indices, sl, el, B, vocab, lslot);
#endif
#ifdef CORE_GEMV_F32
    if (dtype_ == at::kFloat) return forward<float>(head, x, pos, loc, kv_indices, sl, el, B, vocab, lslot);
#endif
    TORCH_CHECK(false, "DecodeStack: this build has no gemv kernels for ", x.scalar_type());
  }

#ifdef CORE_GEMV_ANY
  // x [B, hid]: the embedding rows of ids (checked against the table).
  at::Tensor embed(const int64_t* ids, int64_t B) const {
    const int64_t V = embed_.size(0);
    at::Tensor x = at::empty({B, hid}, embed_.options());
    const char* table = static_cast<const char*>(embed_.const_data_ptr());
    const size_t row = static_cast<size_t>(hid) * embed_.element_size();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ids[b] >= 0 && ids[b] < V, "DecodeStack: token id ", ids[b], " outside the embedding's ", V, " rows");
      std::memcpy(static_cast<char*>(x.data_ptr()) + b * row, table + ids[b] * row, row);
    }
    return x;
  }

  // The stack on x [M, hid] (M rows: B sequences' extend_lens el of them, each), with the final
  // norm and the head when with_head; with vocab > 0 also each row's argmax over its first vocab
  // logits (else an undefined tensor). (hidden or h, logits or mlp_out, argmax).
  template <typename E>
  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(bool with_head, const at::Tensor& x, const int64_t* pos,
                                                         const int64_t* loc, const at::Tensor& kv_indices,
                                                         const int64_t* sl, const int64_t* el, int64_t B, int64_t vocab,
                                                         const int32_t* lslot) {
    PhaseClock clock{profiling_ ? prof_.data() : nullptr, profiling_ ? seconds() : 0.0};
    const int64_t M = x.size(0);
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(pos[m] >= 0 && pos[m] < cos_.size(0), "DecodeStack: position ", pos[m], " outside the rotary cache");
      TORCH_CHECK(loc[m] >= 0 && loc[m] < slots, "DecodeStack: slot ", loc[m], " outside the pool");
    }
    const int nt = at::get_num_threads();
    const auto opt = x.options();
    // shared: the GEMM outputs and the rotated q; per thread (row t): the row loops' buffers
    at::Tensor qkv = at::empty({M, nqkv}, opt), qr = at::empty({M, H, D}, opt);
    at::Tensor o = at::empty({M, hid}, opt), gate = at::empty({M, I}, opt), up = at::empty({M, I}, opt);
    at::Tensor mlp = at::empty({M, hid}, opt);
    at::Tensor x0 = at::empty({nt, M, hid}, opt), x1 = at::empty({nt, M, hid}, opt), h = at::empty({nt, M, std::max(hid, I)}, opt);
    const int64_t kmax = M * std::max({hid, qs, I});  // the most values a GEMM's input has
    const int64_t nf = kmax / 8 + 1;  // floats for an input's group sums (groups of >= 8 columns) or scales
    at::Tensor xf = at::empty({nt, 4, nf}, opt.dtype(at::kFloat)), xq = at::empty({nt, 2, kmax}, opt.dtype(at::kChar));
    E *pqkv = qkv.data_ptr<E>(), *pqr = qr.data_ptr<E>(), *po = o.data_ptr<E>();
    E *pg = gate.data_ptr<E>(), *pu = up.data_ptr<E>(), *pmlp = mlp.data_ptr<E>();
    const float *pcos = cos_.const_data_ptr<float>(), *psin = sin_.const_data_ptr<float>();
    const float feps = static_cast<float>(eps_);
    // the attention's tasks, the same for every layer of this forward
    TORCH_CHECK(kv_indices.dim() == 2 && kv_indices.stride(1) == 1 && kv_indices.scalar_type() == at::kLong &&
                    kv_indices.device().is_cpu() && kv_indices.size(0) == B,
                "DecodeStack: int64 kv_indices [B, max_len] (contiguous rows), one row per sequence");
    core_attention::Work work;
    core_attention::plan(work, B, sl, el, kv_indices.const_data_ptr<int64_t>(), kv_indices.stride(0), kv_indices.size(1), M, qs, H, Hkv, D,
                         dtype_, scale_, window_, 0.0, nt, batch_invariant_);
    const auto attend = D == 16 ? &core_attention::run_tasks<E, 16>
                        : D == 32 ? &core_attention::run_tasks<E, 32>
                        : D == 64 ? &core_attention::run_tasks<E, 64>
                        : D == 128 ? &core_attention::run_tasks<E, 128> : &core_attention::run_tasks<E, 0>;
    at::Tensor attn = at::empty({M, H, D}, opt);
    E* pa = attn.data_ptr<E>();
    at::Tensor hidden, logits, next;  // with the head: the final norm's rows and the logits (and their argmax)
    const bool f32_head = head_w_.kind == 3;  // int8 blocks: float32 logits
    if (with_head) hidden = at::empty({M, hid}, opt), logits = at::empty({M, head_w_.N}, f32_head ? opt.dtype(at::kFloat) : opt);
    if (with_head && vocab > 0) next = at::empty({M}, opt.dtype(at::kLong));
    int64_t* pnext = next.defined() ? next.data_ptr<int64_t>() : nullptr;
    E* phid = with_head ? hidden.data_ptr<E>() : nullptr;
    E* plog = with_head && !f32_head ? logits.data_ptr<E>() : nullptr;
    float* plogf = with_head && f32_head ? logits.data_ptr<float>() : nullptr;
    const E* fnorm = with_head ? head_[0].const_data_ptr<E>() : nullptr;
    const float ffeps = static_cast<float>(final_eps_);
    // the rows with adapters, by slot, and their h
    LoraBatch lb;
    at::Tensor lora_h;
    if (lslot) {
      for (int32_t s = 0; s < lora_slots_; ++s) {
        for (int64_t m = 0; m < M; ++m)
          if (lslot[m] == s) lb.rows.push_back(m);
        if (static_cast<int64_t>(lb.rows.size()) > lb.start.back()) lb.slot.push_back(s), lb.start.push_back(lb.rows.size());
      }
      lb.M = M, lb.width = lora_width_, lb.slot_of = lslot;
      lora_h = at::empty({2, M, lb.width}, opt.dtype(at::kFloat));
      lb.h = lora_h.data_ptr<float>();
    }
    const bool adapters = lb.groups() > 0;
    // One parallel region for the whole stack: the threads meet after each GEMM, after the rotary
    // embedding and the cache store (rows shared out), and after the attention's tasks.
#pragma omp parallel num_threads(nt)
    {
      const int me = omp_get_thread_num();
      PhaseClock idle;
      PhaseClock& clk = me == 0 ? clock : idle;
      clk.mark(kSetup);
      // The row loops: below kSplitRows rows every thread runs all of them in its own buffers (a
      // few microseconds a layer, where meeting would cost a barrier and a waiting thread), from
      // kSplitRows each its share of the rows in shared buffers (slot 0), the threads then meeting
      // before each GEMM: at 64 rows each thread spent ~6 ms of a ~60 ms step on all of them (Zen 4
      // EPYC, 2 threads). Row boundaries at multiples of 64 elements of the activation (I % 64)
      // leave silu_mul's split between its vector and scalar loops where one call puts it.
      const int64_t nthr = omp_get_num_threads();
      const bool split = M >= kSplitRows && I % 64 == 0;
      const int64_t r0 = split ? me * M / nthr : 0, r1 = split ? (me + 1) * M / nthr : M;
      const int64_t slot = split ? 0 : me;
      E *my_x0 = x0.data_ptr<E>() + slot * M * hid, *my_x1 = x1.data_ptr<E>() + slot * M * hid;
      E* my_h = h.data_ptr<E>() + slot * h.size(1) * h.size(2);
      float* my_f = xf.data_ptr<float>() + slot * 4 * nf;
      int8_t* my_q = xq.data_ptr<int8_t>() + slot * 2 * kmax;
      // two sets: gate and up need their own when their groups differ
      const Scratch sc{my_f, my_q, my_f + nf}, sc2{my_f + 2 * nf, my_q + kmax, my_f + 3 * nf};
      for (int64_t l = 0; l < L; ++l) {
        const E *in_norm = static_cast<const E*>(norms_[2 * l]), *post_norm = static_cast<const E*>(norms_[2 * l + 1]);
        const Weight* w = lin_.data() + 5 * l;
        E* kc = k_caches_[l].data_ptr<E>();
        E* vc = v_caches_[l].data_ptr<E>();
        // the layer's input: x at the first layer, then x1 + the MLP's output
        const E* in = l ? my_x1 : x.const_data_ptr<E>();
        for (int64_t m = r0; m < r1; ++m) {
          if (l)
            add_row<E>(in + m * hid, pmlp + m * hid, my_x0 + m * hid, hid);
          else
            std::copy(in + m * hid, in + (m + 1) * hid, my_x0 + m * hid);
          norm_row<E>(my_x0 + m * hid, in_norm, my_h + m * hid, hid, feps, 0.0f);
        }
        // this layer's linears with adapters (null: none); before such a GEMM the shrinks
        const LoraWeight* lw[5] = {};
        for (int i = 0; i < 5 && adapters; ++i) lw[i] = lora_[5 * l + i].a ? &lora_[5 * l + i] : nullptr;
        const Act aq = prep(w[0], my_h, r0, r1, sc);
        lora_before<E>(lb, split, r0, r1, clk, {lw[0], my_h, lb.h_of(0)});
        gemv_shared<E>({&w[0], aq, pqkv, nullptr, {}, nullptr, &lb, lw[0], nullptr, lb.h_of(0)}, M, clk, split || lw[0]);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {  // rows shared out (at batch 1 one thread, the others waiting)
          const float* cs = pcos + pos[m] * rot_;
          const float* sn = psin + pos[m] * rot_;
          const E* row = pqkv + m * nqkv;
          for (int64_t j = 0; j < H; ++j) rotate_head<E>(row + j * D, pqr + (m * H + j) * D, cs, sn, rot_ / 2, D);
          for (int64_t j = 0; j < Hkv; ++j)  // k rotated straight into its cache row
            rotate_head<E>(row + qs + j * D, kc + loc[m] * kvs + j * D, cs, sn, rot_ / 2, D);
          std::copy(row + qs + kvs, row + nqkv, vc + loc[m] * kvs);
        }
        clk.mark(kRotary);
        attend(work, pqr, kc, vc, pa);
        clk.mark(kAttention);
        const Act ao = prep(w[1], pa, r0, r1, sc);
        lora_before<E>(lb, split, r0, r1, clk, {lw[1], pa, lb.h_of(0)});
        gemv_shared<E>({&w[1], ao, po, nullptr, {}, nullptr, &lb, lw[1], nullptr, lb.h_of(0)}, M, clk, split || lw[1]);
        for (int64_t m = r0; m < r1; ++m) {
          add_row<E>(my_x0 + m * hid, po + m * hid, my_x1 + m * hid, hid);
          norm_row<E>(my_x1 + m * hid, post_norm, my_h + m * hid, hid, feps, 0.0f);
        }
        const Act ag = prep(w[2], my_h, r0, r1, sc);  // up reads x as gate does unless its groups differ
        const Act au = w[3].G == w[2].G ? ag : prep(w[3], my_h, r0, r1, sc2);
        lora_before<E>(lb, split, r0, r1, clk, {lw[2], my_h, lb.h_of(0)}, {lw[3], my_h, lb.h_of(1)});
        gemv_shared<E>({&w[2], ag, pg, &w[3], au, pu, &lb, lw[2], lw[3], lb.h_of(0), lb.h_of(1)}, M, clk,
                       split || lw[2] || lw[3]);
        silu_mul(pg + r0 * I, pu + r0 * I, my_h + r0 * I, (r1 - r0) * I);  // the activation (into h: the norm's rows are used)
        const Act ad = prep(w[4], my_h, r0, r1, sc);
        lora_before<E>(lb, split, r0, r1, clk, {lw[4], my_h, lb.h_of(0)});
        gemv_shared<E>({&w[4], ad, pmlp, nullptr, {}, nullptr, &lb, lw[4], nullptr, lb.h_of(0)}, M, clk, split || lw[4]);
      }
      if (with_head) {  // norm(h + mlp_out), as the model's final norm computes it, then the head
        for (int64_t m = r0; m < r1; ++m) {
          add_row<E>(my_x1 + m * hid, pmlp + m * hid, my_x0 + m * hid, hid);
          norm_row<E>(my_x0 + m * hid, fnorm, my_h + m * hid, hid, ffeps, 0.0f);
        }
        if (split || me == 0) std::copy(my_h + r0 * hid, my_h + r1 * hid, phid + r0 * hid);
        const Act ah = prep(head_w_, my_h, r0, r1, sc);
        if (f32_head)
          blocks_shared(head_w_.N / 16, clk, split, kHead,
                        [&](int64_t i) { weight_block_f32<Bits<E>>(head_w_, ah, plogf, M, i); });
        else
          gemv_shared<E>({&head_w_, ah, plog}, M, clk, split, kHead);
        if (pnext) {  // the rows shared out (every thread has left the head's blocks: they are all written)
          std::vector<float> bmax((vocab + kArgmaxBlock - 1) / kArgmaxBlock);
#pragma omp for schedule(static)
          for (int64_t m = 0; m < M; ++m)
            pnext[m] = f32_head ? argmax_row(plogf + m * head_w_.N, vocab, bmax)
                                : argmax_row(raw(plog + m * head_w_.N), vocab, bmax);
          clk.mark(kArgmax);
        }
      }
      clk.mark(kRows);  // the last layer's (or the final norm's) rows
    }
    clock.mark(kJoin);
    prof_calls_ += profiling_;
    if (with_head) return {hidden, logits, next};
    return {x1[0], mlp, next};
  }
#endif

  std::vector<at::Tensor> layers_, k_caches_, v_caches_, head_, lora_tensors_;
  std::vector<c10::Storage> storages_;  // what lin_, norms_ and head_w_ point into
  at::Tensor embed_;  // decode()'s token embedding table (set_embedding), or undefined
  at::Tensor cos_, sin_;
  double eps_, final_eps_, scale_;
  int64_t window_, rot_, H, Hkv, D, L = 0, hid = 0, qs = 0, kvs = 0, nqkv = 0, I = 0, slots = 0;
  at::ScalarType dtype_ = at::kFloat;
  bool profiling_ = false, batch_invariant_ = false;
  std::array<double, kPhases> prof_{};
  int64_t prof_calls_ = 0;
  int64_t lora_slots_ = 0, lora_width_ = 0;  // set_lora's slots (0: none bound) and the most h values a row has
#ifdef CORE_GEMV_ANY
  std::vector<LoraWeight> lora_;  // per layer and linear
  std::vector<Weight> lin_;
  std::vector<const void*> norms_;
  Weight head_w_{};
#endif
};

// A method's arguments, the last (lora) None unless given.
#define CORE_ARGS(...) {__VA_ARGS__, torch::arg("lora") = torch::arg::none()}
#define ARG(n) torch::arg(#n)

}  // namespace

TORCH_LIBRARY(core_cpu_decode, m) {
  m.def("decode_layer(Tensor x, Tensor? residual, Tensor in_norm, Tensor post_norm, float eps, Tensor[] lin, int[] kinds, int[] max_rows, "
        "Tensor positions, Tensor cos, Tensor sin, int rotary_dim, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_loc, Tensor kv_indices, Tensor seq_lens, "
        "Tensor extend_lens, float scale, int window, float cap, bool batch_invariant=False) -> (Tensor, Tensor)");
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double, at::Tensor, at::Tensor, int64_t, int64_t,
                       int64_t, int64_t, std::vector<at::Tensor>, std::vector<at::Tensor>, double, int64_t,
                       std::vector<at::Tensor>, int64_t, double>())
      .def("run", &DecodeStack::run, "", CORE_ARGS(ARG(x), ARG(positions), ARG(out_loc), ARG(kv_indices), ARG(seq_lens), ARG(extend_lens)))
      .def("run_head", &DecodeStack::run_head, "",
           CORE_ARGS(ARG(x), ARG(positions), ARG(out_loc), ARG(kv_indices), ARG(seq_lens), ARG(extend_lens)))
      .def("set_embedding", &DecodeStack::set_embedding)
      .def("set_lora", &DecodeStack::set_lora)
      .def("decode", &DecodeStack::decode, "", CORE_ARGS(ARG(ids), ARG(positions), ARG(out_loc), ARG(kv_indices), ARG(seq_lens), ARG(vocab)))
      .def("decode_steps", &DecodeStack::decode_steps, "",
           CORE_ARGS(ARG(ids), ARG(positions), ARG(out_loc), ARG(kv_indices), ARG(seq_lens), ARG(vocab), ARG(steps), ARG(stop_ids)))
      .def("set_batch_invariant", &DecodeStack::set_batch_invariant)
      .def("set_profiling", &DecodeStack::set_profiling)
      .def("profile", &DecodeStack::profile)
      .def("phase_names", &DecodeStack::phase_names);
}

// CompositeExplicitAutograd: the oneDNN-packed weights among the arguments carry another dispatch key
TORCH_LIBRARY_IMPL(core_cpu_decode, CompositeExplicitAutograd, m) { m.impl("decode_layer", &decode_layer); }

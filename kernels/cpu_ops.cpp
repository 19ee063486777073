// Two small per-layer ops of a decoder as one C++ loop each on the CPU: RMS norm and the rotary
// embedding of q and k. In eager torch they are 8 and 14 tensor ops, and at decode sizes the
// per-op dispatch costs more than the arithmetic. (The gated activation stays two torch ops here:
// torch's vectorised silu and mul beat a scalar loop.) Each loop rounds intermediates to the
// activation dtype where the torch code in core/layers.py does, so greedy outputs do not move.
// Built by kernels/cpu_ops.py through torch.utils.cpp_extension (-O3 -march=native).

#include "cpu_rows.h"

#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace core_rows;

template <typename T>
void rms_norm_rows(const T* x, int64_t sx, const T* w, T* out, int64_t rows, int64_t n, float eps, float offset) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) norm_row<T>(x + i * sx, w, out + i * n, n, eps, offset);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "rms_norm: x [rows, n] with unit column stride, w [n]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm: x and w dtypes differ");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), static_cast<float>(eps), static_cast<float>(offset));
  });
  return out;
}

// (x + r, rms_norm(x + r)): a residual add and the next norm in one pass over the rows, rounded
// as the two ops round (the sum to the dtype, then the norm of the rounded sum).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                double eps, double offset) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && r.is_contiguous() && r.sizes() == x.sizes() && w.dim() == 1 &&
                  w.size(0) == x.size(1) && w.is_contiguous() && r.scalar_type() == x.scalar_type() &&
                  w.scalar_type() == x.scalar_type(),
              "add_rms_norm: contiguous x and r [rows, n], w [n], one dtype");
  auto sum = at::empty_like(x), out = at::empty_like(x);
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *rp = r.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
    scalar_t *sp = sum.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        add_row<scalar_t>(xp + i * n, rp + i * n, sp + i * n, n);
        norm_row<scalar_t>(sp + i * n, wp, op + i * n, n, static_cast<float>(eps), static_cast<float>(offset));
      }
    });
  });
  return {sum, out};
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& pos, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.stride(2) == 1 &&
                  k.stride(2) == 1 && q.scalar_type() == k.scalar_type(),
              "rotary: q [T, H, D], k [T, Hkv, D], unit stride on D, one dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == rotary_dim && rotary_dim % 2 == 0 && rotary_dim <= q.size(2),
              "rotary: float32 caches [max_pos, rotary_dim]");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == q.size(0) && pos.is_contiguous(),
              "rotary: int64 positions [T]");
  const int64_t t = q.size(0), h = q.size(1), hkv = k.size(1), d = q.size(2), half = rotary_dim / 2;
  auto q_out = at::empty({t, h, d}, q.options());
  auto k_out = at::empty({t, hkv, d}, k.options());
  const int64_t* p = pos.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    const scalar_t *qs = q.data_ptr<scalar_t>(), *ks = k.data_ptr<scalar_t>();
    scalar_t *qo = q_out.data_ptr<scalar_t>(), *ko = k_out.data_ptr<scalar_t>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    at::parallel_for(0, t, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* cs = cp + p[i] * rotary_dim;
        const float* sn = sp + p[i] * rotary_dim;
        for (int64_t j = 0; j < h; ++j) rotate_head<scalar_t>(qs + i * q.stride(0) + j * q.stride(1), qo + (i * h + j) * d, cs, sn, half, d);
        for (int64_t j = 0; j < hkv; ++j) rotate_head<scalar_t>(ks + i * k.stride(0) + j * k.stride(1), ko + (i * hkv + j) * d, cs, sn, half, d);
      }
    });
  });
  return {q_out, k_out};
}

// Row-wise argmax: core_rows::argmax_row (cpu_rows.h, which the decode stack's head uses too).
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.size(1) > 0,
              "argmax: float32 or bfloat16 [rows, n] with unit column stride");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* po = out.data_ptr<int64_t>();
  const bool f32 = x.scalar_type() == at::kFloat;
  const char* base = static_cast<const char*>(x.const_data_ptr());
  const int64_t row_bytes = x.stride(0) * x.element_size();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> bmax((n + kArgmaxBlock - 1) / kArgmaxBlock);
    for (int64_t i = begin; i < end; ++i)
      po[i] = f32 ? argmax_row(reinterpret_cast<const float*>(base + i * row_bytes), n, bmax)
                  : argmax_row(reinterpret_cast<const uint16_t*>(base + i * row_bytes), n, bmax);
  });
  return out;
}

// Inverse-CDF sampling of softmax(x / t) at u, for the sampler's rows without top-k / top-p / min-p:
// the first index whose running mass exceeds u * total (the last one with mass at worst), or
// `fallback` where the row has no finite distribution (NaN, +inf, every entry -inf). One pass of
// exp and block sums, then a search through the blocks: torch's softmax, cumsum and searches
// took ~0.7 ms for one 49152-wide row with cold caches.
constexpr int64_t kSampleBlock = 512;

// One row's max and whether it holds a NaN (8 lanes at a time where AVX2 is there).
inline float max_nan(const float* r, int64_t n, bool& nan) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float m = ninf;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vm = _mm256_set1_ps(ninf), vnan = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(r + j);
    vm = _mm256_max_ps(vm, x);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float v : lanes) m = v > m ? v : m;
  nan = _mm256_movemask_ps(vnan) != 0;
#else
  nan = false;
#endif
  for (; j < n; ++j) {
    m = r[j] > m ? r[j] : m;
    nan |= r[j] != r[j];
  }
  return m;
}

// e[j] = exp((r[j] - m) * inv_t) (0 for -inf) over [lo, hi); returns their sum.
inline float exp_block(const float* r, float* e, int64_t lo, int64_t hi, float m, float inv_t) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float s = 0.f;
  int64_t j = lo;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), vninf = _mm256_set1_ps(ninf);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= hi; j += 8) {
    const __m256 x = _mm256_loadu_ps(r + j);
    __m256 v = vexp_neg(_mm256_mul_ps(_mm256_sub_ps(x, vm), vt));
    v = _mm256_andnot_ps(_mm256_cmp_ps(x, vninf, _CMP_EQ_OQ), v);
    _mm256_storeu_ps(e + j, v);
    acc = _mm256_add_ps(acc, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) s += v;
#endif
  for (; j < hi; ++j) {
    e[j] = r[j] == ninf ? 0.f : exp_neg((r[j] - m) * inv_t);
    s += e[j];
  }
  return s;
}

int64_t sample_row(const float* r, int64_t n, float inv_t, float u, int64_t fallback, std::vector<float>& e,
                   std::vector<double>& bsum) {
  bool nan = false;
  const float m = max_nan(r, n, nan);
  if (nan || !std::isfinite(m)) return fallback;
  const int64_t nb = (n + kSampleBlock - 1) / kSampleBlock;
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    bsum[b] = exp_block(r, e.data(), b * kSampleBlock, std::min(n, (b + 1) * kSampleBlock), m, inv_t);
    total += bsum[b];
  }
  if (!(total > 0.0) || !std::isfinite(total)) return fallback;  // e.g. a temperature so small that 1/t is inf
  const double target = static_cast<double>(u) * total;
  double acc = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    if (acc + bsum[b] <= target) {
      acc += bsum[b];
      continue;
    }
    const int64_t lo = b * kSampleBlock, hi = std::min(n, lo + kSampleBlock);
    for (int64_t j = lo; j < hi; ++j) {
      acc += e[j];
      if (acc > target && e[j] > 0.f) return j;
    }
    break;  // rounding left the target past this block's sum: the last index with mass below
  }
  for (int64_t j = n - 1; j >= 0; --j)
    if (e[j] > 0.f) return j;
  return fallback;
}

at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& u,
                       const at::Tensor& fallback) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "sample_rows: float32 [rows, n] with unit column stride");
  const int64_t rows = x.size(0), n = x.size(1);
  for (const auto* t : {&temperature, &u})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat,
                "sample_rows: temperature and u are float32 [rows]");
  TORCH_CHECK(fallback.dim() == 1 && fallback.size(0) == rows && fallback.scalar_type() == at::kLong,
              "sample_rows: fallback is int64 [rows]");
  auto tc = temperature.contiguous(), uc = u.contiguous(), fc = fallback.contiguous();
  const float* pt = tc.data_ptr<float>();
  const float* pu = uc.data_ptr<float>();
  const int64_t* pf = fc.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(pt[i] > 0.f, "sample_rows: temperatures must be > 0");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* po = out.data_ptr<int64_t>();
  const float* base = x.const_data_ptr<float>();
  const int64_t sx = x.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    // kept per thread: a fresh 200 KB buffer each step is an mmap and page faults
    thread_local std::vector<float> e;
    thread_local std::vector<double> bsum;
    e.resize(std::max<size_t>(e.size(), n));
    bsum.resize(std::max<size_t>(bsum.size(), (n + kSampleBlock - 1) / kSampleBlock));
    for (int64_t i = begin; i < end; ++i) po[i] = sample_row(base + i * sx, n, 1.f / pt[i], pu[i], pf[i], e, bsum);
  });
  return out;
}

// The sampler's filtered rows over their candidates sorted most likely first (`probs` [B, K] and
// their ids `order`; `cols` [B, 5]: temperature, top_k, top_p, min_p, u): the prefix top-k / top-p /
// min-p keep, then the inverse CDF at u, with the float32 roundings of the torch ops it replaces
// (sampler._pick_sorted; torch's CPU cumsum accumulates in double), so the tokens are the same.
// Unless `complete` (the candidates are the whole vocabulary), a row whose kept prefix may reach past
// K gets -1: the caller sorts everything for it. `fallback` where the kept mass is not finite or zero.
int64_t sample_sorted_row(const float* p, const int64_t* ids, int64_t k, const float* c, int64_t fallback,
                          bool complete, std::vector<float>& cdf) {
  const float top_k = c[1], top_p = c[2], min_p = c[3], u = c[4];
  const float floor = p[0] * min_p;
  double acc = 0.0, kept = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    acc += p[j];
    const float exclusive = static_cast<float>(acc) - p[j];
    const bool drop = j > 0 && (static_cast<float>(j) >= top_k || (exclusive >= top_p && top_p < 1.0f) || p[j] < floor);
    kept += drop ? 0.0 : p[j];
    cdf[j] = static_cast<float>(kept);
  }
  if (!complete && !(top_k <= static_cast<float>(k) || (static_cast<float>(acc) >= top_p && top_p < 1.0f) ||
                     p[k - 1] < floor))
    return -1;
  const float total = cdf[k - 1];
  if (!(total > 0.f) || !std::isfinite(total)) return fallback;
  const float target = u * total;
  // searchsorted(cdf, target, right) capped at searchsorted(cdf, total): cdf is non-decreasing
  const int64_t pos = std::upper_bound(cdf.begin(), cdf.begin() + k, target) - cdf.begin();
  const int64_t last = std::lower_bound(cdf.begin(), cdf.begin() + k, total) - cdf.begin();
  return ids[std::min({pos, last, k - 1})];
}

at::Tensor sample_sorted(const at::Tensor& probs, const at::Tensor& order, const at::Tensor& cols,
                         const at::Tensor& fallback, bool complete) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.size(1) > 0 && order.sizes() == probs.sizes() &&
                  order.scalar_type() == at::kLong,
              "sample_sorted: float32 probs [rows, k] and int64 order of the same shape");
  const int64_t rows = probs.size(0), k = probs.size(1);
  TORCH_CHECK(cols.dim() == 2 && cols.size(0) == rows && cols.size(1) == 5 && cols.scalar_type() == at::kFloat,
              "sample_sorted: cols is float32 [rows, 5]");
  TORCH_CHECK(fallback.dim() == 1 && fallback.size(0) == rows && fallback.scalar_type() == at::kLong,
              "sample_sorted: fallback is int64 [rows]");
  auto pc = probs.contiguous(), oc = order.contiguous(), cc = cols.contiguous(), fc = fallback.contiguous();
  const float* pp = pc.data_ptr<float>();
  const int64_t* po = oc.data_ptr<int64_t>();
  const float* pcol = cc.data_ptr<float>();
  const int64_t* pf = fc.data_ptr<int64_t>();
  auto out = at::empty({rows}, probs.options().dtype(at::kLong));
  int64_t* pout = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> cdf;  // as in sample_rows: a full-vocabulary row is 200 KB
    cdf.resize(std::max<size_t>(cdf.size(), k));
    for (int64_t i = begin; i < end; ++i)
      pout[i] = sample_sorted_row(pp + i * k, po + i * k, k, pcol + i * 5, pf[i], complete, cdf);
  });
  return out;
}

bool rows_contiguous(const at::Tensor& x) {  // each x[i] is one contiguous block (the rows may be strided)
  int64_t expected = 1;
  for (int64_t d = x.dim() - 1; d >= 1; --d) {
    if (x.size(d) != 1 && x.stride(d) != expected) return false;
    expected *= x.size(d);
  }
  return true;
}

// k_cache[loc[i]] = k[i] and v_cache[loc[i]] = v[i]: a step's new keys and values into the pool,
// one memcpy per row (index_copy_ twice costs ~15 us of dispatch and iterator setup per layer).
void store_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k.dim() >= 1 && v.dim() >= 1 &&
                  rows_contiguous(k) && rows_contiguous(v) && k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == v_cache.scalar_type() && k_cache.size(0) == v_cache.size(0) &&
                  k.numel() == k.size(0) * (k_cache.numel() / std::max<int64_t>(k_cache.size(0), 1)) &&
                  v.numel() == v.size(0) * (v_cache.numel() / std::max<int64_t>(v_cache.size(0), 1)),
              "store_kv: contiguous caches [slots, ...] and rows k, v of their row shape and dtype");
  TORCH_CHECK(loc.dim() == 1 && loc.scalar_type() == at::kLong && loc.is_contiguous() && loc.size(0) == k.size(0) &&
                  loc.size(0) == v.size(0),
              "store_kv: int64 slots [T], one per row");
  const int64_t t = loc.size(0), slots = k_cache.size(0);
  const int64_t kb = k.numel() / std::max<int64_t>(t, 1) * k.element_size();
  const int64_t vb = v.numel() / std::max<int64_t>(t, 1) * v.element_size();
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  const int64_t* l = loc.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(l[i] >= 0 && l[i] < slots, "store_kv: slot ", l[i], " outside the pool");
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, t, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(kc + l[i] * kb, kp + i * ks, kb);
      std::memcpy(vc + l[i] * vb, vp + i * vs, vb);
    }
  });
}

// Row b of a decode batch's slot table [B, n] up to seq_lens[b], zeros after it, as a new tensor:
// ForwardBatch's padding promise. The torch form (an arange, a broadcast compare, an out-of-place
// masked_fill) took ~70 us at 256 rows of ~190 columns; this is one copy (~5 us), on one thread.
at::Tensor zero_past(const at::Tensor& table, const at::Tensor& seq_lens) {
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1 && table.scalar_type() == at::kLong,
              "zero_past: int64 [B, n] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.size(0) == table.size(0),
              "zero_past: int64 seq_lens [B], one per row");
  const int64_t rows = table.size(0), n = table.size(1), stride = table.stride(0);
  auto out = at::empty({rows, n}, table.options());
  const int64_t* src = table.const_data_ptr<int64_t>();
  const int64_t* len = seq_lens.const_data_ptr<int64_t>();
  int64_t* dst = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t keep = std::clamp<int64_t>(len[b], 0, n);
    std::memcpy(dst + b * n, src + b * stride, keep * sizeof(int64_t));
    std::memset(dst + b * n + keep, 0, (n - keep) * sizeof(int64_t));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(core_cpu_ops, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, float offset) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("sample_rows(Tensor x, Tensor temperature, Tensor u, Tensor fallback) -> Tensor");
  m.def("sample_sorted(Tensor probs, Tensor order, Tensor cols, Tensor fallback, bool complete) -> Tensor");
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor loc, Tensor k, Tensor v) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps, float offset) -> (Tensor, Tensor)");
  m.def("rotary(Tensor pos, Tensor q, Tensor k, Tensor cos, Tensor sin, int rotary_dim) -> (Tensor, Tensor)");
  m.def("zero_past(Tensor table, Tensor seq_lens) -> Tensor");
}

TORCH_LIBRARY_IMPL(core_cpu_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("argmax", &argmax);
  m.impl("sample_rows", &sample_rows);
  m.impl("sample_sorted", &sample_sorted);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("store_kv", &store_kv);
  m.impl("zero_past", &zero_past);
}

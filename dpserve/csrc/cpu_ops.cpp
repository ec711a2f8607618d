// Fused CPU kernels for decode steps (dpserve/cpu_ops.py builds and loads them).
//
// Each replaces a chain of small ATen ops whose fixed per-call cost, not their arithmetic, made up
// most of a CPU decode step (docs/benchmarks.md, "Fused CPU kernels"). Attention computes in float32
// and rounds once, its output; the elementwise kernels round as the eager forms do (below).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kKeyBlock = 256;  // keys scored at once (online softmax across blocks)

// FP8 codes to float32, exactly: their sign, exponent and mantissa bits placed in a float32's, times
// 2^(127 - bias) (subnormals included). kMantissa 3: float8_e4m3fn (bias 7); 2: float8_e5m2 (bias
// 15). No weight or KV code is NaN or inf: both are scaled to the format's largest finite value.
template <int kMantissa>
constexpr float kFp8Factor = kMantissa == 3 ? 0x1p120f : 0x1p112f;

template <int kMantissa>
inline float fp8_value(uint8_t v) {
  const uint32_t bits = (uint32_t(v & 0x80) << 24) | (uint32_t(v & 0x7f) << (23 - kMantissa));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * kFp8Factor<kMantissa>;
}

// An 8-bit KV cache's code, read by the attention kernel as any other cache element type.
template <int kMantissa>
struct Fp8 {
  uint8_t bits;
  explicit operator float() const { return fp8_value<kMantissa>(bits); }
};

// A float32 vector register: AVX-512 or AVX2 where the compiler targets them (-march=native), else
// one lane. Loads widen bfloat16 and float16 to float32.
#if defined(__AVX512F__)
struct Vec {
  static constexpr int64_t kWidth = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static Vec load(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  // FP8 codes to float32 (fp8_value, a lane at a time)
  template <int M = 3>
  static Vec load_fp8(const uint8_t* p) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24),
                                         _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7f)), 23 - M));
    return {_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(kFp8Factor<M>))};
  }
  template <int M>
  static Vec load(const Fp8<M>* p) { return load_fp8<M>(reinterpret_cast<const uint8_t*>(p)); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  Vec operator*(Vec b) const { return {_mm512_mul_ps(v, b.v)}; }
  Vec operator+(Vec b) const { return {_mm512_add_ps(v, b.v)}; }
  Vec operator-(Vec b) const { return {_mm512_sub_ps(v, b.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
  // exp on [-87.3, 88.7] (clamped outside), within 2 ulp: 2^n * p(r), Cephes' polynomial.
  Vec exp() const {
    const __m512 x = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return {_mm512_scalef_ps(p, n)};
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Vec {
  static constexpr int64_t kWidth = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
  }
  static Vec load(const c10::Half* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  template <int M = 3>
  static Vec load_fp8(const uint8_t* p) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24),
                                         _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), 23 - M));
    return {_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(kFp8Factor<M>))};
  }
  template <int M>
  static Vec load(const Fp8<M>* p) { return load_fp8<M>(reinterpret_cast<const uint8_t*>(p)); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  Vec operator*(Vec b) const { return {_mm256_mul_ps(v, b.v)}; }
  Vec operator+(Vec b) const { return {_mm256_add_ps(v, b.v)}; }
  Vec operator-(Vec b) const { return {_mm256_sub_ps(v, b.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  float max() const {
    float lanes[kWidth];
    store(lanes);
    return *std::max_element(lanes, lanes + kWidth);
  }
  Vec exp() const {
    float lanes[kWidth];
    store(lanes);
    for (float& x : lanes) x = std::exp(x);
    return load(lanes);
  }
  float sum() const {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
};
#else
struct Vec {
  static constexpr int64_t kWidth = 1;
  float v;
  static Vec zero() { return {0.f}; }
  static Vec set(float x) { return {x}; }
  template <typename T>
  static Vec load(const T* p) { return {static_cast<float>(*p)}; }
  template <int M = 3>
  static Vec load_fp8(const uint8_t* p) { return {fp8_value<M>(*p)}; }
  void store(float* p) const { *p = v; }
  static Vec fma(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
  Vec operator*(Vec b) const { return {v * b.v}; }
  Vec operator+(Vec b) const { return {v + b.v}; }
  Vec operator-(Vec b) const { return {v - b.v}; }
  static Vec max(Vec a, Vec b) { return {std::max(a.v, b.v)}; }
  float max() const { return v; }
  Vec exp() const { return {std::exp(v)}; }
  float sum() const { return v; }
};
#endif

// Stores the lanes as T, rounded to nearest even (as c10's conversions round).
template <typename T>
inline void store_as(Vec x, T* p) {
  float lanes[Vec::kWidth];
  x.store(lanes);
  for (int64_t i = 0; i < Vec::kWidth; ++i) p[i] = static_cast<T>(lanes[i]);
}
template <>
inline void store_as<float>(Vec x, float* p) {
  x.store(p);
}
#if defined(__AVX512F__)
inline __m512i bfloat16_rounded_bits(__m512 x) {  // c10::BFloat16's rounding, NaN aside
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}
template <>
inline void store_as<c10::BFloat16>(Vec x, c10::BFloat16* p) {
  const __m256i narrow = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bfloat16_rounded_bits(x.v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow);
}
template <>
inline void store_as<c10::Half>(Vec x, c10::Half* p) {
  const __m256i narrow = _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow);
}
#endif

// Each lane rounded to T and widened back: what an ATen op with a T output keeps.
template <typename T>
inline Vec rounded(Vec x) {
  T lanes[Vec::kWidth];
  store_as(x, lanes);
  return Vec::load(lanes);
}
template <>
inline Vec rounded<float>(Vec x) {
  return x;
}

// scores[g * kKeyBlock + l] = scale * q_g . keys[l], for gs query heads (rows of qf, each d wide)
// and nk keys: four heads at a time share each load of a key.
template <typename T>
void score_block(const float* qf, int64_t gs, int64_t d, const T* const* keys, int64_t nk, float scale,
                 float* scores) {
  constexpr int64_t W = Vec::kWidth;
  for (int64_t l = 0; l < nk; ++l) {
    const T* key = keys[l];
    int64_t g = 0;
    for (; g + 4 <= gs; g += 4) {
      const float* q0 = qf + g * d;
      Vec a0 = Vec::zero(), a1 = Vec::zero(), a2 = Vec::zero(), a3 = Vec::zero();
      int64_t j = 0;
      for (; j + W <= d; j += W) {
        const Vec k = Vec::load(key + j);
        a0 = Vec::fma(Vec::load(q0 + j), k, a0);
        a1 = Vec::fma(Vec::load(q0 + d + j), k, a1);
        a2 = Vec::fma(Vec::load(q0 + 2 * d + j), k, a2);
        a3 = Vec::fma(Vec::load(q0 + 3 * d + j), k, a3);
      }
      float s[4] = {a0.sum(), a1.sum(), a2.sum(), a3.sum()};
      for (; j < d; ++j)
        for (int64_t u = 0; u < 4; ++u) s[u] += q0[u * d + j] * static_cast<float>(key[j]);
      for (int64_t u = 0; u < 4; ++u) scores[(g + u) * kKeyBlock + l] = s[u] * scale;
    }
    for (; g < gs; ++g) {
      const float* q0 = qf + g * d;
      Vec a = Vec::zero();
      int64_t j = 0;
      for (; j + W <= d; j += W) a = Vec::fma(Vec::load(q0 + j), Vec::load(key + j), a);
      float s = a.sum();
      for (; j < d; ++j) s += q0[j] * static_cast<float>(key[j]);
      scores[g * kKeyBlock + l] = s * scale;
    }
  }
}

// acc[j] += sum_l p[l] * values[l][j] for j < n: four vector registers of acc at a time stay in
// registers over the block's keys.
template <typename T>
void accumulate_block(const float* p, const T* const* values, int64_t nk, float* acc, int64_t n) {
  constexpr int64_t W = Vec::kWidth;
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    Vec r0 = Vec::load(acc + j), r1 = Vec::load(acc + j + W), r2 = Vec::load(acc + j + 2 * W),
        r3 = Vec::load(acc + j + 3 * W);
    for (int64_t l = 0; l < nk; ++l) {
      const Vec pl = Vec::set(p[l]);
      const T* v = values[l] + j;
      r0 = Vec::fma(pl, Vec::load(v), r0);
      r1 = Vec::fma(pl, Vec::load(v + W), r1);
      r2 = Vec::fma(pl, Vec::load(v + 2 * W), r2);
      r3 = Vec::fma(pl, Vec::load(v + 3 * W), r3);
    }
    r0.store(acc + j), r1.store(acc + j + W), r2.store(acc + j + 2 * W), r3.store(acc + j + 3 * W);
  }
  for (; j + W <= n; j += W) {
    Vec r = Vec::load(acc + j);
    for (int64_t l = 0; l < nk; ++l) r = Vec::fma(Vec::set(p[l]), Vec::load(values[l] + j), r);
    r.store(acc + j);
  }
  for (; j < n; ++j)
    for (int64_t l = 0; l < nk; ++l) acc[j] += p[l] * static_cast<float>(values[l][j]);
}

// One query per row. Row i attends to the first seq_lens[i] slots of req_to_token[table_rows[i]]; the
// query heads of a KV head read each of its keys once. Work is split over (row, KV head, block of
// query heads), so that one row with one KV head still keeps every thread busy. Caches of type C:
// T, or FP8 codes (widened as they are read) with a float32 scale per (slot, KV head) (ks, vs; null
// otherwise), applied to each key's scores and each value's probabilities.
template <typename T, typename C>
void decode_attention_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& req_to_token, const at::Tensor& table_rows,
                             const at::Tensor& seq_lens, double scale, int64_t v_dim, const float* ks,
                             const float* vs, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const int64_t table_stride = req_to_token.stride(0);
  const T* qp = q.const_data_ptr<T>();
  const C* kp = static_cast<const C*>(k_cache.const_data_ptr());
  const C* vp = static_cast<const C*>(v_cache.const_data_ptr());
  const int32_t* table = req_to_token.const_data_ptr<int32_t>();
  const int32_t* rows = table_rows.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  T* op = out.data_ptr<T>();

  const int64_t pairs = n * kv_heads;
  const int64_t splits = std::min(group, std::max<int64_t>(1, (at::get_num_threads() + pairs - 1) / pairs));
  const int64_t per_split = (group + splits - 1) / splits;
  at::parallel_for(0, pairs * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_split * d), scores(per_split * kKeyBlock), acc(per_split * v_dim);
    std::vector<float> run_max(per_split), run_sum(per_split);
    std::vector<float> key_scale(kKeyBlock), value_scale(kKeyBlock);
    std::vector<const C*> keys(kKeyBlock), values(kKeyBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task / splits, i = pair / kv_heads, h = pair % kv_heads;
      const int64_t g0 = (task % splits) * per_split, g1 = std::min(group, g0 + per_split), gs = g1 - g0;
      if (gs <= 0) continue;
      const int32_t* slots = table + rows[i] * table_stride;
      const int64_t len = lens[i];
      for (int64_t g = 0; g < gs; ++g) {
        const T* src = qp + (i * heads + h * group + g0 + g) * d;
        for (int64_t j = 0; j < d; ++j) qf[g * d + j] = static_cast<float>(src[j]);
        run_max[g] = -std::numeric_limits<float>::infinity();
        run_sum[g] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + gs * v_dim, 0.f);
      for (int64_t b0 = 0; b0 < len; b0 += kKeyBlock) {
        const int64_t b1 = std::min(len, b0 + kKeyBlock);
        const int64_t nk = b1 - b0;
        for (int64_t l = 0; l < nk; ++l) {
          const int64_t row = slots[b0 + l] * kv_heads + h;
          keys[l] = kp + row * d;
          values[l] = vp + row * v_dim;
          if (ks) key_scale[l] = ks[row], value_scale[l] = vs[row];
        }
        score_block(qf.data(), gs, d, keys.data(), nk, static_cast<float>(scale), scores.data());
        for (int64_t g = 0; g < gs; ++g) {
          float* s = &scores[g * kKeyBlock];
          if (ks)
            for (int64_t l = 0; l < nk; ++l) s[l] *= key_scale[l];
          constexpr int64_t W = Vec::kWidth;
          int64_t l = 0;
          Vec vmax = Vec::set(run_max[g]);
          for (; l + W <= nk; l += W) vmax = Vec::max(vmax, Vec::load(s + l));
          float m = vmax.max();
          for (; l < nk; ++l) m = std::max(m, s[l]);
          const float rescale = std::exp(run_max[g] - m);  // 0 on the first block (-inf)
          Vec vsum = Vec::zero();
          const Vec vm = Vec::set(m);
          for (l = 0; l + W <= nk; l += W) {
            const Vec e = (Vec::load(s + l) - vm).exp();
            e.store(s + l);
            vsum = vsum + e;
          }
          float sum = vsum.sum();
          for (; l < nk; ++l) {
            s[l] = std::exp(s[l] - m);
            sum += s[l];
          }
          run_sum[g] = run_sum[g] * rescale + sum;
          run_max[g] = m;
          if (rescale != 1.f)
            for (int64_t j = 0; j < v_dim; ++j) acc[g * v_dim + j] *= rescale;
          if (vs)  // each value's scale on its probability: acc sums p * scale * codes
            for (l = 0; l < nk; ++l) s[l] *= value_scale[l];
        }
        for (int64_t g = 0; g < gs; ++g) accumulate_block(&scores[g * kKeyBlock], values.data(), nk, &acc[g * v_dim], v_dim);
      }
      for (int64_t g = 0; g < gs; ++g) {
        T* dst = op + (i * heads + h * group + g0 + g) * v_dim;
        const float inv = 1.f / run_sum[g];
        for (int64_t j = 0; j < v_dim; ++j) dst[j] = static_cast<T>(acc[g * v_dim + j] * inv);
      }
    }
  });
}

// Calls f(T{}) for the dtypes the kernels take: float32, bfloat16, float16.
template <typename F>
void dispatch(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16, not ", dtype);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& req_to_token, const at::Tensor& table_rows, const at::Tensor& seq_lens,
                            double scale, int64_t v_dim, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3, "decode_attention: q [n, heads, d], k_cache [slots, kv_heads, d]");
  TORCH_CHECK(k_cache.is_contiguous() && req_to_token.scalar_type() == at::kInt && req_to_token.stride(1) == 1,
              "decode_attention: a contiguous cache and an int32 request-to-slot table");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0, "decode_attention: head shapes");
  TORCH_CHECK(v_cache.is_contiguous() && v_cache.size(1) == k_cache.size(1) && v_cache.size(2) == v_dim,
              "decode_attention: v_cache [slots, kv_heads, v_dim]");
  const at::ScalarType cache = k_cache.scalar_type();
  const bool fp8 = cache == at::kFloat8_e4m3fn || cache == at::kFloat8_e5m2;
  TORCH_CHECK(v_cache.scalar_type() == cache && (fp8 || cache == q.scalar_type()),
              "decode_attention: the caches in q's dtype, or both FP8");
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()),
              "decode_attention: an FP8 cache takes k_scale and v_scale, another none");
  const float *ks = nullptr, *vs = nullptr;
  if (fp8) {
    for (const at::Tensor* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == k_cache.size(0) * k_cache.size(1),
                  "decode_attention: scales float32 [slots, kv_heads, 1]");
    ks = k_scale->const_data_ptr<float>(), vs = v_scale->const_data_ptr<float>();
  }
  const at::Tensor qc = q.contiguous(), rows = table_rows.to(at::kInt).contiguous();
  const at::Tensor lens = seq_lens.to(at::kInt).contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1), v_dim}, q.options());
  dispatch(q.scalar_type(), "decode_attention", [&](auto tag) {
    using T = decltype(tag);
    const auto run = [&](auto code) {
      decode_attention_kernel<T, decltype(code)>(qc, k_cache, v_cache, req_to_token, rows, lens, scale, v_dim, ks,
                                                 vs, out);
    };
    if (cache == at::kFloat8_e4m3fn) return run(Fp8<3>{});
    if (cache == at::kFloat8_e5m2) return run(Fp8<2>{});
    run(T{});
  });
  return out;
}


// Elementwise kernels: the same roundings as the ATen ops they replace (each intermediate the eager
// code keeps in the tensors' dtype is rounded to it here too, and -ffp-contract=off keeps a * b - c * d
// from becoming a fused multiply-add), so that both paths give the same tokens.

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// Rows small enough to run on one thread, so that a decode step's few rows pay no thread wake-up.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// weight * (x * rsqrt(mean(x^2) + eps)), statistics in float32 (RMSNorm of dpserve/layers/norm.py):
// the same bits as the eager form.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: x [..., d] and weight [d] of one dtype");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t d = x.size(-1), rows = d ? xc.numel() / d : 0;
  // The statistics by the eager form's own ATen ops (their summation order decides the last bit, and
  // a greedy decode can follow that bit), the rest in one pass.
  const at::Tensor stats = xc.to(at::kFloat).pow(2).mean(-1).contiguous();
  const float* mean_squares = stats.const_data_ptr<float>();
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T *xp = xc.const_data_ptr<T>(), *wp = wc.const_data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = xp + r * d;
        constexpr int64_t W = Vec::kWidth;
        const float inv = 1.f / std::sqrt(mean_squares[r] + static_cast<float>(eps));
        T* dst = op + r * d;
        int64_t j = 0;
        for (; j + W <= d; j += W)
          store_as(Vec::load(wp + j) * rounded<T>(Vec::load(row + j) * Vec::set(inv)), dst + j);
        for (; j < d; ++j) {
          const T normed = round_to<T>(static_cast<float>(row[j]) * inv);
          dst[j] = round_to<T>(static_cast<float>(wp[j]) * static_cast<float>(normed));
        }
      }
    });
  });
  return out;
}

// RoPE on x [tokens, heads, d] (any strides but the last) at `positions`, from a [max_positions, d]
// table holding cos | sin of the d / 2 frequencies (RotaryEmbedding of dpserve/layers/rotary.py):
// adjacent pairs (interleaved) or the two halves.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos_sin, const at::Tensor& positions, bool interleaved) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cos_sin.is_contiguous() && x.size(2) == cos_sin.size(1) &&
                  x.size(2) % 2 == 0 && x.scalar_type() == cos_sin.scalar_type(),
              "rotary: x [tokens, heads, d], a [positions, d] table of x's dtype");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  at::Tensor out = at::empty({n, heads, d}, x.options());
  dispatch(x.scalar_type(), "rotary", [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.const_data_ptr<T>(), *tp = cos_sin.const_data_ptr<T>();
    const int64_t* pp = pos.const_data_ptr<int64_t>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, grain(heads * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T *cos = tp + pp[t] * d, *sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) {
          const T* src = xp + t * s0 + h * s1;
          T* dst = op + (t * heads + h) * d;
          int64_t j = 0;
          if (!interleaved) {
            for (; j + Vec::kWidth <= half; j += Vec::kWidth) {
              const Vec x1 = Vec::load(src + j), x2 = Vec::load(src + half + j);
              const Vec c = Vec::load(cos + j), sn = Vec::load(sin + j);
              store_as(rounded<T>(x1 * c) - rounded<T>(x2 * sn), dst + j);
              store_as(rounded<T>(x2 * c) + rounded<T>(x1 * sn), dst + half + j);
            }
          }
          for (; j < half; ++j) {
            const int64_t i1 = interleaved ? 2 * j : j, i2 = interleaved ? 2 * j + 1 : j + half;
            const float x1 = static_cast<float>(src[i1]), x2 = static_cast<float>(src[i2]);
            const float c = static_cast<float>(cos[j]), sn = static_cast<float>(sin[j]);
            const float a = static_cast<float>(round_to<T>(x1 * c)), b = static_cast<float>(round_to<T>(x2 * sn));
            const float e = static_cast<float>(round_to<T>(x2 * c)), f = static_cast<float>(round_to<T>(x1 * sn));
            dst[i1] = round_to<T>(a - b);
            dst[i2] = round_to<T>(e + f);
          }
        }
      }
    });
  });
  return out;
}

// silu(gate) * up for gate_up [..., 2 * inter] (gate first): the MLP's activation, by ATen's own
// kernels (the same bits as F.silu(gate) * up) without a Python call per op.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_and_mul: an even last dimension (gate | up)");
  const int64_t inter = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, inter)).mul_(gate_up.narrow(-1, inter, inter));
}

// Sets to -inf, in place, the logits of `rows` whose bit in the row's token bitmask is 0
// (xgrammar's layout: int32 words, token t at bit t % 32 of word t / 32; bitmask row i masks
// logits row rows[i]). Words that allow every token, or none, are handled whole.
void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask: float32 logits [rows, vocab], each row contiguous");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(), "apply_token_bitmask: contiguous int32 bitmask");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.numel() == bitmask.size(0), "apply_token_bitmask: one int64 row per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), row_stride = logits.stride(0);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask: the bitmask covers fewer tokens than the logits");
  float* out = logits.data_ptr<float>();
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* dst = out + row[i] * row_stride;
      const int32_t* src = bits + i * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = static_cast<uint32_t>(src[w]);
        if (word == 0xFFFFFFFFu) continue;
        const int64_t n = std::min<int64_t>(32, vocab - w * 32);
        if (word == 0) {  // the common case: a grammar allows few tokens
          std::fill_n(dst + w * 32, n, neg_inf);
          continue;
        }
        for (int64_t b = 0; b < n; ++b)
          if (!(word >> b & 1u)) dst[w * 32 + b] = neg_inf;
      }
    }
  });
}


// W8A8-INT8 linear (SGLang's w8a8_int8): x [m, k] quantized per token to int8 (scale amax / 127,
// rounded half to even), int8 weights [n, k] with a float32 scale per output row; exact int32 dot
// products, then out = float(dot) * x_scale * w_scale (+ bias), rounded once to x's dtype. The plain
// PyTorch form in dpserve/layers/quant.py gives the same bits.
#if defined(__AVX2__)
using I16x16 = __m256i;  // sixteen int16 lanes: int8 values widened, multiplied in pairs to int32
inline I16x16 load_i16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i dot_accumulate(__m256i acc, I16x16 a, I16x16 b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);  // VNNI: the multiply and the add in one instruction
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
inline int32_t lanes_sum(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
  return _mm_cvtsi128_si32(x);
}
constexpr int64_t kDotStep = 16;
#else
constexpr int64_t kDotStep = 1;
#endif
// The 8-bit linears' register tile (int8 and FP8 alike): a tile of weight rows widened once, then
// its dots with every token, kTokenTile tokens at a time.
constexpr int64_t kRowTile = 4;    // weight rows sharing each load of an activation row
constexpr int64_t kTokenTile = 3;  // activation rows sharing each load of a weight row (12 accumulators)

// dots[t * kRowTile + r] = xq[t] . wq[r] for TT rows of xq and kRowTile rows of wq, each `k` int16
// values (k a multiple of kDotStep, zero-padded).
template <int64_t TT>
inline void tile_dots(const int16_t* xq, const int16_t* wq, int64_t k, int32_t* dots) {
#if defined(__AVX2__)
  __m256i acc[TT][kRowTile];
  for (int64_t t = 0; t < TT; ++t)
    for (int64_t r = 0; r < kRowTile; ++r) acc[t][r] = _mm256_setzero_si256();
  for (int64_t j = 0; j < k; j += kDotStep) {
    for (int64_t r = 0; r < kRowTile; ++r) {
      const I16x16 w = load_i16(wq + r * k + j);
      for (int64_t t = 0; t < TT; ++t) acc[t][r] = dot_accumulate(acc[t][r], load_i16(xq + t * k + j), w);
    }
  }
  for (int64_t t = 0; t < TT; ++t)
    for (int64_t r = 0; r < kRowTile; ++r) dots[t * kRowTile + r] = lanes_sum(acc[t][r]);
#else
  for (int64_t t = 0; t < TT; ++t)
    for (int64_t r = 0; r < kRowTile; ++r) {
      int32_t acc = 0;
      for (int64_t j = 0; j < k; ++j) acc += int32_t(xq[t * k + j]) * int32_t(wq[r * k + j]);
      dots[t * kRowTile + r] = acc;
    }
#endif
}

// dots[t * kRowTile + r] = x[t] . w[r] over k floats (k a multiple of Vec::kWidth, zero-padded).
template <int64_t TT>
inline void tile_dots(const float* x, const float* w, int64_t k, float* dots) {
  Vec acc[TT][kRowTile];
  for (int64_t t = 0; t < TT; ++t)
    for (int64_t r = 0; r < kRowTile; ++r) acc[t][r] = Vec::zero();
  for (int64_t j = 0; j < k; j += Vec::kWidth) {
    for (int64_t r = 0; r < kRowTile; ++r) {
      const Vec wv = Vec::load(w + r * k + j);
      for (int64_t t = 0; t < TT; ++t) acc[t][r] = Vec::fma(Vec::load(x + t * k + j), wv, acc[t][r]);
    }
  }
  for (int64_t t = 0; t < TT; ++t)
    for (int64_t r = 0; r < kRowTile; ++r) dots[t * kRowTile + r] = acc[t][r].sum();
}

// dots[t * kRowTile + r] = x[t] . wide[r] for every token of x (rows of kp values) and a tile's
// kRowTile widened weight rows; `tile_dots` for int16 (int8) or float (FP8) values.
template <typename X, typename D>
inline void every_token_dots(const X* x, int64_t tokens, const X* wide, int64_t kp, D* dots) {
  int64_t t = 0;
  for (; t + kTokenTile <= tokens; t += kTokenTile) tile_dots<kTokenTile>(x + t * kp, wide, kp, dots + t * kRowTile);
  for (; t < tokens; ++t) tile_dots<1>(x + t * kp, wide, kp, dots + t * kRowTile);
}

template <typename T>
void int8_linear_kernel(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_scale, const float* bias,
                        at::Tensor& out) {
  const int64_t tokens = x.size(0), k = x.size(1), n = wq.size(0);
  const int64_t kp = (k + kDotStep - 1) / kDotStep * kDotStep;
  std::vector<int16_t> xq(tokens * kp, 0);
  std::vector<float> x_scale(tokens);
  const T* xs = x.data_ptr<T>();
  at::parallel_for(0, tokens, grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = xs + t * k;
      float amax = 0.f;
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(static_cast<float>(row[j])));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const float q = std::nearbyint(static_cast<float>(row[j]) * inv);
        xq[t * kp + j] = static_cast<int16_t>(std::min(127.f, std::max(-127.f, q)));
      }
      x_scale[t] = amax / 127.f;
    }
  });
  const int8_t* w = wq.data_ptr<int8_t>();
  const float* ws = w_scale.data_ptr<float>();
  T* dst = out.data_ptr<T>();
  const int64_t tiles = (n + kRowTile - 1) / kRowTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // A tile's weight rows widened once, shared by every token (rows past n stay zero).
    std::vector<int16_t> wide(kRowTile * kp, 0);
    std::vector<int32_t> dots(tokens * kRowTile);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = tile * kRowTile, rows = std::min(kRowTile, n - r0);
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* src = w + (r0 + r) * k;
        int16_t* row = wide.data() + r * kp;
        for (int64_t j = 0; j < k; ++j) row[j] = src[j];
      }
      every_token_dots(xq.data(), tokens, wide.data(), kp, dots.data());
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t r = 0; r < rows; ++r) {
          float v = static_cast<float>(dots[t * kRowTile + r]) * x_scale[t] * ws[r0 + r];
          if (bias) v += bias[r0 + r];
          dst[t * n + r0 + r] = static_cast<T>(v);
        }
    }
  });
}

// What the 8-bit linears share around their kernels: x [..., k] as contiguous rows [m, k], a float32
// bias of n, and the output [m, n] in x's dtype, filled by kernel(T{}, rows, bias or nullptr, out)
// and returned as [..., n].
template <typename F>
at::Tensor linear_rows(const char* name, const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias,
                       F&& kernel) {
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == n), name, ": a float32 bias per weight row");
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({rows.size(0), n}, x.options());
  dispatch(x.scalar_type(), name, [&](auto tag) { kernel(tag, rows, bias ? b.data_ptr<float>() : nullptr, out); });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(wq.scalar_type() == at::kChar && wq.dim() == 2 && wq.is_contiguous(), "int8_linear: contiguous int8 weight [n, k]");
  TORCH_CHECK(x.size(-1) == wq.size(1), "int8_linear: x [..., k] against weight [n, k]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == wq.size(0), "int8_linear: a float32 scale per weight row");
  const at::Tensor sc = w_scale.contiguous();
  return linear_rows("int8_linear", x, wq.size(0), bias, [&](auto tag, const at::Tensor& rows, const float* b, at::Tensor& out) {
    int8_linear_kernel<decltype(tag)>(rows, wq, sc, b, out);
  });
}

// Block-FP8 weight-only linear (DeepSeek-V3's format): out = x @ W.T (+ bias) with W[i, j] = q[i, j] *
// scale[row_block[i], col_block[j]]; a tile of weight rows is widened to float32 once per call (the
// weight never exists widened whole), its products with every token summed in float32, rounded once
// to x's dtype.

// Up to this many tokens, each weight row is widened within the dot products (read once per token,
// never stored); more share a tile widened once.
constexpr int64_t kFusedTokens = 4;

// out[t] = x[t] . W[row] for `tokens` (<= kFusedTokens) float rows x (row stride k): the row's codes
// widened as they are read, each run of one column block summed, then times its scale.
template <int64_t tokens>  // a constant, so that the accumulators live in registers
void fp8_row_dots(const float* x, int64_t k, const uint8_t* codes, const float* row_scales, const int64_t* cb,
                  const std::vector<int64_t>& run_start, float* out) {
  float total[tokens] = {};
  for (size_t run = 0; run + 1 < run_start.size(); ++run) {
    const int64_t lo = run_start[run], hi = run_start[run + 1];
    Vec acc[tokens];
    for (int64_t t = 0; t < tokens; ++t) acc[t] = Vec::zero();
    int64_t j = lo;
    for (; j + Vec::kWidth <= hi; j += Vec::kWidth) {
      const Vec w = Vec::load_fp8(codes + j);
      for (int64_t t = 0; t < tokens; ++t) acc[t] = Vec::fma(Vec::load(x + t * k + j), w, acc[t]);
    }
    const float block_scale = row_scales[cb[lo]];
    for (int64_t t = 0; t < tokens; ++t) {
      float sum = acc[t].sum();
      for (int64_t jj = j; jj < hi; ++jj) sum += fp8_value<3>(codes[jj]) * x[t * k + jj];
      total[t] += sum * block_scale;
    }
  }
  for (int64_t t = 0; t < tokens; ++t) out[t] = total[t];
}

template <typename T>
void fp8_linear_kernel(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& row_block,
                       const at::Tensor& col_block, const float* bias, at::Tensor& out) {
  const int64_t tokens = x.size(0), k = x.size(1), n = q.size(0), blocks = scale.size(1);
  const int64_t kp = (k + Vec::kWidth - 1) / Vec::kWidth * Vec::kWidth;
  std::vector<float> xf(tokens * kp, 0.f);
  const T* xs = x.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) xf[t * kp + j] = static_cast<float>(xs[t * k + j]);
  const uint8_t* qs = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* sc = scale.data_ptr<float>();
  const int64_t* rb = row_block.data_ptr<int64_t>();
  const int64_t* cb = col_block.data_ptr<int64_t>();
  T* dst = out.data_ptr<T>();
  // The runs of columns in one block (col_block ascends): each run widened by one scale, a loop the
  // compiler vectorizes.
  std::vector<int64_t> run_start{0};
  for (int64_t j = 1; j < k; ++j)
    if (cb[j] != cb[j - 1]) run_start.push_back(j);
  run_start.push_back(k);
  if (tokens == 0) return;
  if (tokens <= kFusedTokens) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      float dots[kFusedTokens];
      for (int64_t r = begin; r < end; ++r) {
        const uint8_t* codes = qs + r * k;
        const float* row_scales = sc + rb[r] * blocks;
        switch (tokens) {
          case 1: fp8_row_dots<1>(xf.data(), kp, codes, row_scales, cb, run_start, dots); break;
          case 2: fp8_row_dots<2>(xf.data(), kp, codes, row_scales, cb, run_start, dots); break;
          case 3: fp8_row_dots<3>(xf.data(), kp, codes, row_scales, cb, run_start, dots); break;
          default: fp8_row_dots<4>(xf.data(), kp, codes, row_scales, cb, run_start, dots); break;
        }
        for (int64_t t = 0; t < tokens; ++t) dst[t * n + r] = static_cast<T>(bias ? dots[t] + bias[r] : dots[t]);
      }
    });
    return;
  }
  const int64_t tiles = (n + kRowTile - 1) / kRowTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(kRowTile * kp, 0.f);  // rows past n stay zero
    std::vector<float> dots(tokens * kRowTile);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = tile * kRowTile, rows = std::min(kRowTile, n - r0);
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* src = qs + (r0 + r) * k;
        const float* row_scales = sc + rb[r0 + r] * blocks;
        float* w = wide.data() + r * kp;
        for (size_t run = 0; run + 1 < run_start.size(); ++run) {
          const float block_scale = row_scales[cb[run_start[run]]];
          for (int64_t j = run_start[run]; j < run_start[run + 1]; ++j) w[j] = fp8_value<3>(src[j]) * block_scale;
        }
      }
      every_token_dots(xf.data(), tokens, wide.data(), kp, dots.data());
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t r = 0; r < rows; ++r) {
          float v = dots[t * kRowTile + r];
          if (bias) v += bias[r0 + r];
          dst[t * n + r0 + r] = static_cast<T>(v);
        }
    }
  });
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& row_block,
                      const at::Tensor& col_block, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.scalar_type() == at::kFloat8_e4m3fn && q.dim() == 2, "fp8_linear: a float8_e4m3fn weight [n, k]");
  TORCH_CHECK(x.size(-1) == q.size(1), "fp8_linear: x [..., k] against weight [n, k]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2, "fp8_linear: float32 scales [row blocks, column blocks]");
  TORCH_CHECK(row_block.scalar_type() == at::kLong && row_block.numel() == q.size(0) &&
                  col_block.scalar_type() == at::kLong && col_block.numel() == q.size(1),
              "fp8_linear: an int64 block index per weight row and column");
  const at::Tensor qc = q.contiguous(), sc = scale.contiguous(), rb = row_block.contiguous(), cb = col_block.contiguous();
  return linear_rows("fp8_linear", x, q.size(0), bias, [&](auto tag, const at::Tensor& rows, const float* b, at::Tensor& out) {
    fp8_linear_kernel<decltype(tag)>(rows, qc, sc, rb, cb, b, out);
  });
}

}  // namespace

TORCH_LIBRARY(dpserve_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor table_rows, "
        "Tensor seq_lens, float scale, int v_dim, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos_sin, Tensor positions, bool interleaved) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("int8_linear(Tensor x, Tensor wq, Tensor w_scale, Tensor? bias) -> Tensor");
  m.def("fp8_linear(Tensor x, Tensor q, Tensor scale, Tensor row_block, Tensor col_block, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(dpserve_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("int8_linear", &int8_linear);
  m.impl("fp8_linear", &fp8_linear);
}

// hal CPU attention: paged decode / extend / verify over a KV pool of token-major or head-major pages, addressed
// through req_to_token (slots) or req_to_page (a block table), no gathered copy of the KV cache.
//
// Pools of AMX-packed pages (hal.kv_layouts' amx_packed) are read by tiles straight from the pool on the AMX paths
// (bf16: run_rows_amx for decode and verify, run_tile_amx for extend), their rows unpacked per block elsewhere.
//
// One task per request (or per (request, KV head) when requests are few) for decode and verify
// (every query row of the request and all query heads of the GQA group together; HAL_HEADS_PER_TASK
// overrides the heads per task), or per (request, KV head, tile of queries) for extend (register-
// blocked micro-tiles over K/V rows read in place; AMX tiles where present; at::mm on plain loops). Keys are read in blocks straight from the pool through
// the table (key_offsets); each block is scored, masked, folded into an online softmax and multiplied
// into the accumulators, the next block's rows prefetched under the work (Ahead). Tasks are handed to the
// threads dynamically, largest first.
//
// Built at first use by hal.kernels.cpu, once per x86 generation the CPU has (HAL_ISA: avx2,
// avx512, avx512_bf16), from this one source. bf16 pools are widened to float32 on load (a
// shift: exact) or, with avx512_bf16, dotted as bf16 against the query split in bf16 hi + lo;
// every sum is float32.
// ATen, the op registry and pybind11's tensor casters, not <torch/extension.h>: that one adds torch's whole C++
// frontend (modules, optimisers, data loaders), 20 s of the 70 s a build takes on a 2-core Zen 1, for nothing here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

// One source, compiled once per x86 generation (hal.kernels.cpu passes the -m flags and HAL_ISA):
// the vector layer below is 16 lanes under AVX-512, 8 under AVX2+FMA, absent (plain loops) otherwise;
// every kernel is written once against it.
#ifndef HAL_ISA
#define HAL_ISA generic
#endif
#define HAL_STR2(x) #x
#define HAL_STR(x) HAL_STR2(x)

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define HAL_VEC 16
#elif defined(__AVX2__) && defined(__FMA__)
#define HAL_VEC 8
#endif
#if defined(__AVX512BF16__)
#define HAL_BF16DOT 1  // bf16 K rows are dotted with _mm512_dpbf16_ps, no widening
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAL_AMX 1  // bf16 extend / verify tiles through AMX
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(HAL_AMX_EMULATE)
#define HAL_AMX 1  // the same tile path over scalar stand-ins of the three tile instructions (tests it without AMX)
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kMinNormalExp = -87.3365478515625f;  // float(-126 ln 2): exp of less is subnormal (vexp: 0)
constexpr int64_t kBlock = 32;       // keys per block on the row path
constexpr int64_t kRunKeys = 32;     // keys per block on the row path over head-major pages, at most
constexpr int64_t kScoresBytes = 16 << 10;  // the row path's scores of one block, all heads at once, at most
constexpr float kLazyMax = 8.f;  // how far a score may pass a row's running max before the max moves (fold_block)
constexpr int64_t kGemmBlock = 256;  // keys per block on the tile path

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#ifdef HAL_VEC
constexpr int64_t kW = HAL_VEC;  // float lanes
#if HAL_VEC == 16
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vpow2_bits(vf t) {  // 2^n from t = n + 1.5 * 2^23 (n integral, in the normal range): n + 127 in bits 23-30
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(127)), 23));
}
inline vf vzero_where_neginf(vf x, vf y) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset(kNegInf), _CMP_NEQ_OQ), y); }
inline vf vzero_below_normal(vf x, vf y) {  // y where x > float(-126 ln 2) (exp(x) normal), else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset(kMinNormalExp), _CMP_GT_OQ), y);
}
inline bool vany_nan(vf x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0; }
inline bool vany_above_or_nan(vf x, vf y) { return _mm512_cmp_ps_mask(x, y, _CMP_NLE_UQ) != 0; }
inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
// x where lo <= j < hi, else -inf (lane by lane)
inline vf vvisible(vf j, vf lo, vf hi, vf x) {
  const __mmask16 k = _mm512_cmp_ps_mask(j, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(j, hi, _CMP_LT_OQ);
  return _mm512_mask_mov_ps(vset(kNegInf), k, x);
}
inline vf vnan_or(vf acc, vf x) { return _mm512_mask_mov_ps(acc, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vabs(vf x) { return _mm512_abs_ps(x); }
inline vf vwith_sign_of(vf mag, vf x) { return _mm512_or_ps(mag, _mm512_and_ps(vset(-0.f), x)); }  // mag >= 0
#else
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vpow2_bits(vf t) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(127)), 23));
}
inline vf vzero_where_neginf(vf x, vf y) { return _mm256_and_ps(y, _mm256_cmp_ps(x, vset(kNegInf), _CMP_NEQ_OQ)); }
inline vf vzero_below_normal(vf x, vf y) { return _mm256_and_ps(y, _mm256_cmp_ps(x, vset(kMinNormalExp), _CMP_GT_OQ)); }
inline bool vany_nan(vf x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0; }
inline bool vany_above_or_nan(vf x, vf y) { return _mm256_movemask_ps(_mm256_cmp_ps(x, y, _CMP_NLE_UQ)) != 0; }
inline vf vvisible(vf j, vf lo, vf hi, vf x) {
  return _mm256_blendv_ps(vset(kNegInf), x, _mm256_and_ps(_mm256_cmp_ps(j, lo, _CMP_GE_OQ), _mm256_cmp_ps(j, hi, _CMP_LT_OQ)));
}
inline vf vnan_or(vf acc, vf x) { return _mm256_blendv_ps(acc, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vabs(vf x) { return _mm256_andnot_ps(vset(-0.f), x); }
inline vf vwith_sign_of(vf mag, vf x) { return _mm256_or_ps(mag, _mm256_and_ps(vset(-0.f), x)); }  // mag >= 0
inline float hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
// exp(x) for x <= 88, within ~2 ulp (callers' x is at most kLazyMax, but in exp_sub_sum<true>'s pass, which
// drops its results where x passes that); +0 for x <= float(-126 ln 2), so no result is subnormal, and for -inf
// and NaN (callers find NaN scores themselves). kCoarse: a degree-3 polynomial (relative error 1e-4, 2 FMAs fewer)
// for probabilities about to be rounded to bf16 (2^-9), as the AMX tiles take them. n = round(x / ln 2) by the
// shifter trick: t = x log2(e) + 1.5 * 2^23 holds n in its low mantissa bits, so t - 1.5 * 2^23 is n as a float
// and t's bits shifted give 2^n; e^r for the rest |r| <= ln(2) / 2 is a degree-5 minimax polynomial (relative
// error 9e-8). Below -87.34 the bits are garbage, and masked.
template <bool kCoarse = false>
inline vf vexp(vf x0) {
  const vf shifter = vset(12582912.f);  // 1.5 * 2^23
  const vf t = vfma(x0, vset(1.44269504088896341f), shifter);
  const vf fx = vsub(t, shifter);
  vf x = vfnma(fx, vset(0.693359375f), x0);
  x = vfnma(fx, vset(-2.12194440e-4f), x);
  vf y;
  if constexpr (kCoarse) {
    y = vset(1.65179748e-1f);
    y = vfma(y, x, vset(5.04130409e-1f));
    y = vfma(y, x, vset(1.00019584e+0f));
    y = vfma(y, x, vset(1.f));
  } else {
    y = vset(8.29031276e-3f);
    y = vfma(y, x, vset(4.18979302e-2f));
    y = vfma(y, x, vset(1.66676357e-1f));
    y = vfma(y, x, vset(4.99991506e-1f));
    y = vfma(y, x, vset(9.99999702e-1f));
    y = vfma(y, x, vset(1.f));
  }
  return vzero_below_normal(x0, vmul(y, vpow2_bits(t)));
}
#endif

inline uint16_t bf16_bits(float x) { return at::BFloat16(x).x; }

#ifdef HAL_VEC
// x rounded to bf16 (nearest even), kW of them at p.
inline void vstore_bf16(uint16_t* p, vf x) {
#ifdef HAL_BF16DOT
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
  alignas(64) float lanes[kW];
  vstore(lanes, x);
  for (int64_t k = 0; k < kW; ++k) p[k] = bf16_bits(lanes[k]);
#endif
}
#endif

// p[i] = exp(s[i] f - m) for i < n (f > 0: scores not yet scaled), into s, or rounded to bf16 into pb where
// given (s is then only read; vexp<true>, as close as bf16 needs); returns the sum of the float32 p. kLazy (pb
// given): the same, but it returns NaN where some s[i] f - m is above kLazyMax or NaN (the running max must move
// first; pb then holds nothing useful) -- any_above_or_nan's test made in the same pass.
template <bool kLazy = false>
inline float exp_sub_sum(float* s, int64_t n, float m, float f = 1.f, uint16_t* pb = nullptr) {
  int64_t i = 0;
  float total = 0.f;
  bool above = false;
#ifdef HAL_VEC
  vf acc = vzero(), vm = vset(-m), vf_ = vset(f), over = vzero();
  for (; i + kW <= n; i += kW) {
    const vf x = vfma(vload(s + i), vf_, vm);
    if constexpr (kLazy) over = vnan_or(vmax(x, over), x);  // (vmax keeps its second operand's NaN)
    if (pb) {
      const vf p = vexp<true>(x);
      acc = vadd(acc, p);
      vstore_bf16(pb + i, p);
    } else {
      const vf p = vexp(x);
      acc = vadd(acc, p);
      vstore(s + i, p);
    }
  }
  total = hsum(acc);
  if constexpr (kLazy) above = vany_above_or_nan(over, vset(kLazyMax));
#endif
  for (; i < n; ++i) {
    const float x = s[i] * f - m;
    if constexpr (kLazy) above |= !(x <= kLazyMax);
    const float p = s[i] == kNegInf ? 0.f : std::exp(x);
    total += p;
    if (pb) {
      pb[i] = bf16_bits(p);
    } else {
      s[i] = p;
    }
  }
  return above ? std::numeric_limits<float>::quiet_NaN() : total;
}

// The logit cap: s[i] = cap * tanh(s[i] / cap) for i < n (cap > 0), as sign(x) * (1 - e) / (1 + e) with
// e = exp(-2|x| / cap), which neither overflows nor loses the sign; NaN stays NaN, +-inf goes to +-cap.
inline void soft_cap(float* s, int64_t n, float cap) {
  int64_t i = 0;
#ifdef HAL_VEC
  const vf k = vset(-2.f / cap), one = vset(1.f), vcap = vset(cap);
  for (; i + kW <= n; i += kW) {
    const vf x = vload(s + i);
    const vf e = vexp(vmul(vabs(x), k));
    const vf t = vdiv(vsub(one, e), vadd(one, e));
    vstore(s + i, vnan_or(vmul(vwith_sign_of(t, x), vcap), x));
  }
#endif
  for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

// Largest of s[0, n), or NaN when any is NaN (NaN in q or K must reach the output).
inline float max_of(const float* s, int64_t n) {
  float m = kNegInf;
  bool nan = false;
  int64_t i = 0;
#ifdef HAL_VEC
  vf vm = vset(kNegInf), vn = vzero();  // vn: a NaN in each lane that saw one
  for (; i + kW <= n; i += kW) {
    vf x = vload(s + i);
    vn = vnan_or(vn, x);
    vm = vmax(vm, x);
  }
  m = hmax(vm);
  nan = vany_nan(vn);
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(s[i]);
    m = std::max(m, s[i]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// Whether any of s[0, n) times f is above `limit` or NaN.
inline bool any_above_or_nan(const float* s, int64_t n, float f, float limit) {
  int64_t i = 0;
#ifdef HAL_VEC
  const vf vlimit = vset(limit), vf_ = vset(f);
  for (; i + kW <= n; i += kW)
    if (vany_above_or_nan(vmul(vload(s + i), vf_), vlimit)) return true;
#endif
  for (; i < n; ++i)
    if (!(s[i] * f <= limit)) return true;
  return false;
}

inline void scale_row(float* a, int64_t n, float f) {
  for (int64_t i = 0; i < n; ++i) a[i] *= f;
}

// ---- row path micro-kernels -------------------------------------------------------------
#if defined(HAL_VEC) && HAL_VEC == 8
// The horizontal sums of a[0..7] as one vector (lane i: the sum of a[i]): 9 shuffles and adds for all eight,
// where eight separate hsum() take about 50.
inline vf hsum8(const vf* a) {
  const vf s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // [a0..a3 lo | hi]
  const vf s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif
#if defined(HAL_VEC) && HAL_VEC == 16
// The horizontal sums of a[0..15] as one vector (lane i: the sum of a[i]): 45 shuffles and adds for all
// sixteen, where sixteen _mm512_reduce_add_ps take about 130.
inline vf hsum16(const vf* a) {
  vf b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: [x0+x2, y0+y2, x1+x3, y1+y3] of (x, y) = a[2i], a[2i + 1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per block: the partial sums of a[4i .. 4i + 3]
    const __m512d u = _mm512_castps_pd(b[2 * i]), w = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, w)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)));
  }
  for (int i = 0; i < 2; ++i)  // blocks summed in pairs
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// The next block's rows of one head (its K or its V rows), fetched into L2 by the row kernels a few at a time as
// they work through the current block: one burst of a block's prefetches fills the core's line fill buffers
// and stalls it until memory answers, so the arithmetic and the reads ran one after the other. Spread
// over the work, the reads run under it (AMX Xeon, decode at 2 threads: bf16 1.05-1.19x, fp32 1.10-1.16x over
// one burst per head and block).
struct Ahead {
  const char* const* rows = nullptr;  // rows[j] for j < n
  int64_t n = 0;
  int64_t bytes = 0;  // of each row
  // bytes [b0, b1) of rows [j0, j1) (clipped to the rows there are); always inlined: a call in a kernel's loop
  // spills its accumulators (1.6x slower)
  __attribute__((always_inline)) void fetch(int64_t j0, int64_t j1, int64_t b0, int64_t b1) const {
    j1 = std::min(j1, n);
    b1 = std::min(b1, bytes);
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t o = b0; o < b1; o += 64) __builtin_prefetch(rows[j] + o, 0, 1);
  }
  void fetch_all() const { fetch(0, n, 0, bytes); }
};

// Keys scored together by qk_rows for NR query rows: NR x NK accumulators, reduced together (hsum8 under AVX2:
// 8; hsum16 under AVX-512: 16, 12 for 3 rows).
template <int NR>
constexpr int qk_keys() {
#if defined(HAL_VEC) && HAL_VEC == 16
  return NR == 3 ? 4 : 16 / NR;
#else
  return 8 % NR == 0 ? 8 / NR : 2;
#endif
}

// scores[r * ld + j] = post * dot(q[r], k[j]) for NR rows and the keys of a block, qk_keys<NR>() keys at a time;
// the next block's K rows fetched alongside (next.rows[j] with key j).
template <int NR, typename T>
inline void qk_rows(const float* q, int64_t D, const T* const* kp, int64_t nk, float* s, int64_t ld, float post,
                    const Ahead& next) {
  int64_t j = 0;
#ifdef HAL_VEC
  constexpr int NK = qk_keys<NR>();
  const int64_t DW = D & ~(kW - 1);
  for (; j + NK <= nk; j += NK) {
    next.fetch(j, j + NK, 0, next.bytes);
#if HAL_VEC == 16
    vf acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = vzero();
#else
    vf acc[NR * NK];
    for (int i = 0; i < NR * NK; ++i) acc[i] = vzero();
#endif
    const T* kr[NK];
    for (int c = 0; c < NK; ++c) kr[c] = kp[j + c];
    for (int64_t d = 0; d < DW; d += kW) {
      vf qv[NR];
      for (int r = 0; r < NR; ++r) qv[r] = vload(q + r * D + d);
      for (int c = 0; c < NK; ++c) {
        const vf kv = vload(kr[c] + d);
        for (int r = 0; r < NR; ++r) acc[r * NK + c] = vfma(qv[r], kv, acc[r * NK + c]);
      }
    }
#if HAL_VEC == 16
    float sums[16];
    vstore(sums, hsum16(acc));
#else
    float sums[NR * NK];
    if constexpr (NR * NK == 8) {
      vstore(sums, hsum8(acc));
    } else {
      for (int i = 0; i < NR * NK; ++i) sums[i] = hsum(acc[i]);
    }
#endif
    for (int r = 0; r < NR; ++r) {
      for (int c = 0; c < NK; ++c) {
        float x = sums[r * NK + c];
        for (int64_t d = DW; d < D; ++d) x += q[r * D + d] * to_float(kr[c][d]);
        s[r * ld + j + c] = x * post;
      }
    }
  }
  for (; j < nk; ++j) {  // the block's last keys, one at a time
    next.fetch(j, j + 1, 0, next.bytes);
    for (int r = 0; r < NR; ++r) {
      vf acc = vzero();
      for (int64_t d = 0; d < DW; d += kW) acc = vfma(vload(q + r * D + d), vload(kp[j] + d), acc);
      float x = hsum(acc);
      for (int64_t d = DW; d < D; ++d) x += q[r * D + d] * to_float(kp[j][d]);
      s[r * ld + j] = x * post;
    }
  }
#endif
  next.fetch(j, next.n, 0, next.bytes);
  for (; j < nk; ++j) {
    const T* k0 = kp[j];
    for (int r = 0; r < NR; ++r) {
      float x = 0.f;
      for (int64_t d = 0; d < D; ++d) x += q[r * D + d] * to_float(k0[d]);
      s[r * ld + j] = x * post;
    }
  }
}

#ifdef HAL_BF16DOT
// qk_rows for bf16 keys through _mm512_dpbf16_ps, no widening: the query rows in bf16 (qb[r * 2D + d]) and, with
// LO, their remainders (qb[r * 2D + D + d]; hi + lo = q to ~2^-17) dotted with the key rows, so the scores keep
// (nearly) float32 accuracy; a bf16 query (lo = 0) takes one pass. Dims past a multiple of 32: float32 q.
template <int NR, bool LO>
inline void qk_rows_bf16dot(const uint16_t* qb, const float* q, int64_t D, const at::BFloat16* const* kp, int64_t nk,
                            float* s, int64_t ld, float post, const Ahead& next) {
  constexpr int NK = qk_keys<NR>();
  const int64_t D32 = D & ~int64_t(31);
  int64_t j = 0;
  for (; j + NK <= nk; j += NK) {
    next.fetch(j, j + NK, 0, next.bytes);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D32; d += 32) {
      __m512bh qh[NR], ql[NR];
      for (int r = 0; r < NR; ++r) {
        qh[r] = (__m512bh)_mm512_loadu_si512(qb + r * 2 * D + d);
        if constexpr (LO) ql[r] = (__m512bh)_mm512_loadu_si512(qb + r * 2 * D + D + d);
      }
      for (int c = 0; c < NK; ++c) {
        const __m512bh kb = (__m512bh)_mm512_loadu_si512(kp[j + c] + d);
        for (int r = 0; r < NR; ++r) {
          acc[r * NK + c] = _mm512_dpbf16_ps(acc[r * NK + c], qh[r], kb);
          if constexpr (LO) acc[r * NK + c] = _mm512_dpbf16_ps(acc[r * NK + c], ql[r], kb);
        }
      }
    }
    float sums[16];
    _mm512_storeu_ps(sums, hsum16(acc));
    for (int r = 0; r < NR; ++r) {
      for (int c = 0; c < NK; ++c) {
        float x = sums[r * NK + c];
        for (int64_t d = D32; d < D; ++d) x += q[r * D + d] * to_float(kp[j + c][d]);
        s[r * ld + j + c] = x * post;
      }
    }
  }
  next.fetch(j, next.n, 0, next.bytes);
  for (; j < nk; ++j) {
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    const at::BFloat16* k0 = kp[j];
    for (int64_t d = 0; d < D32; d += 32) {
      const __m512bh kb = (__m512bh)_mm512_loadu_si512(k0 + d);
      for (int r = 0; r < NR; ++r) {
        const uint16_t* row = qb + r * 2 * D + d;
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(row), kb);
        if constexpr (LO) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(row + D), kb);
      }
    }
    for (int r = 0; r < NR; ++r) {
      float x = _mm512_reduce_add_ps(acc[r]);
      for (int64_t d = D32; d < D; ++d) x += q[r * D + d] * to_float(k0[d]);
      s[r * ld + j] = x * post;
    }
  }
}
#endif

// dst_hi[i] = x[i] rounded to bf16 (nearest even) and dst_lo[i] = the rest (x[i] - hi) rounded to bf16, for
// i < n; zeros for i >= valid. dst_lo null: the high halves only. Returns whether any rest is nonzero.
inline bool to_bf16_halves(const float* x, int64_t valid, int64_t n, uint16_t* dst_hi, uint16_t* dst_lo) {
  bool rest = false;
  int64_t i = 0;
#ifdef HAL_BF16DOT
  __m512i any = _mm512_setzero_si512();
  for (; i + 32 <= valid; i += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
    const __m512bh hi = _mm512_cvtne2ps_pbh(x1, x0);
    _mm512_storeu_si512(dst_hi + i, (__m512i)hi);
    if (!dst_lo) continue;
    const __m512 h0 = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)hi));
    const __m512 h1 = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)hi, 1));
    const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0));
    _mm512_storeu_si512(dst_lo + i, lo);
    any = _mm512_or_si512(any, _mm512_and_si512(lo, _mm512_set1_epi16(0x7fff)));
  }
  rest = _mm512_test_epi64_mask(any, any) != 0;
#endif
  for (; i < n; ++i) {
    const float v = i < valid ? x[i] : 0.f;
    const at::BFloat16 top(v);
    dst_hi[i] = top.x;
    if (!dst_lo) continue;
    dst_lo[i] = bf16_bits(v - to_float(top));
    rest |= (dst_lo[i] & 0x7fff) != 0;
  }
  return rest;
}

// bf16 hi and lo halves of R float rows of D (the layout qk_rows_bf16dot reads); returns whether any lo is
// nonzero (false: the rows are exact in bf16, and one pass of bf16 dots scores them exactly).
inline bool split_bf16(const float* q, int64_t R, int64_t D, uint16_t* qb) {
  bool lo_any = false;
  for (int64_t r = 0; r < R; ++r) lo_any |= to_bf16_halves(q + r * D, D, D, qb + r * 2 * D, qb + r * 2 * D + D);
  return lo_any;
}

// acc[r] += sum_j p[r * ld + j] * v[j] for NR rows, NV vectors of Dv at a time (NR x NV accumulators); the next
// block's V rows fetched alongside, each span as the same span of the current rows is read.
template <int NR, typename T>
inline void pv_rows(const float* p, int64_t ld, const T* const* vp, int64_t nk, float* acc, int64_t Dv,
                    const Ahead& next) {
  int64_t d = 0;
#ifdef HAL_VEC
  constexpr int NV = kW == 16 ? 4 : 2;  // AVX2 has 16 registers, AVX-512 32
  for (; d + NV * kW <= Dv; d += NV * kW) {
    vf a[NR][NV];
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < NV; ++v) a[r][v] = vload(acc + r * Dv + d + v * kW);
    for (int64_t j = 0; j < nk; ++j) {
      next.fetch(j, j + 1, d * sizeof(T), (d + NV * kW) * sizeof(T));
      vf x[NV];
      for (int v = 0; v < NV; ++v) x[v] = vload(vp[j] + d + v * kW);
      for (int r = 0; r < NR; ++r) {
        const vf w = vset(p[r * ld + j]);
        for (int v = 0; v < NV; ++v) a[r][v] = vfma(w, x[v], a[r][v]);
      }
    }
    next.fetch(nk, next.n, d * sizeof(T), (d + NV * kW) * sizeof(T));
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < NV; ++v) vstore(acc + r * Dv + d + v * kW, a[r][v]);
  }
  for (; d + kW <= Dv; d += kW) {
    vf a0[NR];
    for (int r = 0; r < NR; ++r) a0[r] = vload(acc + r * Dv + d);
    for (int64_t j = 0; j < nk; ++j) {
      next.fetch(j, j + 1, d * sizeof(T), (d + kW) * sizeof(T));
      vf x = vload(vp[j] + d);
      for (int r = 0; r < NR; ++r) a0[r] = vfma(vset(p[r * ld + j]), x, a0[r]);
    }
    next.fetch(nk, next.n, d * sizeof(T), (d + kW) * sizeof(T));
    for (int r = 0; r < NR; ++r) vstore(acc + r * Dv + d, a0[r]);
  }
#endif
  next.fetch(0, next.n, d * sizeof(T), next.bytes);
  for (; d < Dv; ++d) {
    for (int r = 0; r < NR; ++r) {
      float x = acc[r * Dv + d];
      for (int64_t j = 0; j < nk; ++j) x += p[r * ld + j] * to_float(vp[j][d]);
      acc[r * Dv + d] = x;
    }
  }
}

// qk_rows for nr <= 4 rows, scores times post; qb: the rows' bf16 halves (split_bf16; lo: whether the lo
// halves count) where bf16 keys take the bf16 dot, else null (the keys widened).
template <typename T>
inline void qk_any(int nr, const float* q, const uint16_t* qb, bool lo, int64_t D, const T* const* kp, int64_t nk,
                   float* s, int64_t ld, float post, const Ahead& next) {
#ifdef HAL_BF16DOT
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (qb && lo) {
      switch (nr) {
        case 4: return qk_rows_bf16dot<4, true>(qb, q, D, kp, nk, s, ld, post, next);
        case 3: return qk_rows_bf16dot<3, true>(qb, q, D, kp, nk, s, ld, post, next);
        case 2: return qk_rows_bf16dot<2, true>(qb, q, D, kp, nk, s, ld, post, next);
        default: return qk_rows_bf16dot<1, true>(qb, q, D, kp, nk, s, ld, post, next);
      }
    }
    if (qb) {
      switch (nr) {
        case 4: return qk_rows_bf16dot<4, false>(qb, q, D, kp, nk, s, ld, post, next);
        case 3: return qk_rows_bf16dot<3, false>(qb, q, D, kp, nk, s, ld, post, next);
        case 2: return qk_rows_bf16dot<2, false>(qb, q, D, kp, nk, s, ld, post, next);
        default: return qk_rows_bf16dot<1, false>(qb, q, D, kp, nk, s, ld, post, next);
      }
    }
  }
#endif
  (void)qb;
  (void)lo;
  switch (nr) {
    case 4: return qk_rows<4>(q, D, kp, nk, s, ld, post, next);
    case 3: return qk_rows<3>(q, D, kp, nk, s, ld, post, next);
    case 2: return qk_rows<2>(q, D, kp, nk, s, ld, post, next);
    default: return qk_rows<1>(q, D, kp, nk, s, ld, post, next);
  }
}
template <typename T>
inline void pv_any(int nr, const float* p, int64_t ld, const T* const* vp, int64_t nk, float* acc, int64_t Dv,
                   const Ahead& next) {
  switch (nr) {
    case 4: return pv_rows<4>(p, ld, vp, nk, acc, Dv, next);
    case 3: return pv_rows<3>(p, ld, vp, nk, acc, Dv, next);
    case 2: return pv_rows<2>(p, ld, vp, nk, acc, Dv, next);
    default: return pv_rows<1>(p, ld, vp, nk, acc, Dv, next);
  }
}

// ---- AVX2: bf16 rows widened as pairs ----------------------------------------------------------
// Sixteen bf16 values loaded as one 256-bit vector hold in 32-bit lane i the pair (x[2i], x[2i + 1]): x[2i + 1]
// is the lane with its low half cleared, x[2i] the lane shifted left by 16. Two integer ops widen sixteen
// values where vpmovzxwd + vpslld take four, and these are what bounds AVX2's bf16 decode (Zen 1: a bf16 step
// took 1.4x an fp32 one with the K/V rows in cache). The other operand keeps the same order: the query rows
// and P . V's accumulators hold each full 16 dims as their 8 even dims, then their 8 odd ones ("pairs order").
#if defined(HAL_VEC) && HAL_VEC == 8
constexpr bool kBf16Pairs = true;
inline void bf16_pairs(const at::BFloat16* p, vf& even, vf& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u))));
}

// Rows [R x D] put in pairs order in place (dims past the last multiple of 16 stay as they are).
inline void to_pairs_order(float* x, int64_t R, int64_t D) {
  float t[16];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t d = 0; d + 16 <= D; d += 16) {
      float* c = x + r * D + d;
      for (int i = 0; i < 8; ++i) {
        t[i] = c[2 * i];
        t[8 + i] = c[2 * i + 1];
      }
      std::memcpy(c, t, sizeof t);
    }
  }
}

// qk_rows for bf16 keys, the query rows in pairs order.
template <int NR>
inline void qk_rows_pairs(const float* q, int64_t D, const at::BFloat16* const* kp, int64_t nk, float* s, int64_t ld,
                          float post, const Ahead& next) {
  constexpr int NK = qk_keys<NR>();
  const int64_t D16 = D & ~int64_t(15);
  auto tail = [&](int r, const at::BFloat16* k) {
    float x = 0.f;
    for (int64_t d = D16; d < D; ++d) x += q[r * D + d] * to_float(k[d]);
    return x;
  };
  int64_t j = 0;
  for (; j + NK <= nk; j += NK) {
    next.fetch(j, j + NK, 0, next.bytes);
    vf acc[NR * NK];
    for (int i = 0; i < NR * NK; ++i) acc[i] = vzero();
    for (int64_t d = 0; d < D16; d += 16) {
      for (int c = 0; c < NK; ++c) {
        vf ke, ko;
        bf16_pairs(kp[j + c] + d, ke, ko);
        for (int r = 0; r < NR; ++r) {
          acc[r * NK + c] = vfma(vload(q + r * D + d), ke, acc[r * NK + c]);
          acc[r * NK + c] = vfma(vload(q + r * D + d + 8), ko, acc[r * NK + c]);
        }
      }
    }
    float sums[NR * NK];
    if constexpr (NR * NK == 8) {
      vstore(sums, hsum8(acc));
    } else {
      for (int i = 0; i < NR * NK; ++i) sums[i] = hsum(acc[i]);
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NK; ++c) s[r * ld + j + c] = (sums[r * NK + c] + tail(r, kp[j + c])) * post;
  }
  next.fetch(j, next.n, 0, next.bytes);
  for (; j < nk; ++j) {  // the block's last keys, one at a time
    for (int r = 0; r < NR; ++r) {
      vf acc = vzero();
      for (int64_t d = 0; d < D16; d += 16) {
        vf ke, ko;
        bf16_pairs(kp[j] + d, ke, ko);
        acc = vfma(vload(q + r * D + d + 8), ko, vfma(vload(q + r * D + d), ke, acc));
      }
      s[r * ld + j] = (hsum(acc) + tail(r, kp[j])) * post;
    }
  }
}

// pv_rows for bf16 values, the accumulators in pairs order.
template <int NR>
inline void pv_rows_pairs(const float* p, int64_t ld, const at::BFloat16* const* vp, int64_t nk, float* acc,
                          int64_t Dv, const Ahead& next) {
  const int64_t D16 = Dv & ~int64_t(15);
  for (int64_t d = 0; d < D16; d += 16) {
    vf ae[NR], ao[NR];
    for (int r = 0; r < NR; ++r) {
      ae[r] = vload(acc + r * Dv + d);
      ao[r] = vload(acc + r * Dv + d + 8);
    }
    for (int64_t j = 0; j < nk; ++j) {
      next.fetch(j, j + 1, d * 2, (d + 16) * 2);
      vf ve, vo;
      bf16_pairs(vp[j] + d, ve, vo);
      for (int r = 0; r < NR; ++r) {
        const vf w = vset(p[r * ld + j]);
        ae[r] = vfma(w, ve, ae[r]);
        ao[r] = vfma(w, vo, ao[r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      vstore(acc + r * Dv + d, ae[r]);
      vstore(acc + r * Dv + d + 8, ao[r]);
    }
    next.fetch(nk, next.n, d * 2, (d + 16) * 2);
  }
  next.fetch(0, next.n, D16 * 2, next.bytes);
  for (int64_t d = D16; d < Dv; ++d) {
    for (int r = 0; r < NR; ++r) {
      float x = acc[r * Dv + d];
      for (int64_t j = 0; j < nk; ++j) x += p[r * ld + j] * to_float(vp[j][d]);
      acc[r * Dv + d] = x;
    }
  }
}

inline void qk_pairs_any(int nr, const float* q, int64_t D, const at::BFloat16* const* kp, int64_t nk, float* s,
                         int64_t ld, float post, const Ahead& next) {
  switch (nr) {
    case 4: return qk_rows_pairs<4>(q, D, kp, nk, s, ld, post, next);
    case 3: return qk_rows_pairs<3>(q, D, kp, nk, s, ld, post, next);
    case 2: return qk_rows_pairs<2>(q, D, kp, nk, s, ld, post, next);
    default: return qk_rows_pairs<1>(q, D, kp, nk, s, ld, post, next);
  }
}
inline void pv_pairs_any(int nr, const float* p, int64_t ld, const at::BFloat16* const* vp, int64_t nk, float* acc,
                         int64_t Dv, const Ahead& next) {
  switch (nr) {
    case 4: return pv_rows_pairs<4>(p, ld, vp, nk, acc, Dv, next);
    case 3: return pv_rows_pairs<3>(p, ld, vp, nk, acc, Dv, next);
    case 2: return pv_rows_pairs<2>(p, ld, vp, nk, acc, Dv, next);
    default: return pv_rows_pairs<1>(p, ld, vp, nk, acc, Dv, next);
  }
}
#else
constexpr bool kBf16Pairs = false;
#endif

// Where dim d of a row of D dims is stored: pairs order (paired) or as is.
inline int64_t stored_dim(int64_t d, int64_t D, bool paired) {
  if (!paired || d >= (D & ~int64_t(15))) return d;
  return (d & ~int64_t(15)) + ((d & 1) ? 8 : 0) + ((d & 15) >> 1);
}

// ---- problem description -----------------------------------------------------------------
struct Problem {
  const float* q;  // [T, Hq, D], float32; or
  const at::BFloat16* q_bf16 = nullptr;  // the same in bf16 (the fused path of a bf16 pool: no float32 copy)
  int64_t q_s0, q_s1;
  // The pool: key i of a request lives on a page at an offset (its table's entry for i / page and i % page, or
  // its slot s from req_to_token: s / page and s % page), its row of KV head h at
  // k + page * k_ps + offset * k_ts + h * k_hs elements (v likewise). Token-major pages: k_ps = page * H * D,
  // k_ts = H * D, k_hs = D; head-major: k_ps = H * page * D, k_ts = D, k_hs = page * D. A [slots, H, D] pool is
  // pages of one slot.
  const void* k;
  const void* v;
  int64_t k_ps, k_ts, k_hs, v_ps, v_ts, v_hs;
  // AMX-packed pages (amx_packed below): head-major pages whose (page, head) slabs hold their values permuted into
  // AMX B tiles; a key's "row" is then where its value of dim 0 lies (packed_k_row / packed_v_row), its dim d
  // packed_k_dim(d) / packed_v_dim(d, page) further on, and k_ts / v_ts are not used.
  bool packed = false;
  int64_t num_pages, page = 1;
  int page_shift = -1;  // log2(page) where page is a power of two
  bool by_page = false;  // the table is req_to_page [R, max pages] (pages), not req_to_token [R, context] (slots)
  const int32_t* r2t;
  int64_t r2t_s0, r2t_cols;
  const int64_t* rows;     // req_pool_indices [B]
  const int64_t* kv_lens;  // [B]
  const int64_t* q_lens;   // [B]
  const int64_t* q_start;  // [B]
  const bool* cmask;       // flat, or null
  const int64_t* m_start;  // [B], or null
  const float* sinks;      // [Hq] sink logits (attention sinks), or null
  float* out;              // [T, Hq, Dv]; or
  at::BFloat16* out_bf16 = nullptr;  // the same in bf16, rounded once from the float32 result
  int64_t o_s0, o_s1;
  int64_t Hq, Hkv, G, D, Dv;
  float scale, cap;
  int64_t window;
  bool causal;
  std::atomic<int64_t>* bad_slot;  // the table's first entry found outside the pool (a slot, or a page)
  std::atomic<bool>* bad;
  int64_t widened_keys = 0;  // a tile task's WidenedRows at most (keys); 0: as many as kWidenedBytes hold
};

// ---- AMX-packed pages (hal.kv_layouts' amx_packed): the one place of their element offsets ---------------------
// A (page, head) slab's page * D values in the tiles of AMX's B operand (16 rows of 16 pairs of 2-byte values, the
// "VNNI" form B[k / 2][n][k % 2]), as vLLM's csrc/cpu/cpu_attn_amx.hpp writes its cache: value (o, d) at
// row(o) + dim(d). K (B = K^T in panels of 16 keys): (o / 16) * 16 * D + (d / 2) * 32 + (o % 16) * 2 + d % 2, so
// keys [16 g, 16 g + 16) x dims [32 c, 32 c + 32) are the 512 values at (g * D / 32 + c) * 512. V (B = V in
// panels of 16 dims): (d / 16) * page * 16 + (o / 2) * 32 + (d % 16) * 2 + o % 2, so keys [32 q, 32 q + 32) x dims
// [16 e, 16 e + 16) are the 512 values at e * page * 16 + q * 512. (hal.kernels.reference.kv_layouts.
// amx_packed_offsets is the same in torch.) Pages of a multiple of 32 slots, D and Dv multiples of 32.
constexpr int64_t kPackedPage = 32;  // page and dims a multiple of this (whole tiles)
constexpr int64_t kTileValues = 512;  // 16 x 32 two-byte values: 1 KB
inline int64_t packed_k_row(int64_t o, int64_t D) { return (o / 16) * 16 * D + (o % 16) * 2; }
inline int64_t packed_k_dim(int64_t d) { return (d / 2) * 32 + d % 2; }
inline int64_t packed_v_row(int64_t o) { return (o / 2) * 32 + o % 2; }
inline int64_t packed_v_dim(int64_t d, int64_t page) { return (d / 16) * page * 16 + (d % 16) * 2; }
// So the K tile of keys from o (a multiple of 16) and dims from 32 c lies at packed_k_row(o, D) + c * 512, the next
// 16 keys' packed_k_row(16, D) further; the V tile of keys from o (a multiple of 32) and dims from 16 e at
// packed_v_row(o) + packed_v_dim(16 e, page), the next 32 keys' 512 further.

// Where head 0's row of offset o of page pg lies (elements from k and v): its first value in any layout.
inline void row_at(const Problem& P, int64_t pg, int64_t o, int64_t& k, int64_t& v) {
  k = pg * P.k_ps + (P.packed ? packed_k_row(o, P.D) : o * P.k_ts);
  v = pg * P.v_ps + (P.packed ? packed_v_row(o) : o * P.v_ts);
}

struct Task {
  int64_t b, h, i0, i1;  // request, first KV head, query rows [i0, i1) of the request
  int64_t nh;            // KV heads [h, h + nh) (row tasks; tiles take one)
  double cost;
  bool tile;
  int64_t sub = 0;       // AMX tiles: query rows per tile, [i0, i1) taken sub at a time over K/V packed once
};

// Visible key range of query i of request b (the custom mask narrows it further).
inline void key_range(const Problem& P, int64_t b, int64_t i, int64_t& lo, int64_t& hi) {
  const int64_t kv = P.kv_lens[b], pos = kv - P.q_lens[b] + i;
  hi = (P.causal && !P.cmask) ? std::min(kv, pos + 1) : kv;
  lo = P.window >= 0 ? std::max<int64_t>(0, pos - P.window) : 0;
}

// n elements of a thread's buffer `buf`, from a 64-byte boundary. Every working buffer of the kernels starts on
// one, and so does each part of it (sizes rounded with up16): a vector or tile row that straddles two cache lines
// costs two, and where a std::vector's data fell decided it process by process (the AMX extend ran 30 or 38 ms
// from one process to the next on the same inputs).
template <typename T>
T* aligned(std::vector<T>& buf, int64_t n) {
  constexpr int64_t pad = 64 / sizeof(T);
  if (int64_t(buf.size()) < n + pad) buf.resize(n + pad);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((at + 63) & ~uintptr_t(63));
}
// n rounded up to a multiple of 16 (elements of 4 bytes: a cache line)
constexpr int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

thread_local std::vector<float> t_scratch;
thread_local std::vector<const void*> t_ptrs;
thread_local std::vector<float> t_rows;  // WidenedRows: a tile task's K and V rows, out of the pool

float* scratch(int64_t n) { return aligned(t_scratch, n); }

// Head 0's K and V row offsets (elements from k and v) of keys [j0, j0 + n) of a request (its table row `row`),
// into ko and vo; false, the entry recorded, where the table names a slot or page outside the pool.
inline bool key_offsets(const Problem& P, const int32_t* row, int64_t j0, int64_t n, int64_t* ko, int64_t* vo) {
  auto bad = [&](int64_t entry) {
    P.bad_slot->store(entry);
    P.bad->store(true);
    return false;
  };
  if (P.by_page) {
    if (n <= 0) return true;
    int64_t i = j0 / P.page, o = j0 - i * P.page, pg = row[i];
    if (pg < 0 || pg >= P.num_pages) return bad(pg);
    for (int64_t j = 0; j < n; ++j, ++o) {
      if (o == P.page) {
        o = 0;
        pg = row[++i];
        if (pg < 0 || pg >= P.num_pages) return bad(pg);
      }
      row_at(P, pg, o, ko[j], vo[j]);
    }
    return true;
  }
  const int64_t slots = P.num_pages * P.page;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t slot = row[j0 + j];
    if (slot < 0 || slot >= slots) return bad(slot);
    if (P.page == 1) {
      ko[j] = slot * P.k_ps;
      vo[j] = slot * P.v_ps;
    } else {
      const int64_t pg = P.page_shift >= 0 ? slot >> P.page_shift : slot / P.page, o = slot - pg * P.page;
      row_at(P, pg, o, ko[j], vo[j]);
    }
  }
  return true;
}

thread_local std::vector<int64_t> t_offsets;
thread_local std::vector<float> t_unpacked[2];  // a packed pool's K (0) and V (1) rows of a block, row-major

// Rows of n keys of a packed pool (rows[j]: where key j's row lies, row_at) unpacked into this thread's scratch, K's
// (value false, D dims) or V's (Dv); rows[j] then points at key j's row there. For the paths that read rows
// (any ISA, float32 pools): correct, not fast. Until the next call for the same side.
template <typename T>
inline void unpack_rows(const Problem& P, bool value, const T** rows, int64_t n) {
  const int64_t D = value ? P.Dv : P.D;
  T* dst = reinterpret_cast<T*>(aligned(t_unpacked[value], up16(n * D)));
  for (int64_t j = 0; j < n; ++j) {
    const T* src = rows[j];
    T* row = dst + j * D;
    if (value) {  // 16 dims at a time, every other value of a tile row
      for (int64_t d = 0; d < D; d += 16) {
        const T* from = src + packed_v_dim(d, P.page);
        for (int64_t i = 0; i < 16; ++i) row[d + i] = from[2 * i];
      }
    } else {  // pairs of dims, a tile row (64 bytes) apart
      for (int64_t d = 0; d < D; d += 2) std::memcpy(row + d, src + packed_k_dim(d), 2 * sizeof(T));
    }
    rows[j] = row;
  }
}

// kp[j], vp[j]: the K and V rows of KV head h of keys [j0, j0 + nk) of a request (its table row `row`); false
// where the table names a slot or page outside the pool (key_offsets).
template <typename T>
inline bool slot_ptrs(const Problem& P, const int32_t* row, int64_t j0, int64_t nk, int64_t h, const T** kp,
                      const T** vp) {
  if (int64_t(t_offsets.size()) < 2 * nk) t_offsets.resize(2 * nk);
  int64_t* ko = t_offsets.data();
  int64_t* vo = ko + nk;
  if (!key_offsets(P, row, j0, nk, ko, vo)) return false;
  const T* K = static_cast<const T*>(P.k) + h * P.k_hs;
  const T* V = static_cast<const T*>(P.v) + h * P.v_hs;
  for (int64_t j = 0; j < nk; ++j) {
    kp[j] = K + ko[j];
    vp[j] = V + vo[j];
  }
  if (P.packed) {
    unpack_rows(P, false, kp, nk);
    unpack_rows(P, true, vp, nk);
  }
  return true;
}

// Fold one block of scores s[R x ld] (keys [j0, j0 + nk)) into the rows' softmax state; returns
// whether any row saw a key. Masks by range / custom mask, applies the logit cap. `f` > 0: the scores are
// still to be multiplied by f (the softmax scale of an unscaled query), done inside the exp. The block's
// probabilities replace the scores, or go to pb [R x ldp] as bf16 where given.
inline bool fold_block(const Problem& P, int64_t b, int64_t i0, int64_t R, int64_t j0, int64_t nk, float* s,
                       int64_t ld, float* m, float* l, float* acc, int64_t Dv, const int64_t* lo, const int64_t* hi,
                       float f = 1.f, uint16_t* pb = nullptr, int64_t ldp = 0) {
  const int64_t G = P.G;
  const int64_t kv = P.kv_lens[b];
  bool any = false;
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * ld;
    uint16_t* pr = pb ? pb + r * ldp : nullptr;
    auto none = [&] {  // the row takes nothing from this block
      if (pr) {
        std::fill(pr, pr + nk, uint16_t(0));
      } else {
        std::fill(sr, sr + nk, 0.f);
      }
    };
    const int64_t qi = r / G;
    const int64_t rlo = lo[qi], rhi = hi[qi];
    if (rhi <= j0 || rlo >= j0 + nk) {  // nothing visible in this block
      none();
      continue;
    }
    float fr = f;
    if (P.cap > 0.f) {
      if (f != 1.f) scale_row(sr, nk, f);
      soft_cap(sr, nk, P.cap);
      fr = 1.f;
    }
    if (rlo > j0 || rhi < j0 + nk) {
      for (int64_t j = 0; j < nk; ++j) {
        if (j0 + j < rlo || j0 + j >= rhi) sr[j] = kNegInf;
      }
    }
    if (P.cmask) {
      const bool* mk = P.cmask + P.m_start[b] + (i0 + qi) * kv + j0;
      for (int64_t j = 0; j < nk; ++j) {
        if (!mk[j]) sr[j] = kNegInf;
      }
    }
    // The running max moves only where a score passes it by more than kLazyMax: below that, exp(s - m) <=
    // e^kLazyMax, which no float32 sum of a row's keys overflows, and the softmax does not depend on m; so most
    // blocks take no horizontal max, no rescale and no branch on it.
    if (m[r] != kNegInf) {
      if (pr) {  // the test and the exps in one pass; scores unchanged
        const float sum = exp_sub_sum<true>(sr, nk, m[r], fr, pr);
        if (!std::isnan(sum)) {
          any = true;
          l[r] += sum;
          continue;
        }
      } else if (!any_above_or_nan(sr, nk, fr, m[r] + kLazyMax)) {
        any = true;
        l[r] += exp_sub_sum(sr, nk, m[r], fr, pr);
        continue;
      }
    }
    const float bm = max_of(sr, nk) * fr;
    if (std::isnan(bm)) {  // the row's output is NaN (l = NaN marks it), as the reference's would be
      l[r] = std::numeric_limits<float>::quiet_NaN();
      none();
      continue;
    }
    if (bm == kNegInf) {
      none();
      continue;
    }
    any = true;
    const float mn = std::max(m[r], bm);
    if (m[r] != kNegInf && mn != m[r]) {
      const float alpha = std::exp(m[r] - mn);
      l[r] *= alpha;
      scale_row(acc + r * Dv, Dv, alpha);
    }
    m[r] = mn;
    l[r] += exp_sub_sum(sr, nk, mn, fr, pr);
  }
  return any;
}

// The rows' outputs acc / l, l gaining exp(sink - m) where the layer has sinks (the sink is one more logit
// whose value is zero: a row that saw no key outputs zeros). acc: [R x Dv] float32, in pairs order where
// `paired` (the AVX2 bf16 row path); m, l: [R], the rows' running max and sum.
inline void write_rows(const Problem& P, int64_t b, int64_t h, int64_t i0, int64_t R, const float* acc,
                       const float* m, const float* l, bool paired = false) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = P.q_start[b] + i0 + r / P.G, head = h * P.G + r % P.G;
    double sum = l[r];
    if (P.sinks) sum += std::exp(double(P.sinks[head]) - double(m[r]));  // m = -inf (no key): +inf, f = 0
    const float f = std::isnan(sum) ? float(sum) : (sum > 0. ? float(1. / sum) : 0.f);
    const float* a = acc + r * P.Dv;
    const int64_t at_o = t * P.o_s0 + head * P.o_s1;
    if (P.out_bf16) {
      uint16_t* o = reinterpret_cast<uint16_t*>(P.out_bf16 + at_o);
      int64_t d = 0;
#ifdef HAL_VEC
      for (; !paired && d + kW <= P.Dv; d += kW) vstore_bf16(o + d, vmul(vload(a + d), vset(f)));
#endif
      for (; d < P.Dv; ++d) o[d] = bf16_bits(a[stored_dim(d, P.Dv, paired)] * f);
    } else if (paired) {
      for (int64_t d = 0; d < P.Dv; ++d) P.out[at_o + d] = a[stored_dim(d, P.Dv, true)] * f;
    } else {
      for (int64_t d = 0; d < P.Dv; ++d) P.out[at_o + d] = a[d] * f;
    }
  }
}

// Rows of a task: the G query heads of KV head h for query rows [i0, i1), times f, float32.
inline void load_q(const Problem& P, int64_t b, int64_t h, int64_t i0, int64_t i1, float* qs, float f) {
  int64_t r = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t t = P.q_start[b] + i;
    for (int64_t g = 0; g < P.G; ++g, ++r) {
      const int64_t at_q = t * P.q_s0 + (h * P.G + g) * P.q_s1;
      if (P.q_bf16) {
        for (int64_t d = 0; d < P.D; ++d) qs[r * P.D + d] = to_float(P.q_bf16[at_q + d]) * f;
      } else {
        for (int64_t d = 0; d < P.D; ++d) qs[r * P.D + d] = P.q[at_q + d] * f;
      }
    }
  }
}

// Key ranges of a task's query rows (and their union [LO, HI)), its queries (scaled unless `scaled` is false:
// the scores are then scaled after the dot), zeroed state.
inline void start_task(const Problem& P, const Task& task, int64_t R, int64_t* lo, int64_t* hi, int64_t& LO,
                       int64_t& HI, float* qs, float* acc, float* m, float* l, bool scaled = true) {
  LO = std::numeric_limits<int64_t>::max();
  HI = 0;
  for (int64_t i = 0; i < task.i1 - task.i0; ++i) {
    key_range(P, task.b, task.i0 + i, lo[i], hi[i]);
    LO = std::min(LO, lo[i]);
    HI = std::max(HI, hi[i]);
  }
  load_q(P, task.b, task.h, task.i0, task.i1, qs, scaled ? P.scale : 1.f);
  std::fill(acc, acc + R * P.Dv, 0.f);
  std::fill(m, m + R, kNegInf);
  std::fill(l, l + R, 0.f);
}

// Keys per block on the row path. Token-major: kBlock, half that with several heads (a block's slots then serve
// them all). Head-major pages: a page's keys, at most kRunKeys (a head's keys of a page are one run; bf16 decode,
// page 128, from memory: blocks of 16 and 32 alike, 64 0.88x, 128 0.84x, though 128 is 1.12x in cache).
inline int64_t row_block(const Problem& P, int64_t nh) {
  if (P.page > 1 && P.k_ts < P.k_hs) return std::clamp<int64_t>(P.page, kBlock / 2, kRunKeys);
  return nh > 1 ? kBlock / 2 : kBlock;
}

// Decode / verify / short extend: every row of the task, for KV heads [h, h + nh), over blocks of keys.
// With several heads a block's slots serve them all (its K rows for every head's scores, then its V rows for
// every head's P . V): each slot's K (and V) rows of all heads are adjacent, so a block costs one TLB walk and one
// DRAM page per slot, not one per head.
template <typename T>
void run_rows(const Problem& P, const Task& task) {
  const int64_t b = task.b, i0 = task.i0, nq = task.i1 - task.i0, nh = task.nh;
  const int64_t R = nq * P.G, D = P.D, Dv = P.Dv;
  const int64_t blk = row_block(P, nh);
  const int64_t per_head = up16(R * D + R * Dv + 2 * R);
  const int64_t per_scores = up16(R * blk);  // one head's scores of a block
  const int64_t group = std::clamp<int64_t>(kScoresBytes / (per_scores * int64_t(sizeof(float))), 1, nh);
  float* scores = scratch(group * per_scores + nh * per_head);
  float* state = scores + group * per_scores;
  std::vector<int64_t> lo(nq), hi(nq);
  int64_t LO = 0, HI = 0;
#if defined(HAL_BF16DOT) && !defined(HAL_AMX)
  constexpr bool dot = std::is_same_v<T, at::BFloat16>;  // bf16 keys dotted without widening
#else  // (AMX Xeons run vdpbf16ps at half the FMA rate: widened, the decode's keys score 1.06-1.08x faster in
       // cache and 0.99-1.02x from memory)
  constexpr bool dot = false;
#endif
  constexpr bool pairs = kBf16Pairs && std::is_same_v<T, at::BFloat16>;  // AVX2: bf16 rows widened as pairs
  for (int64_t hh = 0; hh < nh; ++hh) {
    float* qs = state + hh * per_head;
    Task head = task;
    head.h = task.h + hh;
    start_task(P, head, R, lo.data(), hi.data(), LO, HI, qs, qs + R * D, qs + R * D + R * Dv,
               qs + R * D + R * Dv + R, !dot);
#if defined(HAL_VEC) && HAL_VEC == 8
    if constexpr (pairs) to_pairs_order(qs, R, D);
#endif
  }
  // bf16 halves of every head's (unscaled) query rows, where bf16 keys are dotted without widening: a bf16
  // query is exact in its hi half and takes one pass of dots, the scale applied to the scores
  thread_local std::vector<uint16_t> t_qb;
  uint16_t* qb = nullptr;
  bool qlo = false;
  const float post = dot ? P.scale : 1.f;
  if constexpr (dot) {
    qb = aligned(t_qb, nh * 2 * R * D);
    for (int64_t hh = 0; hh < nh; ++hh) qlo |= split_bf16(state + hh * per_head, R, D, qb + hh * 2 * R * D);
  }
  if (int64_t(t_ptrs.size()) < 4 * blk) t_ptrs.resize(4 * blk);
  const T** kp = reinterpret_cast<const T**>(t_ptrs.data());
  const T** vp = kp + blk;
  const char** next_k = reinterpret_cast<const char**>(vp + blk);  // the next block's rows of the head at hand
  const char** next_v = next_k + blk;
  // head 0's row offsets of this block's keys (K, V) and of the next block's
  thread_local std::vector<int64_t> t_rows_at;
  if (int64_t(t_rows_at.size()) < 4 * blk) t_rows_at.resize(4 * blk);
  int64_t *cur_k = t_rows_at.data(), *cur_v = cur_k + blk, *nxt_k = cur_v + blk, *nxt_v = nxt_k + blk;
  const int32_t* r2t_row = P.r2t + P.rows[b] * P.r2t_s0;
  const T* K = static_cast<const T*>(P.k);
  const T* V = static_cast<const T*>(P.v);
  // The row of the next block (nn keys, head 0's offsets `next`) that head step hh fetches as its j-th: key j of
  // its own head; over head-major pages a share of every head's keys instead (key at / nh of head at % nh, at =
  // hh * nn + j), so that the fetches go to all the next block's runs at once: each head's run fetched whole, one
  // after another, read slower from memory (bf16 decode, page 16, 2 threads: 1.18x for the spread).
  const bool spread = P.page > 1 && P.k_ts < P.k_hs && nh > 1;
  auto ahead_row = [&](const T* base, const int64_t* next, int64_t nn, int64_t head_stride, int64_t hh,
                       int64_t j) {
    const int64_t at = hh * nn + j;
    const T* row = spread ? base + next[at / nh] + (task.h + at % nh) * head_stride
                          : base + next[j] + (task.h + hh) * head_stride;
    return reinterpret_cast<const char*>(row);
  };
  if (LO < HI && !key_offsets(P, r2t_row, LO, std::min(blk, HI - LO), cur_k, cur_v)) return;
  for (int64_t j0 = LO; j0 < HI; j0 += blk) {
    const int64_t nk = std::min(blk, HI - j0);
    const int64_t j1 = j0 + blk;
    const int64_t nn = j1 < HI ? std::min(blk, HI - j1) : 0;
    if (nn && !key_offsets(P, r2t_row, j1, nn, nxt_k, nxt_v)) return;
    // A group of heads' scores of the block first, then each one's fold and P . V: a slot's K rows of all heads
    // are adjacent, and so are its V rows, so each is read in one pass (32 x 2048 keys, slots scattered: 1.10-1.13x
    // over head after head, fp32 and bf16, AMX to AVX2 builds; in page order 1.0-1.03x). As many heads as keep
    // their scores in L1 (a decode's all). bf16 keys take vdpbf16ps, not AMX: a tile load of 16 K rows from the
    // pool waits for all 16, and tiles scored keys in page order at 0.93-0.96x of the dots from memory.
    for (int64_t g0 = 0; g0 < nh; g0 += group) {
      const int64_t g1 = std::min(nh, g0 + group);
      for (int64_t hh = g0; hh < g1; ++hh) {
        const int64_t h = task.h + hh;
        for (int64_t j = 0; j < nk; ++j) kp[j] = K + cur_k[j] + h * P.k_hs;
        if (P.packed) unpack_rows(P, false, kp, nk);
        // The next block's rows of this head go to L2 while this one computes, spread over the dots (K) and
        // P . V (V) by the first group of rows (see Ahead). Two or three blocks ahead lost on the Zen 1 and the
        // Xeon; one head-step ahead was within noise.
        for (int64_t j = 0; j < nn; ++j) next_k[j] = ahead_row(K, nxt_k, nn, P.k_hs, hh, j);
        const Ahead ahead_k{next_k, nn, int64_t(D * sizeof(T))};
        const float* qs = state + hh * per_head;
        float* s = scores + (hh - g0) * per_scores;
        for (int64_t r = 0; r < R; r += 4) {
          const int nr = int(std::min<int64_t>(4, R - r));
#if defined(HAL_VEC) && HAL_VEC == 8
          if constexpr (pairs) {
            qk_pairs_any(nr, qs + r * D, D, kp, nk, s + r * blk, blk, post, r ? Ahead{} : ahead_k);
            continue;
          }
#endif
          qk_any<T>(nr, qs + r * D, qb ? qb + (hh * R + r) * 2 * D : nullptr, qlo, D, kp, nk, s + r * blk, blk, post,
                    r ? Ahead{} : ahead_k);
        }
      }
      for (int64_t hh = g0; hh < g1; ++hh) {
        const int64_t h = task.h + hh;
        for (int64_t j = 0; j < nk; ++j) vp[j] = V + cur_v[j] + h * P.v_hs;
        if (P.packed) unpack_rows(P, true, vp, nk);
        for (int64_t j = 0; j < nn; ++j) next_v[j] = ahead_row(V, nxt_v, nn, P.v_hs, hh, j);
        const Ahead ahead_v{next_v, nn, int64_t(Dv * sizeof(T))};
        float* s = scores + (hh - g0) * per_scores;
        float* acc = state + hh * per_head + R * D;
        float* m = acc + R * Dv;
        float* l = m + R;
        if (!fold_block(P, b, i0, R, j0, nk, s, blk, m, l, acc, Dv, lo.data(), hi.data())) {
          ahead_v.fetch_all();  // no P . V to spread them over
        } else {
          for (int64_t r = 0; r < R; r += 4) {
            const int nr = int(std::min<int64_t>(4, R - r));
#if defined(HAL_VEC) && HAL_VEC == 8
            if constexpr (pairs) {
              pv_pairs_any(nr, s + r * blk, blk, vp, nk, acc + r * Dv, Dv, r ? Ahead{} : ahead_v);
              continue;
            }
#endif
            pv_any<T>(nr, s + r * blk, blk, vp, nk, acc + r * Dv, Dv, r ? Ahead{} : ahead_v);
          }
        }
      }
    }
    std::swap(cur_k, nxt_k);
    std::swap(cur_v, nxt_v);
  }
  for (int64_t hh = 0; hh < nh; ++hh) {
    float* qs = state + hh * per_head;
    write_rows(P, b, task.h + hh, i0, R, qs + R * D, qs + R * D + R * Dv, qs + R * D + R * Dv + R, pairs);
  }
}

// A bf16 tile task's float32 state in the thread's scratch: queries [R x D], accumulators [Rp x Dv] (rows padded
// to the tile), scores [Rp x BK], running max and sum [R].
struct TileState {
  float *qs, *acc, *s, *m, *l;
};
inline TileState tile_state(int64_t R, int64_t Rp, int64_t D, int64_t Dv, int64_t BK) {
  float* qs = scratch(up16(R * D) + up16(Rp * Dv) + up16(Rp * BK) + 2 * R);
  float* acc = qs + up16(R * D);
  float* s = acc + up16(Rp * Dv);
  return {qs, acc, s, s + up16(Rp * BK), s + up16(Rp * BK) + R};
}

#ifdef HAL_AMX
// ---- AMX tile path (bf16 pools) ------------------------------------------------------------
// Eight tiles of 16 rows x 64 bytes: C (tmm0-3, 2 x 2 blocks of 16 x 16 float32), A (tmm4-5: 16 rows x 32 bf16)
// and B (tmm6-7: 16 rows of 16 bf16 pairs, the "VNNI" layout B[k / 2][n][k % 2]). tile_dp(c, a, b) is
// C[m][n] += sum_k A[m][k] B[k][n] over the 32 k of one A row.
#if defined(HAL_AMX_EMULATE)
inline bool amx_ready() { return true; }
inline void amx_begin() {}
inline void amx_end() {}
thread_local uint8_t t_tmm[8][16][64];  // scalar stand-ins of the tile registers
inline float bf16_value(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float y;
  std::memcpy(&y, &u, 4);
  return y;
}
inline void tile_zero(int t) { std::memset(t_tmm[t], 0, sizeof(t_tmm[t])); }
inline void tile_load(int t, const void* p, int64_t stride) {
  for (int i = 0; i < 16; ++i) std::memcpy(t_tmm[t][i], static_cast<const char*>(p) + i * stride, 64);
}
inline void tile_store(int t, void* p, int64_t stride) {
  for (int i = 0; i < 16; ++i) std::memcpy(static_cast<char*>(p) + i * stride, t_tmm[t][i], 64);
}
inline void tile_dp(int c, int a, int b) {
  for (int m = 0; m < 16; ++m) {
    float* row = reinterpret_cast<float*>(t_tmm[c][m]);
    const uint16_t* ar = reinterpret_cast<const uint16_t*>(t_tmm[a][m]);
    for (int n = 0; n < 16; ++n) {
      float x = row[n];
      for (int k = 0; k < 16; ++k) {
        const uint16_t* br = reinterpret_cast<const uint16_t*>(t_tmm[b][k]);
        x += bf16_value(ar[2 * k]) * bf16_value(br[2 * n]) + bf16_value(ar[2 * k + 1]) * bf16_value(br[2 * n + 1]);
      }
      row[n] = x;
    }
  }
}
#define HAL_TILE_ZERO(t) tile_zero(t)
#define HAL_TILE_LOAD(t, p, s) tile_load(t, p, s)
#define HAL_TILE_STREAM_LOAD(t, p, s) tile_load(t, p, s)
#define HAL_TILE_STORE(t, p, s) tile_store(t, p, s)
#define HAL_TILE_DP(c, a, b) tile_dp(c, a, b)
#else
// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
inline bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline void amx_begin() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  // Not _tile_loadconfig: GCC 12's tells the compiler that ldtilecfg reads 8 bytes of the config, so the
  // stores to the rest may be dropped as dead, and ldtilecfg faults on what the stack held (seen in
  // bench/read_probe.cpp after an unrelated change). This operand is all 64 bytes.
  asm volatile("ldtilecfg %0" ::"m"(config));
}
inline void amx_end() { _tile_release(); }
#define HAL_TILE_ZERO(t) _tile_zero(t)
// Not _tile_loadd: GCC 12's is an asm naming neither the memory it reads nor a memory clobber, so the compiler
// may move the stores that fill what it loads (packed Q^T, V, P) past it. This one reads the memory at p.
#define HAL_TILE_LOAD(t, p, s)                                                                  \
  asm volatile("{tileloadd\t(%1,%2,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%1+%2*1]}" ::"m"( \
                   *(const char(*)[])(p)),                                                     \
               "r"((const void*)(p)), "r"((long)(s)))
// tileloaddt1: the same, with the hint that the tile's lines will not be read again soon (K and V tiles read
// straight from the pool, once each: vLLM's AMX kernel streams them so, _tile_stream_loadd).
#define HAL_TILE_STREAM_LOAD(t, p, s)                                                                 \
  asm volatile("{tileloaddt1\t(%1,%2,1), %%tmm" #t "|tileloaddt1\t%%tmm" #t ", [%1+%2*1]}" ::"m"( \
                   *(const char(*)[])(p)),                                                           \
               "r"((const void*)(p)), "r"((long)(s)))
#define HAL_TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define HAL_TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

// Lines of memory fetched into L2 a few at a time as tiles are multiplied (the next block's tiles of the pool, as
// Ahead does for the row path's rows): `runs` runs of `bytes` bytes, `stride` bytes apart, from `p`; `per` lines
// each step().
struct TileAhead {
  const char* p = nullptr;
  int64_t bytes = 0, stride = 0, runs = 0, per = 0;
  int64_t run = 0, at = 0;  // the next line: run `run`, byte `at`
  // `per` set so that `steps` steps fetch every line
  void spread(int64_t steps) {
    const int64_t lines = runs * ((bytes + 63) / 64);
    per = (lines + std::max<int64_t>(steps, 1) - 1) / std::max<int64_t>(steps, 1);
  }
  __attribute__((always_inline)) void step() {
    for (int64_t i = 0; i < per && run < runs; ++i) {
      __builtin_prefetch(p + run * stride + at, 0, 1);
      at += 64;
      if (at >= bytes) {
        at = 0;
        ++run;
      }
    }
  }
  void rest() {
    per = std::numeric_limits<int64_t>::max();
    step();
  }
};

// C (NR x NC tiles of 16 x 16 float32 at c, row stride ldc bytes) = (accumulate ? C : 0) + A . B over `chunks`
// chunks of 32 k. A: rows of bf16, row stride lda bytes, chunk k at a + 32 k, the second row tile 16 rows down;
// a_lo, where given, a second A (the low bf16 halves of float32 rows) dotted with the same B. B: VNNI blocks
// of 16 x 32 bf16, chunk k of column tile n at b + n * b_col + k * b_chunk; STREAM: read once (tiles of the pool:
// tileloaddt1). `ahead`, where given, steps once per chunk.
template <int NR, int NC, bool STREAM = false>
inline void amx_mm(const uint16_t* a, const uint16_t* a_lo, int64_t lda, const uint16_t* b, int64_t b_col,
                   int64_t b_chunk, int64_t chunks, float* c, int64_t ldc, bool accumulate, TileAhead* ahead) {
  const int64_t a_row = 16 * lda / 2;  // elements to the second row tile
  char* c0 = reinterpret_cast<char*>(c);
  if (accumulate) {
    HAL_TILE_LOAD(0, c0, ldc);
    if constexpr (NC > 1) HAL_TILE_LOAD(1, c0 + 64, ldc);
    if constexpr (NR > 1) HAL_TILE_LOAD(2, c0 + 16 * ldc, ldc);
    if constexpr (NR > 1 && NC > 1) HAL_TILE_LOAD(3, c0 + 16 * ldc + 64, ldc);
  } else {
    HAL_TILE_ZERO(0);
    if constexpr (NC > 1) HAL_TILE_ZERO(1);
    if constexpr (NR > 1) HAL_TILE_ZERO(2);
    if constexpr (NR > 1 && NC > 1) HAL_TILE_ZERO(3);
  }
  for (int64_t k = 0; k < chunks; ++k) {
    if constexpr (STREAM) {
      HAL_TILE_STREAM_LOAD(6, b + b_chunk * k, 64);
      if constexpr (NC > 1) HAL_TILE_STREAM_LOAD(7, b + b_col + b_chunk * k, 64);
    } else {
      HAL_TILE_LOAD(6, b + b_chunk * k, 64);
      if constexpr (NC > 1) HAL_TILE_LOAD(7, b + b_col + b_chunk * k, 64);
    }
    if (ahead) ahead->step();
    for (const uint16_t* x : {a, a_lo}) {
      if (!x) continue;
      HAL_TILE_LOAD(4, x + 32 * k, lda);
      if constexpr (NR > 1) HAL_TILE_LOAD(5, x + a_row + 32 * k, lda);
      HAL_TILE_DP(0, 4, 6);
      if constexpr (NC > 1) HAL_TILE_DP(1, 4, 7);
      if constexpr (NR > 1) HAL_TILE_DP(2, 5, 6);
      if constexpr (NR > 1 && NC > 1) HAL_TILE_DP(3, 5, 7);
    }
  }
  HAL_TILE_STORE(0, c0, ldc);
  if constexpr (NC > 1) HAL_TILE_STORE(1, c0 + 64, ldc);
  if constexpr (NR > 1) HAL_TILE_STORE(2, c0 + 16 * ldc, ldc);
  if constexpr (NR > 1 && NC > 1) HAL_TILE_STORE(3, c0 + 16 * ldc + 64, ldc);
}

// C [rows x cols] (rows, cols multiples of 16) by amx_mm over 2 x 2 tile blocks, single tiles at the edges.
template <bool STREAM = false>
inline void amx_gemm(const uint16_t* a, const uint16_t* a_lo, int64_t lda, int64_t rows, const uint16_t* b,
                     int64_t b_col, int64_t b_chunk, int64_t cols, int64_t chunks, float* c, int64_t ldc,
                     bool accumulate, TileAhead* ahead = nullptr) {
  const int64_t a_row = 16 * lda / 2, c_row = 16 * ldc / 4;
  for (int64_t r = 0; r < rows; r += 32) {
    const uint16_t* ar = a + r / 16 * a_row;
    const uint16_t* lr = a_lo ? a_lo + r / 16 * a_row : nullptr;
    const bool two_rows = r + 32 <= rows;
    for (int64_t n = 0; n < cols; n += 32) {
      const uint16_t* bn = b + n / 16 * b_col;
      float* cn = c + r / 16 * c_row + n;
      if (n + 32 <= cols) {
        two_rows ? amx_mm<2, 2, STREAM>(ar, lr, lda, bn, b_col, b_chunk, chunks, cn, ldc, accumulate, ahead)
                 : amx_mm<1, 2, STREAM>(ar, lr, lda, bn, b_col, b_chunk, chunks, cn, ldc, accumulate, ahead);
      } else {
        two_rows ? amx_mm<2, 1, STREAM>(ar, lr, lda, bn, b_col, b_chunk, chunks, cn, ldc, accumulate, ahead)
                 : amx_mm<1, 1, STREAM>(ar, lr, lda, bn, b_col, b_chunk, chunks, cn, ldc, accumulate, ahead);
      }
    }
  }
}

// The amx_mm steps (chunk iterations) of amx_gemm over rows x cols, `chunks` chunks: what a TileAhead spreads over.
inline int64_t amx_steps(int64_t rows, int64_t cols, int64_t chunks) {
  return (rows + 31) / 32 * ((cols + 31) / 32) * chunks;
}

// Keys [16 g, 16 g + 16) of a block (kp[j], j < nk; zeros past nk), D dims, into the VNNI blocks of B = K^T:
// block (g, c) at dst + (g * D / 32 + c) * 512, row kk, column j % 16, pair p = K[j][32 c + 2 kk + p]. Each
// block is a 16 x 16 transpose of 32-bit dim pairs.
inline void pack_keys(const at::BFloat16* const* kp, int64_t g, int64_t nk, int64_t D, uint16_t* dst) {
  const int64_t dchunks = D / 32;
#ifdef HAL_BF16DOT
  for (int64_t c = 0; c < dchunks; ++c) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t key = 16 * g + j;
      r[j] = key < nk ? _mm512_loadu_si512(kp[key] + 32 * c) : _mm512_setzero_si512();
    }
    // 16 x 16 transpose of 32-bit elements: r[j] holds key j's 16 pairs; out row kk holds pair kk of each key
    __m512i t[16];
    for (int j = 0; j < 16; j += 2) {
      t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
      t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int j = 0; j < 16; j += 4) {
      r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
      r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
      r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
      r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    for (int j = 0; j < 4; ++j) {  // 128-bit lanes: rows 4 q + j, q = 0..3, gathered across the four groups
      t[j] = _mm512_shuffle_i32x4(r[j], r[j + 4], 0x88);
      t[j + 4] = _mm512_shuffle_i32x4(r[j], r[j + 4], 0xdd);
      t[j + 8] = _mm512_shuffle_i32x4(r[j + 8], r[j + 12], 0x88);
      t[j + 12] = _mm512_shuffle_i32x4(r[j + 8], r[j + 12], 0xdd);
    }
    uint16_t* blk = dst + (g * dchunks + c) * 512;
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_si512(blk + (j + 0) * 32, _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88));
      _mm512_storeu_si512(blk + (j + 8) * 32, _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd));
      _mm512_storeu_si512(blk + (j + 4) * 32, _mm512_shuffle_i32x4(t[j + 4], t[j + 12], 0x88));
      _mm512_storeu_si512(blk + (j + 12) * 32, _mm512_shuffle_i32x4(t[j + 4], t[j + 12], 0xdd));
    }
  }
#else
  for (int64_t j = 0; j < 16; ++j) {
    const int64_t key = 16 * g + j;
    const uint16_t* krow = key < nk ? reinterpret_cast<const uint16_t*>(kp[key]) : nullptr;
    for (int64_t c = 0; c < dchunks; ++c) {
      uint16_t* blk = dst + (g * dchunks + c) * 512 + 2 * j;
      for (int64_t kk = 0; kk < 16; ++kk) {
        blk[kk * 32] = krow ? krow[c * 32 + 2 * kk] : 0;
        blk[kk * 32 + 1] = krow ? krow[c * 32 + 2 * kk + 1] : 0;
      }
    }
  }
#endif
}

// Keys [0, nk32) of V rows (vp[j], j < nk; zeros past nk), Dv dims, into the VNNI blocks of B = V: block
// (q, e) at dst + (q * Dv / 16 + e) * 512, row (j % 32) / 2, column n, pair j % 2 = V[32 q + j % 32][16 e + n].
inline void pack_values(const at::BFloat16* const* vp, int64_t nk, int64_t nk32, int64_t Dv, uint16_t* dst) {
  const int64_t vgroups = Dv / 16;
  for (int64_t j = 0; j < nk32; j += 2) {
    const uint16_t* v0 = j < nk ? reinterpret_cast<const uint16_t*>(vp[j]) : nullptr;
    const uint16_t* v1 = j + 1 < nk ? reinterpret_cast<const uint16_t*>(vp[j + 1]) : nullptr;
    uint16_t* row = dst + (j / 32) * vgroups * 512 + ((j % 32) / 2) * 32;
    int64_t e = 0;
#ifdef HAL_BF16DOT
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (; e + 2 <= vgroups; e += 2) {  // two groups of 16 dims: 32 bf16 of each key
      const __m512i a = v0 ? _mm512_loadu_si512(v0 + 16 * e) : _mm512_setzero_si512();
      const __m512i b = v1 ? _mm512_loadu_si512(v1 + 16 * e) : _mm512_setzero_si512();
      _mm512_storeu_si512(row + e * 512, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(row + (e + 1) * 512, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
#endif
    for (; e < vgroups; ++e) {
      uint16_t* blk = row + e * 512;
      for (int64_t n = 0; n < 16; ++n) {
        blk[2 * n] = v0 ? v0[16 * e + n] : 0;
        blk[2 * n + 1] = v1 ? v1[16 * e + n] : 0;
      }
    }
  }
}

// ---- AMX-packed pages read as tiles ------------------------------------------------------------------------
// Whether a request's keys [lo, hi) lie as whole pages do (key j at offset j % page, the keys of one page of the
// request on one page of the pool), so that their tiles are read where they lie: always through req_to_page;
// through req_to_token where its slots run so (a paged allocator's). A slot outside the pool: false (the row path
// names it).
inline bool pages_whole(const Problem& P, const int32_t* row, int64_t lo, int64_t hi) {
  if (P.by_page) return true;
  const int64_t slots = P.num_pages * P.page;
  int64_t first = -1;  // the pool slot of offset 0 of the page at hand
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t slot = row[j], o = j % P.page;
    if (slot < 0 || slot >= slots || (slot - o) % P.page || (j > lo && o > 0 && slot - o != first)) return false;
    first = slot - o;
  }
  return true;
}

// The pool page of key j of a request (through its table row), or -1 where the table names one outside the pool
// (recorded as key_offsets does, where `record`).
inline int64_t page_of(const Problem& P, const int32_t* row, int64_t j, bool record = true) {
  const int64_t pg = P.by_page ? row[j / P.page] : row[j] / P.page;
  if (pg >= 0 && pg < P.num_pages && (P.by_page || row[j] >= 0)) return pg;
  if (record) {
    P.bad_slot->store(P.by_page ? pg : row[j]);
    P.bad->store(true);
  }
  return -1;
}

// Keys outside [a, z) of a packed V tile (32 keys x 16 dims; row kk: keys 2 kk and 2 kk + 1, interleaved) set to
// zero: a row of two such keys at once, a row of one every other value.
inline void zero_tile_keys(uint16_t* tile, int64_t a, int64_t z) {
  for (int64_t kk = 0; kk < 16; ++kk) {
    const bool even = 2 * kk >= a && 2 * kk < z, odd = 2 * kk + 1 >= a && 2 * kk + 1 < z;
    uint16_t* row = tile + kk * 32;
    if (!even && !odd) {
      std::memset(row, 0, 64);
    } else if (even != odd) {
      for (int64_t n = 0; n < 16; ++n) row[2 * n + (even ? 1 : 0)] = 0;
    }
  }
}

// Keys [j, j + n32) of a request (j and n32 multiples of 32, keys from j + n on zeroed in V) copied from AMX-packed
// pages into run_tile_amx's blocks: K's as they lie in the pool (its blocks are the pool's), V's from the pool's
// order (16 dims a panel) into (key chunk, 16 dims) order. false: the table names a page outside the pool.
inline bool copy_packed_tiles(const Problem& P, const int32_t* row, int64_t h, int64_t j, int64_t n, int64_t n32,
                              uint16_t* kdst, uint16_t* vdst) {
  const int64_t vgroups = P.Dv / 16;
  const uint16_t* K = static_cast<const uint16_t*>(P.k);
  const uint16_t* V = static_cast<const uint16_t*>(P.v);
  for (int64_t c = 0; c < n32; c += 32) {
    const int64_t pg = page_of(P, row, j + c), o = (j + c) % P.page;
    if (pg < 0) return false;
    std::memcpy(kdst + c * P.D, K + pg * P.k_ps + h * P.k_hs + packed_k_row(o, P.D), 32 * P.D * 2);
    for (int64_t e = 0; e < vgroups; ++e) {
      uint16_t* tile = vdst + (c / 32 * vgroups + e) * kTileValues;
      std::memcpy(tile, V + pg * P.v_ps + h * P.v_hs + packed_v_row(o) + packed_v_dim(16 * e, P.page),
                  kTileValues * 2);
      if (c + 32 > n) zero_tile_keys(tile, 0, n - c);
    }
  }
  return true;
}

// The extend tiles of run_tile for bf16 pools with D % 32 == 0 and Dv % 16 == 0. The task's query rows
// [i0, i1) are taken task.sub at a time (rows padded to 16), over K and V packed once per task into the VNNI
// layout (keys in groups of 32 from a multiple of 32, zeros past the last; copied from an AMX-packed pool's
// tiles, copy_packed_tiles): every tile of the task reads the same packed keys. Q and P are bf16. Q is taken
// unscaled (the scale goes inside fold_block's exp), so a bf16 query is exact in one bf16 pass; a float32 one that
// is not also gets a second pass over its low halves, and so does P: float32 accuracy for float32 queries, while
// a bf16 query (a bf16 model, whose output is rounded to bf16) rounds P to bf16, as FlashAttention and vLLM do.
void run_tile_amx(const Problem& P, const Task& task) {
  const int64_t b = task.b, h = task.h, D = P.D, Dv = P.Dv, BK = kGemmBlock;
  const int64_t sub = task.sub > 0 ? task.sub : task.i1 - task.i0;
  const int64_t Rmax = sub * P.G, Rp_max = (Rmax + 15) / 16 * 16, dchunks = D / 32, vgroups = Dv / 16;
  // The task's keys: [base, top), base a multiple of 32 (the first tile's LO rounded down; windows move forward)
  int64_t base = std::numeric_limits<int64_t>::max(), top = 0;
  for (int64_t i = task.i0; i < task.i1; ++i) {
    int64_t lo, hi;
    key_range(P, b, i, lo, hi);
    if (hi > lo) {
      base = std::min(base, lo);
      top = std::max(top, hi);
    }
  }
  if (top == 0) base = 0;
  base = base / 32 * 32;
  const int64_t span = (std::max<int64_t>(top - base, 0) + 31) / 32 * 32;
  const auto [qs, acc, s, m, l] = tile_state(Rmax, Rp_max, D, Dv, BK);
  thread_local std::vector<uint16_t> t_bf16;
  // (every part a multiple of 32 elements: Rp_max of 16, D and BK of 32, span of 32)
  uint16_t* qhi = aligned(t_bf16, 2 * Rp_max * D + 2 * Rp_max * BK + span * (D + Dv));
  uint16_t* qlo = qhi + Rp_max * D;
  uint16_t* phi = qlo + Rp_max * D;
  uint16_t* plo = phi + Rp_max * BK;
  uint16_t* kpack = plo + Rp_max * BK;  // [key group of 16][D / 32] blocks of 16 x 32, key base first
  uint16_t* vpack = kpack + span * D;   // [key chunk of 32][Dv / 16] blocks of 16 x 32
  if (int64_t(t_ptrs.size()) < 2 * BK) t_ptrs.resize(2 * BK);
  const at::BFloat16** kp = reinterpret_cast<const at::BFloat16**>(t_ptrs.data());
  const at::BFloat16** vp = kp + BK;
  const int32_t* r2t_row = P.r2t + P.rows[b] * P.r2t_s0;
  int64_t packed = base;  // keys [base, packed) are packed
  // AMX-packed pages whose keys lie as whole pages: the blocks are copied from the pool's tiles, not packed from rows
  const bool from_pool = P.packed && pages_whole(P, r2t_row, base, top);
  const bool scale_in_exp = P.scale > 0.f;  // fold_block scales inside its exp (a positive scale only)
  std::vector<int64_t> lo(sub), hi(sub);
  amx_begin();
  for (int64_t i0 = task.i0; i0 < task.i1; i0 += sub) {
    const Task tile{b, h, i0, std::min(task.i1, i0 + sub), 1, 0., true};
    const int64_t R = (tile.i1 - i0) * P.G, Rp = (R + 15) / 16 * 16;
    int64_t LO, HI;
    start_task(P, tile, R, lo.data(), hi.data(), LO, HI, qs, acc, m, l, false);
    std::fill(acc + R * Dv, acc + Rp * Dv, 0.f);
    bool two_pass = false;
    for (int64_t r = 0; r < Rp; ++r)
      two_pass |= to_bf16_halves(qs + r * D, r < R ? D : 0, D, qhi + r * D, qlo + r * D);
    std::fill(phi + R * BK, phi + Rp * BK, uint16_t(0));  // padding rows: no probabilities
    LO = std::max(base, LO / 32 * 32);
    for (int64_t j0 = LO; j0 < HI; j0 += BK) {
      const int64_t nk = std::min(BK, HI - j0), nk32 = (nk + 31) / 32 * 32;
      for (; packed < j0 + nk; packed += BK) {  // keys no tile of the task has reached yet
        const int64_t np = std::min(BK, top - packed), np32 = (np + 31) / 32 * 32;
        if (from_pool) {
          if (!copy_packed_tiles(P, r2t_row, h, packed, np, np32, kpack + (packed - base) * D,
                                 vpack + (packed - base) * Dv)) {
            amx_end();
            return;
          }
          continue;
        }
        if (!slot_ptrs<at::BFloat16>(P, r2t_row, packed, np, h, kp, vp)) {
          amx_end();
          return;
        }
        for (int64_t g = 0; g < np32 / 16; ++g) pack_keys(kp, g, np, D, kpack + (packed - base) * D);
        pack_values(vp, np, np32, Dv, vpack + (packed - base) * Dv);
      }
      amx_gemm(qhi, two_pass ? qlo : nullptr, D * 2, Rp, kpack + (j0 - base) * D, dchunks * 512, 512, nk32, dchunks,
               s, BK * 4, false);
      if (!scale_in_exp)
        for (int64_t r = 0; r < R; ++r) scale_row(s + r * BK, nk, P.scale);
      if (!fold_block(P, b, i0, R, j0, nk, s, BK, m, l, acc, Dv, lo.data(), hi.data(), scale_in_exp ? P.scale : 1.f,
                      two_pass ? nullptr : phi, BK))
        continue;
      if (two_pass) {
        for (int64_t r = 0; r < Rp; ++r) to_bf16_halves(s + r * BK, r < R ? nk : 0, nk32, phi + r * BK, plo + r * BK);
      } else if (nk < nk32) {
        for (int64_t r = 0; r < R; ++r) std::fill(phi + r * BK + nk, phi + r * BK + nk32, uint16_t(0));
      }
      amx_gemm(phi, two_pass ? plo : nullptr, BK * 2, Rp, vpack + (j0 - base) * Dv, 512, vgroups * 512, Dv,
               nk32 / 32, acc, Dv * 4, true);
    }
    write_rows(P, b, h, i0, R, acc, m, l);
  }
  amx_end();
}

// ---- AMX decode and verify over AMX-packed pages -----------------------------------------------------------
constexpr int64_t kPackedKeys = 128;  // keys per block of the packed tile path, at most (within one page)

// Row tasks (decode, verify: all query rows of a request and the GQA group of each KV head in [h, h + nh)) over
// AMX-packed bf16 pages, by tiles read straight from the pool, as vLLM's AMX kernel does: S = Q . K^T with Q's
// rows in A tiles (bf16 hi, and lo where float32 queries have nonzero low halves; query rows past 16 in more row
// tiles) and K's tiles as B; the online softmax (fold_block) in vector code; O += P . V with P in bf16 (hi + lo
// for such float32 queries, as run_tile_amx) and V's tiles as B. Blocks of up to kPackedKeys keys from a
// multiple of 32, within one page; each head's scores, fold and P . V per block, the heads of a page one after
// another (their slabs lie side by side in the pool); the next block's K and V tiles of a head fetched into L2
// while its current ones are multiplied (TileAhead). Keys past the visible ones in a block's first or last 32
// read their V tiles through a copy with those keys zeroed: slots past a request's last key hold anything (NaN
// times a zero probability is NaN).
void run_rows_amx(const Problem& P, const Task& task) {
  const int64_t b = task.b, i0 = task.i0, nq = task.i1 - task.i0, nh = task.nh;
  const int64_t R = nq * P.G, Rp = (R + 15) / 16 * 16, D = P.D, Dv = P.Dv, page = P.page;
  const int64_t dchunks = D / 32, vgroups = Dv / 16, BK = std::min(page, kPackedKeys);
  // float32: the queries of the head at hand [R x D], scores [Rp x BK]; per head: accumulators [Rp x Dv], max, sum
  const int64_t per_head = up16(Rp * Dv) + 2 * up16(R);
  float* qs = scratch(up16(R * D) + up16(Rp * BK) + nh * per_head);
  float* s = qs + up16(R * D);
  float* state = s + up16(Rp * BK);
  // bf16: per head the queries' hi and lo halves [Rp x D] each; P's hi and lo [Rp x BK]; a V chunk's tiles
  thread_local std::vector<uint16_t> t_bf16;
  uint16_t* qb = aligned(t_bf16, nh * 2 * Rp * D + 2 * Rp * BK + vgroups * kTileValues);
  uint16_t* phi = qb + nh * 2 * Rp * D;
  uint16_t* plo = phi + Rp * BK;
  uint16_t* vedge = plo + Rp * BK;
  std::vector<int64_t> lo(nq), hi(nq);
  std::vector<char> two_pass(nh);
  int64_t LO = 0, HI = 0;
  for (int64_t hh = 0; hh < nh; ++hh) {
    Task head = task;
    head.h = task.h + hh;
    float* acc = state + hh * per_head;
    start_task(P, head, R, lo.data(), hi.data(), LO, HI, qs, acc, acc + up16(Rp * Dv), acc + up16(Rp * Dv) + up16(R),
               false);
    std::fill(acc + R * Dv, acc + Rp * Dv, 0.f);
    uint16_t* qh = qb + hh * 2 * Rp * D;
    bool rest = false;
    for (int64_t r = 0; r < Rp; ++r)
      rest |= to_bf16_halves(qs + r * D, r < R ? D : 0, D, qh + r * D, qh + Rp * D + r * D);
    two_pass[hh] = rest;
  }
  std::fill(phi, phi + Rp * BK, uint16_t(0));  // padding rows: no probabilities
  const bool scale_in_exp = P.scale > 0.f;  // fold_block scales inside its exp (a positive scale only)
  const int32_t* r2t_row = P.r2t + P.rows[b] * P.r2t_s0;
  const uint16_t* K = static_cast<const uint16_t*>(P.k);
  const uint16_t* V = static_cast<const uint16_t*>(P.v);
  // block [j0, j1): from a multiple of 32, within one page, at most BK keys, to HI rounded up to 32
  auto block_end = [&](int64_t j0) { return std::min({j0 / page * page + page, j0 + BK, (HI + 31) / 32 * 32}); };
  amx_begin();
  for (int64_t j0 = LO / 32 * 32; j0 < HI;) {
    const int64_t j1 = block_end(j0), nk = std::min(j1, HI) - j0, nk32 = j1 - j0, o0 = j0 % page;
    const int64_t pg = page_of(P, r2t_row, std::max(j0, LO));
    if (pg < 0) break;
    // the next block's page (none past HI, or where the table names none: that block records it when reached)
    const int64_t n1 = j1 < HI ? block_end(j1) : j1, pn = j1 < HI ? page_of(P, r2t_row, j1, false) : -1;
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t h = task.h + hh;
      const uint16_t* qh = qb + hh * 2 * Rp * D;
      float* acc = state + hh * per_head;
      float* m = acc + up16(Rp * Dv);
      float* l = m + up16(R);
      // the block's first K tile (16 keys x 32 dims) and V tile (32 keys x 16 dims)
      const uint16_t* kt = K + pg * P.k_ps + h * P.k_hs + packed_k_row(o0, D);
      const uint16_t* vt = V + pg * P.v_ps + h * P.v_hs + packed_v_row(o0);
      TileAhead ahead_k, ahead_v;
      if (pn >= 0) {  // the next block's tiles of this head: K one run, V one run per 16 dims
        const int64_t on = j1 % page;
        ahead_k = {reinterpret_cast<const char*>(K + pn * P.k_ps + h * P.k_hs + packed_k_row(on, D)),
                   (n1 - j1) * D * 2, 0, 1};
        ahead_v = {reinterpret_cast<const char*>(V + pn * P.v_ps + h * P.v_hs + packed_v_row(on)), (n1 - j1) * 32,
                   packed_v_dim(16, page) * 2, vgroups};
      }
      ahead_k.spread(amx_steps(Rp, nk32, dchunks));
      amx_gemm<true>(qh, two_pass[hh] ? qh + Rp * D : nullptr, D * 2, Rp, kt, packed_k_row(16, D), kTileValues,
                     nk32, dchunks, s, BK * 4, false, &ahead_k);
      ahead_k.rest();
      if (!scale_in_exp)
        for (int64_t r = 0; r < R; ++r) scale_row(s + r * BK, nk, P.scale);
      if (!fold_block(P, b, i0, R, j0, nk, s, BK, m, l, acc, Dv, lo.data(), hi.data(), scale_in_exp ? P.scale : 1.f,
                      two_pass[hh] ? nullptr : phi, BK)) {
        ahead_v.rest();
        continue;
      }
      if (two_pass[hh]) {
        for (int64_t r = 0; r < Rp; ++r) to_bf16_halves(s + r * BK, r < R ? nk : 0, nk32, phi + r * BK, plo + r * BK);
      } else if (nk < nk32) {
        for (int64_t r = 0; r < R; ++r) std::fill(phi + r * BK + nk, phi + r * BK + nk32, uint16_t(0));
      }
      const uint16_t* p_lo = two_pass[hh] ? plo : nullptr;
      ahead_v.spread(amx_steps(Rp, Dv, nk32 / 32));
      // 32 keys at a time: runs of chunks whose keys are all visible from the pool, the others through vedge
      auto edge = [&](int64_t c) { return j0 + 32 * c < LO || j0 + 32 * c + 32 > HI; };
      for (int64_t c = 0; c < nk32 / 32;) {
        if (edge(c)) {
          const int64_t a = std::max<int64_t>(LO - j0 - 32 * c, 0), z = std::min<int64_t>(HI - j0 - 32 * c, 32);
          for (int64_t e = 0; e < vgroups; ++e) {
            uint16_t* tile = vedge + e * kTileValues;
            std::memcpy(tile, vt + packed_v_dim(16 * e, page) + c * kTileValues, kTileValues * 2);
            zero_tile_keys(tile, a, z);
          }
          amx_gemm(phi + 32 * c, p_lo ? p_lo + 32 * c : nullptr, BK * 2, Rp, vedge, kTileValues, kTileValues, Dv, 1,
                   acc, Dv * 4, true, &ahead_v);
          ++c;
          continue;
        }
        int64_t c1 = c;
        while (c1 < nk32 / 32 && !edge(c1)) ++c1;
        amx_gemm<true>(phi + 32 * c, p_lo ? p_lo + 32 * c : nullptr, BK * 2, Rp, vt + c * kTileValues,
                       packed_v_dim(16, page), kTileValues, Dv, c1 - c, acc, Dv * 4, true, &ahead_v);
        c = c1;
      }
      ahead_v.rest();
    }
    j0 = j1;
  }
  amx_end();
  if (P.bad->load()) return;
  for (int64_t hh = 0; hh < nh; ++hh) {
    const float* acc = state + hh * per_head;
    write_rows(P, b, task.h + hh, i0, R, acc, acc + up16(Rp * Dv), acc + up16(Rp * Dv) + up16(R));
  }
}

#endif

#ifdef HAL_VEC
// ---- register-blocked extend tiles (AVX-512, AVX2) -----------------------------------------------
// Scores are computed transposed, S^T [keys][rows]: each key's row is read in place from the pool and its
// elements broadcast against Q^T [D][rows] (packed once per task), so no K is copied; the online softmax runs
// down the key axis with one query row per lane (no horizontal reduction); P . V reads each V row in place and
// broadcasts P^T's entries. With avx512_bf16 and a bf16 pool both products are bf16 dot products over pairs:
// K's pairs broadcast against Q^T's pairs [D / 2][rows], P^T's pairs against V packed once per block into key
// pairs [keys / 2][Dv]; every sum is float32.
constexpr int kStKeys = kW == 16 ? 6 : 3;     // keys of an S^T micro-tile
constexpr int kStVecs = kW == 16 ? 4 : 2;     // row vectors of an S^T micro-tile (MR x NV accumulators)
constexpr int kPvRows = 4;                    // query rows of a P . V micro-tile
constexpr int kPvVecs = kW == 16 ? 4 : 2;     // Dv vectors of a P . V micro-tile
constexpr int64_t kTileRowsPad = kStVecs * kW;  // a tile's rows are padded to this (masked: never seen)
constexpr int64_t kTileKeys = 128;            // keys per block
constexpr int64_t kPvChunk = 64;              // keys per P . V pass (its V rows stay in L1)
// Floats past a tile's rows in each row of S^T, Q^T and P^T: rows a multiple of 512 B apart all fall in a few of
// the L1's sets (8 of 64 for 128 rows) and evict each other; 64 B more moves each row to the next set (AMX Xeon,
// extend bf16: the avx2 path 1.055-1.07x, avx512_bf16 1.04x; fp32 0.98-1.025x).
constexpr int64_t kRowPad = 16;

// st[m * ldr + r] = post * sum_d K[m][d] . qt[d * ldr + r]: MR keys (rows kp[m]) x NV vectors of rows.
template <int MR, int NV, typename T>
inline void st_tile(const T* const* kp, const float* qt, int64_t ldr, int64_t D, float* st) {
  vf acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    vf x[NV];
    for (int v = 0; v < NV; ++v) x[v] = vload(qt + d * ldr + v * kW);
    for (int m = 0; m < MR; ++m) {
      const vf a = vset(to_float(kp[m][d]));
      for (int v = 0; v < NV; ++v) acc[m][v] = vfma(a, x[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) vstore(st + m * ldr + v * kW, acc[m][v]);
}

#ifdef HAL_BF16DOT
// The same over bf16 pairs: qt2 [D / 2][ldr] pairs of the rows' bf16 hi halves, with LO their lo halves at
// qt2 + lo_off; the sums times post.
template <int MR, int NV, bool LO>
inline void st_tile_dot(const at::BFloat16* const* kp, const uint32_t* qt2, int64_t lo_off, int64_t ldr, int64_t D2,
                        float* st, float post) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D2; ++d) {
    __m512bh x[NV], y[NV];
    for (int v = 0; v < NV; ++v) {
      x[v] = (__m512bh)_mm512_loadu_si512(qt2 + d * ldr + v * 16);
      if constexpr (LO) y[v] = (__m512bh)_mm512_loadu_si512(qt2 + lo_off + d * ldr + v * 16);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, kp[m] + 2 * d, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, x[v]);
        if constexpr (LO) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, y[v]);
      }
    }
  }
  const __m512 f = _mm512_set1_ps(post);
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(st + m * ldr + v * 16, _mm512_mul_ps(acc[m][v], f));
}

// acc[m * Dv + 16 v] += sum_j2 p2[j2 * ldr + m] . vpack[j2 * Dv + 16 v] over bf16 pairs (MR rows x NV vectors).
template <int MR, int NV>
inline void pv_tile_dot(const uint32_t* p2, int64_t ldr, const uint32_t* vpack, int64_t Dv, int64_t j2a, int64_t j2b,
                        float* acc) {
  __m512 a[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) a[m][v] = _mm512_loadu_ps(acc + m * Dv + v * 16);
  for (int64_t j = j2a; j < j2b; ++j) {
    __m512bh x[NV];
    for (int v = 0; v < NV; ++v) x[v] = (__m512bh)_mm512_loadu_si512(vpack + j * Dv + v * 16);
    for (int m = 0; m < MR; ++m) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int32_t(p2[j * ldr + m]));
      for (int v = 0; v < NV; ++v) a[m][v] = _mm512_dpbf16_ps(a[m][v], w, x[v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + m * Dv + v * 16, a[m][v]);
}

// Pairs of bf16 (rounded to nearest even) of two float vectors: lane i = (a[i], b[i]).
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i x = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i y = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
  return _mm512_or_si512(x, _mm512_slli_epi32(y, 16));
}
#endif

// dst[j * ld + i] = src[j][i] as float32 for j < n, i < d.
template <typename T>
inline void widen_rows(const T* const* src, int64_t n, int64_t d, float* dst, int64_t ld) {
  const int64_t dw = d / kW * kW;
  for (int64_t j = 0; j < n; ++j) {
    int64_t i = 0;
    for (; i < dw; i += kW) vstore(dst + j * ld + i, vload(src[j] + i));
    for (; i < d; ++i) dst[j * ld + i] = to_float(src[j][i]);
  }
}

// The K and V rows of one request's head in float32, widened out of the pool once for all the tiles of a task
// (each reads the same keys, from the first on): rows [0, cap) hold keys [base, base + cap), of which keys
// [base, end) are filled. The micro-tiles reread a block's rows many times; in the pool a head's rows are a slot's
// stride apart (8 heads: 4 KB in float32, 2 KB in bf16) and so fall in the same few L1 sets, here they are
// D + kRowPad floats apart. A bf16 row is widened once, not once per micro-tile. (AMX Xeon, extend at 2 threads,
// against reading the rows in place: fp32 1.15-1.18x, bf16 on the avx512 and avx2 paths 1.40-1.46x; widening
// each tile's blocks anew instead gave fp32 1.01-1.05x.)
struct WidenedRows {
  float* k = nullptr;  // [cap][D + kRowPad]
  float* v = nullptr;  // [cap][Dv + kRowPad]
  int64_t cap = 0, base = 0, end = 0;
};
constexpr int64_t kWidenedBytes = int64_t(8) << 20;  // a thread's WidenedRows at most (more keys: the later
                                                      // blocks of a tile widen over the first ones)

// Room for `keys` keys (at least a block; at most kWidenedBytes, or P.widened_keys), in this thread's buffer.
inline WidenedRows widened_rows(const Problem& P, int64_t keys) {
  const int64_t ldk = P.D + kRowPad, ldv = P.Dv + kRowPad;
  const int64_t most = P.widened_keys > 0 ? P.widened_keys : kWidenedBytes / (4 * (ldk + ldv));
  const int64_t cap = std::max(kTileKeys, std::min(keys, most));
  float* k = aligned(t_rows, cap * (ldk + ldv));
  return {k, k + cap * ldk, cap, 0, 0};
}

// kf[j] and vf[j] for j < nk: keys j0 + j's rows in `rows`, widened there first where they are not (kp, vp: the
// same rows in the pool).
template <typename T>
inline void widened_block(const Problem& P, WidenedRows& rows, int64_t j0, int64_t nk, const T* const* kp,
                          const T* const* vp, const float** kf, const float** vf) {
  const int64_t ldk = P.D + kRowPad, ldv = P.Dv + kRowPad;
  if (j0 < rows.base || j0 > rows.end || j0 + nk > rows.base + rows.cap) rows.base = rows.end = j0;  // start over
  if (j0 + nk > rows.end) {
    const int64_t from = rows.end - j0;  // the block's first key not yet widened
    widen_rows(kp + from, nk - from, P.D, rows.k + (rows.end - rows.base) * ldk, ldk);
    widen_rows(vp + from, nk - from, P.Dv, rows.v + (rows.end - rows.base) * ldv, ldv);
    rows.end = j0 + nk;
  }
  for (int64_t j = 0; j < nk; ++j) {
    kf[j] = rows.k + (j0 + j - rows.base) * ldk;
    vf[j] = rows.v + (j0 + j - rows.base) * ldv;
  }
}

// acc[m * Dv + kW v] += sum_j pt[j * ldr + m] . V[j][kW v] for keys [ja, jb): MR rows x NV vectors.
template <int MR, int NV, typename T>
inline void pv_tile(const float* pt, int64_t ldr, const T* const* vp, int64_t d0, int64_t ja, int64_t jb, float* acc,
                    int64_t Dv) {
  vf a[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) a[m][v] = vload(acc + m * Dv + d0 + v * kW);
  for (int64_t j = ja; j < jb; ++j) {
    vf x[NV];
    for (int v = 0; v < NV; ++v) x[v] = vload(vp[j] + d0 + v * kW);
    for (int m = 0; m < MR; ++m) {
      const vf w = vset(pt[j * ldr + m]);
      for (int v = 0; v < NV; ++v) a[m][v] = vfma(w, x[v], a[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) vstore(acc + m * Dv + d0 + v * kW, a[m][v]);
}

// Fold keys [j0, j0 + nk) of S^T (st[j * ldr + r], Rp rows, ldr >= Rp) into the rows' online softmax: the logit cap
// and the custom mask applied, keys outside each row's [flo, fhi) masked, st turned into P^T (zeros where
// masked), m / l updated (l NaN for a row that saw a NaN score), acc's rows rescaled. Returns whether any row
// saw a key.
inline bool fold_block_t(const Problem& P, int64_t b, int64_t i0, int64_t R, int64_t Rp, int64_t ldr, int64_t j0,
                         int64_t nk, float* st, float* m, float* l, float* acc, int64_t Dv, const float* flo,
                         const float* fhi) {
  if (P.cap > 0.f) {
    for (int64_t j = 0; j < nk; ++j) soft_cap(st + j * ldr, R, P.cap);
  }
  if (P.cmask) {
    const int64_t kv = P.kv_lens[b];
    for (int64_t r = 0; r < R; ++r) {
      const bool* mk = P.cmask + P.m_start[b] + (i0 + r / P.G) * kv + j0;
      for (int64_t j = 0; j < nk; ++j) {
        if (!mk[j]) st[j * ldr + r] = kNegInf;
      }
    }
  }
  bool any = false;
  for (int64_t r0 = 0; r0 < Rp; r0 += kW) {
    float gl = flo[r0], gh = fhi[r0];
    for (int64_t i = 1; i < kW; ++i) {
      gl = std::min(gl, flo[r0 + i]);
      gh = std::max(gh, fhi[r0 + i]);
    }
    if (gh <= float(j0) || gl >= float(j0 + nk)) {  // no row of the group sees a key of the block
      for (int64_t j = 0; j < nk; ++j) vstore(st + j * ldr + r0, vzero());
      continue;
    }
    const vf lo = vload(flo + r0), hi = vload(fhi + r0);
    vf mb = vset(kNegInf), nan = vzero();
    for (int64_t j = 0; j < nk; ++j) {
      float* x = st + j * ldr + r0;
      const vf s = vvisible(vset(float(j0 + j)), lo, hi, vload(x));
      vstore(x, s);
      mb = vmax(mb, s);
      nan = vnan_or(nan, s);
    }
    any |= hmax(mb) != kNegInf;
    const vf mo = vload(m + r0);
    const vf mn = vmax(mo, mb);
    const vf base = vzero_where_neginf(mn, mn);  // a row that has seen no key: its scores are all -inf -> 0
    const vf alpha = vexp(vsub(mo, base));
    vf sum = vzero();
    for (int64_t j = 0; j < nk; ++j) {
      float* x = st + j * ldr + r0;
      const vf p = vexp(vsub(vload(x), base));
      vstore(x, p);
      sum = vadd(sum, p);
    }
    vstore(m + r0, mn);
    vstore(l + r0, vadd(vfma(vload(l + r0), alpha, sum), nan));  // nan: 0, or NaN in a row that saw one
    float al[kW];
    vstore(al, alpha);
    for (int64_t i = 0; i < kW; ++i) {
      if (al[i] != 1.f) scale_row(acc + (r0 + i) * Dv, Dv, al[i]);
    }
  }
  return any;
}

// The extend tile (one request, one KV head, query rows [i0, i1)) on the vector path; DOT: bf16 pool, D even,
// Dv % 16 == 0, through avx512_bf16 dot products (float32 queries split in bf16 hi + lo, and then the
// probabilities too, so both products keep nearly float32 accuracy; bf16 queries take one pass).
template <typename T, bool DOT>
void run_tile_vec(const Problem& P, const Task& task, WidenedRows& rows) {
  const int64_t b = task.b, i0 = task.i0, nq = task.i1 - task.i0, G = P.G;
  const int64_t R = nq * G, Rp = (R + kTileRowsPad - 1) / kTileRowsPad * kTileRowsPad, D = P.D, Dv = P.Dv;
  const int64_t BK = kTileKeys, ldr = Rp + kRowPad, D2 = D / 2;
  float* qs = scratch(up16(R * D) + Rp * Dv + (BK + kStKeys) * ldr + 4 * Rp + (DOT ? 0 : D * ldr));
  float* acc = qs + up16(R * D);  // (the parts after it: multiples of Rp or ldr, themselves of 16)
  float* st = acc + Rp * Dv;
  float* m = st + (BK + kStKeys) * ldr;
  float* l = m + Rp;
  float* flo = l + Rp;
  float* fhi = flo + Rp;
  float* qt = fhi + Rp;  // [D][ldr] (float path)
  std::vector<int64_t> lo(nq), hi(nq);
  int64_t LO, HI;
  start_task(P, task, R, lo.data(), hi.data(), LO, HI, qs, acc, m, l, !DOT);
  std::fill(acc + R * Dv, acc + Rp * Dv, 0.f);
  std::fill(m + R, m + Rp, kNegInf);
  std::fill(l + R, l + Rp, 0.f);
  for (int64_t r = 0; r < Rp; ++r) {
    flo[r] = r < R ? float(lo[r / G]) : 0.f;
    fhi[r] = r < R ? float(hi[r / G]) : 0.f;
  }
#ifdef HAL_BF16DOT
  thread_local std::vector<uint32_t> t_pairs;
  uint32_t *qt2 = nullptr, *p2 = nullptr, *vpack = nullptr;
  bool qlo = false;
  const int64_t BK2 = BK / 2;
  if constexpr (DOT) {  // Q^T pairs, hi then lo [D / 2][ldr]; P^T pairs, hi then lo [BK / 2][ldr]; V pairs [BK / 2][Dv]
    qt2 = aligned(t_pairs, 2 * D2 * ldr + 2 * BK2 * ldr + BK2 * Dv);  // parts of whole cache lines (ldr % 16 == 0)
    p2 = qt2 + 2 * D2 * ldr;
    vpack = p2 + 2 * BK2 * ldr;
    thread_local std::vector<uint32_t> t_row;  // one row's halves, hi then lo: D / 2 pairs each
    uint32_t* row = aligned(t_row, 2 * D2);
    for (int64_t r = 0; r < Rp; ++r) {
      qlo |= to_bf16_halves(qs + r * D, r < R ? D : 0, D, reinterpret_cast<uint16_t*>(row),
                            reinterpret_cast<uint16_t*>(row + D2));
      for (int64_t d2 = 0; d2 < D2; ++d2) {
        qt2[d2 * ldr + r] = row[d2];
        qt2[(D2 + d2) * ldr + r] = row[D2 + d2];
      }
    }
  }
#endif
  if constexpr (!DOT) {  // Q^T in 16 x 16 blocks, each read and written within a few cache lines
    for (int64_t r0 = 0; r0 < Rp; r0 += 16)
      for (int64_t d0 = 0; d0 < D; d0 += 16)
        for (int64_t d = d0; d < std::min(D, d0 + 16); ++d)
          for (int64_t r = r0; r < r0 + 16; ++r) qt[d * ldr + r] = r < R ? qs[r * D + d] : 0.f;
  }
  if (int64_t(t_ptrs.size()) < 4 * (BK + kStKeys)) t_ptrs.resize(4 * (BK + kStKeys));
  const T** kp = reinterpret_cast<const T**>(t_ptrs.data());
  const T** vp = kp + BK + kStKeys;
  const float** kf = reinterpret_cast<const float**>(vp + BK + kStKeys);  // float path: the rows widened
  const float** vf = kf + BK + kStKeys;
  const int32_t* r2t_row = P.r2t + P.rows[b] * P.r2t_s0;
  // per group of kTileRowsPad rows (S^T) and of kPvRows rows (P . V): the union of their rows' key ranges
  const int64_t ngroups = Rp / kTileRowsPad, npv = Rp / kPvRows;
  std::vector<float> glo(ngroups), ghi(ngroups), plo_(npv), phi_(npv);
  for (int64_t g = 0; g < ngroups; ++g) {
    glo[g] = *std::min_element(flo + g * kTileRowsPad, flo + (g + 1) * kTileRowsPad);
    ghi[g] = *std::max_element(fhi + g * kTileRowsPad, fhi + (g + 1) * kTileRowsPad);
  }
  for (int64_t g = 0; g < npv; ++g) {
    plo_[g] = *std::min_element(flo + g * kPvRows, flo + (g + 1) * kPvRows);
    phi_[g] = *std::max_element(fhi + g * kPvRows, fhi + (g + 1) * kPvRows);
  }
  for (int64_t j0 = LO; j0 < HI; j0 += BK) {
    const int64_t nk = std::min(BK, HI - j0);
    if (!slot_ptrs<T>(P, r2t_row, j0, nk, task.h, kp, vp)) return;
    for (int64_t j = nk; j < nk + kStKeys; ++j) kp[j] = kp[nk - 1];  // a last partial micro-tile: scores unused
    if constexpr (!DOT) {
      widened_block(P, rows, j0, nk, kp, vp, kf, vf);
      for (int64_t j = nk; j < nk + kStKeys; ++j) kf[j] = kf[nk - 1];
    }
    for (int64_t g = 0; g < ngroups; ++g) {
      const int64_t r0 = g * kTileRowsPad;
      for (int64_t j = 0; j < nk; j += kStKeys) {
        if (float(j0 + j) >= ghi[g] || float(j0 + j + kStKeys) <= glo[g]) continue;  // masked: fold_block_t says so
#ifdef HAL_BF16DOT
        if constexpr (DOT) {
          if (qlo) {
            st_tile_dot<kStKeys, kStVecs, true>(kp + j, qt2 + r0, D2 * ldr, ldr, D2, st + j * ldr + r0, P.scale);
          } else {
            st_tile_dot<kStKeys, kStVecs, false>(kp + j, qt2 + r0, 0, ldr, D2, st + j * ldr + r0, P.scale);
          }
          continue;
        }
#endif
        if constexpr (!DOT) st_tile<kStKeys, kStVecs>(kf + j, qt + r0, ldr, D, st + j * ldr + r0);
      }
    }
    if (!fold_block_t(P, b, i0, R, Rp, ldr, j0, nk, st, m, l, acc, Dv, flo, fhi)) continue;
#ifdef HAL_BF16DOT
    if constexpr (DOT) {
      const int64_t nk2 = (nk + 1) / 2;
      for (int64_t j2 = 0; j2 < nk2; ++j2) {  // P^T -> pairs of keys (2 j2, 2 j2 + 1), hi then lo
        const float* a = st + 2 * j2 * ldr;
        const float* c = 2 * j2 + 1 < nk ? a + ldr : nullptr;
        for (int64_t r = 0; r < Rp; r += 16) {
          const __m512 x = _mm512_loadu_ps(a + r), y = c ? _mm512_loadu_ps(c + r) : _mm512_setzero_ps();
          const __m512i hi2 = bf16_pairs(x, y);
          _mm512_storeu_si512(p2 + j2 * ldr + r, hi2);
          if (qlo) {
            const __m512 xh = _mm512_castsi512_ps(_mm512_slli_epi32(hi2, 16));
            const __m512 yh = _mm512_castsi512_ps(_mm512_and_si512(hi2, _mm512_set1_epi32(int32_t(0xffff0000u))));
            _mm512_storeu_si512(p2 + BK2 * ldr + j2 * ldr + r, bf16_pairs(_mm512_sub_ps(x, xh), _mm512_sub_ps(y, yh)));
          }
        }
        const uint16_t* v0 = reinterpret_cast<const uint16_t*>(vp[2 * j2]);
        const uint16_t* v1 = c ? reinterpret_cast<const uint16_t*>(vp[2 * j2 + 1]) : nullptr;
        for (int64_t d = 0; d < Dv; d += 16) {  // V rows -> pairs (a missing odd key: zeros)
          const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)));
          const __m512i y = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)))
                               : _mm512_setzero_si512();
          _mm512_storeu_si512(vpack + j2 * Dv + d, _mm512_or_si512(x, _mm512_slli_epi32(y, 16)));
        }
      }
      for (int64_t g = 0; g < npv; ++g) {
        const int64_t r0 = g * kPvRows;
        const int64_t ja = std::max<int64_t>(0, int64_t(plo_[g]) - j0) / 2;
        const int64_t jb = (std::min<int64_t>(nk, int64_t(phi_[g]) - j0) + 1) / 2;
        if (ja >= jb) continue;
        for (int pass = 0; pass < (qlo ? 2 : 1); ++pass) {
          const uint32_t* pp = p2 + pass * BK2 * ldr + r0;
          int64_t d0 = 0;
          for (; d0 + 64 <= Dv; d0 += 64) pv_tile_dot<kPvRows, 4>(pp, ldr, vpack + d0, Dv, ja, jb, acc + r0 * Dv + d0);
          for (; d0 < Dv; d0 += 16) pv_tile_dot<kPvRows, 1>(pp, ldr, vpack + d0, Dv, ja, jb, acc + r0 * Dv + d0);
        }
      }
      continue;
    }
#endif
    if constexpr (!DOT) {
      const int64_t DvW = Dv / kW * kW;
      for (int64_t c0 = 0; c0 < nk; c0 += kPvChunk) {
        const int64_t c1 = std::min(nk, c0 + kPvChunk);
        for (int64_t g = 0; g < npv; ++g) {
          const int64_t r0 = g * kPvRows;
          const int64_t ja = std::max<int64_t>(c0, int64_t(plo_[g]) - j0);
          const int64_t jb = std::min<int64_t>(c1, int64_t(phi_[g]) - j0);
          if (ja >= jb) continue;
          const float* pt = st + r0;
          float* a = acc + r0 * Dv;
          int64_t d0 = 0;
          for (; d0 + kPvVecs * kW <= DvW; d0 += kPvVecs * kW) pv_tile<kPvRows, kPvVecs>(pt, ldr, vf, d0, ja, jb, a, Dv);
          for (; d0 < DvW; d0 += kW) pv_tile<kPvRows, 1>(pt, ldr, vf, d0, ja, jb, a, Dv);
          for (int64_t d = DvW; d < Dv; ++d)
            for (int64_t mm = 0; mm < kPvRows; ++mm) {
              float x = a[mm * Dv + d];
              for (int64_t j = ja; j < jb; ++j) x += pt[j * ldr + mm] * vf[j][d];
              a[mm * Dv + d] = x;
            }
        }
      }
    }
  }
  write_rows(P, b, task.h, i0, R, acc, m, l);
}
#endif

// Whether run_tile takes the AMX path (bf16 pools).
inline bool amx_tiles(const Problem& P, bool bf16) {
#ifdef HAL_AMX
  return bf16 && P.D % 32 == 0 && P.Dv % 16 == 0 && amx_ready();
#else
  return false;
#endif
}

// One extend tile without vector kernels: scores and values through at::mm over blocks of kGemmBlock keys,
// widened to float32.
template <typename T>
void run_tile_mm(const Problem& P, const Task& task) {
  const int64_t b = task.b, h = task.h, i0 = task.i0, nq = task.i1 - task.i0;
  const int64_t R = nq * P.G, D = P.D, Dv = P.Dv, BK = kGemmBlock;
  float* base = scratch(R * D + R * Dv + R * BK + BK * D + BK * Dv + 2 * R);
  float* qs = base;
  float* acc = qs + R * D;
  float* s = acc + R * Dv;
  float* ks = s + R * BK;
  float* vs = ks + BK * D;
  float* m = vs + BK * Dv;
  float* l = m + R;
  std::vector<int64_t> lo(nq), hi(nq);
  int64_t LO, HI;
  start_task(P, task, R, lo.data(), hi.data(), LO, HI, qs, acc, m, l);
  auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor q_t = at::from_blob(qs, {R, D}, opts);
  at::Tensor acc_t = at::from_blob(acc, {R, Dv}, opts);
  if (int64_t(t_ptrs.size()) < 2 * BK) t_ptrs.resize(2 * BK);
  const T** kp = reinterpret_cast<const T**>(t_ptrs.data());
  const T** vp = kp + BK;
  const int32_t* r2t_row = P.r2t + P.rows[b] * P.r2t_s0;
  for (int64_t j0 = LO; j0 < HI; j0 += BK) {
    const int64_t nk = std::min(BK, HI - j0);
    if (!slot_ptrs<T>(P, r2t_row, j0, nk, h, kp, vp)) return;
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t d = 0; d < D; ++d) ks[j * D + d] = to_float(kp[j][d]);
    at::Tensor s_t = at::from_blob(s, {R, nk}, opts);
    at::mm_out(s_t, q_t, at::from_blob(ks, {nk, D}, opts).t());
    if (!fold_block(P, b, i0, R, j0, nk, s, nk, m, l, acc, Dv, lo.data(), hi.data())) continue;
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t d = 0; d < Dv; ++d) vs[j * Dv + d] = to_float(vp[j][d]);
    acc_t.addmm_(s_t, at::from_blob(vs, {nk, Dv}, opts));
  }
  write_rows(P, b, h, i0, R, acc, m, l);
}


// A row task: AMX tiles read straight from the pool where it holds AMX-packed bf16 pages and the task's keys lie as
// whole pages do (pages_whole), else run_rows.
template <typename T>
void run_row(const Problem& P, const Task& task) {
#ifdef HAL_AMX
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (P.packed && amx_tiles(P, true)) {
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t i = task.i0; i < task.i1; ++i) {
        int64_t a, z;
        key_range(P, task.b, i, a, z);
        lo = std::min(lo, a);
        hi = std::max(hi, z);
      }
      if (pages_whole(P, P.r2t + P.rows[task.b] * P.r2t_s0, lo, hi)) return run_rows_amx(P, task);
    }
  }
#endif
  run_rows<T>(P, task);
}

// A tile task: AMX where it serves, else its tiles (task.sub query rows each) one after another, which read the
// same keys (the float vector path widens them once for all: WidenedRows).
template <typename T>
void run_tile(const Problem& P, const Task& task) {
#ifdef HAL_AMX
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (amx_tiles(P, true)) return run_tile_amx(P, task);
  }
#endif
  bool dot = false;
#ifdef HAL_BF16DOT
  dot = std::is_same_v<T, at::BFloat16> && P.D % 2 == 0 && P.Dv % 16 == 0;
#endif
#ifdef HAL_VEC
  WidenedRows rows = dot ? WidenedRows{} : widened_rows(P, P.kv_lens[task.b]);
#endif
  const int64_t step = task.sub > 0 ? task.sub : task.i1 - task.i0;
  for (int64_t i0 = task.i0; i0 < task.i1 && !P.bad->load(); i0 += step) {
    const Task tile{task.b, task.h, i0, std::min(task.i1, i0 + step), 1, 0., true, 0};
#ifdef HAL_VEC
    if (dot) {
#ifdef HAL_BF16DOT
      if constexpr (std::is_same_v<T, at::BFloat16>) run_tile_vec<T, true>(P, tile, rows);
#endif
    } else {
      run_tile_vec<T, false>(P, tile, rows);
    }
#else
    (void)dot;
    run_tile_mm<T>(P, tile);
#endif
  }
}

// The pool's buffers: [S, Hkv, D] keys and [S, Hkv, Dv] values (pages of one slot), or [N, Hkv, page, D] and
// [N, Hkv, page, Dv] pages of any strides (a token-major pool's view, or head-major pages); last dims contiguous.
// `packed`: AMX-packed pages, [N, Hkv, page, D | Dv] with each (page, head) slab dense, page and dims multiples of
// 32. false: buffers that do not pair so.
bool bind_buffers(Problem& P, const at::Tensor& k_buffer, const at::Tensor& v_buffer, bool packed = false) {
  const int64_t dims = k_buffer.dim();
  if ((dims != 3 && dims != 4) || v_buffer.dim() != dims || k_buffer.size(0) != v_buffer.size(0) ||
      k_buffer.size(1) != v_buffer.size(1) || (dims == 4 && k_buffer.size(2) != v_buffer.size(2)) ||
      k_buffer.stride(dims - 1) != 1 || v_buffer.stride(dims - 1) != 1)
    return false;
  if (packed && (dims != 4 || k_buffer.size(2) % kPackedPage || k_buffer.size(3) % kPackedPage ||
                 v_buffer.size(3) % kPackedPage || k_buffer.stride(2) != k_buffer.size(3) ||
                 v_buffer.stride(2) != v_buffer.size(3)))
    return false;
  P.packed = packed;
  P.k = k_buffer.data_ptr();
  P.v = v_buffer.data_ptr();
  P.num_pages = k_buffer.size(0);
  P.Hkv = k_buffer.size(1);
  P.page = dims == 4 ? k_buffer.size(2) : 1;
  P.k_ps = k_buffer.stride(0);
  P.k_hs = k_buffer.stride(1);
  P.k_ts = dims == 4 ? k_buffer.stride(2) : k_buffer.stride(0);
  P.v_ps = v_buffer.stride(0);
  P.v_hs = v_buffer.stride(1);
  P.v_ts = dims == 4 ? v_buffer.stride(2) : v_buffer.stride(0);
  P.page_shift = -1;
  for (int shift = 0; shift < 31; ++shift)
    if (int64_t(1) << shift == P.page) P.page_shift = shift;
  P.Dv = v_buffer.size(dims - 1);
  return P.page >= 1;
}

// The name of the table's entries and how many there are (for messages).
std::string table_entries(const Problem& P) {
  return P.by_page ? "a page in [0, " + std::to_string(P.num_pages) + ")"
                   : "a slot in [0, " + std::to_string(P.num_pages * P.page) + ")";
}

// The step's per-request tensors (int64 [B], CPU, contiguous), request table and custom mask, bound into P;
// everything a task reads through is checked (errors start "hal: ") before any task runs. Returns B.
int64_t bind_step(Problem& P, const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& kv_lens,
                  const at::Tensor& q_lens, const at::Tensor& q_start, const at::Tensor& custom_mask,
                  const at::Tensor& mask_start, int64_t T) {
  P.r2t = req_to_token.data_ptr<int32_t>();
  P.r2t_s0 = req_to_token.stride(0);
  P.r2t_cols = req_to_token.size(1);
  P.rows = rows.data_ptr<int64_t>();
  P.kv_lens = kv_lens.data_ptr<int64_t>();
  P.q_lens = q_lens.data_ptr<int64_t>();
  P.q_start = q_start.data_ptr<int64_t>();
  P.cmask = custom_mask.numel() ? custom_mask.data_ptr<bool>() : nullptr;
  P.m_start = P.cmask ? mask_start.data_ptr<int64_t>() : nullptr;
  const int64_t B = rows.numel();
  TORCH_CHECK(kv_lens.numel() == B && q_lens.numel() == B && q_start.numel() == B,
              "hal: req_pool_indices, seq_lens and extend_lens must have one entry per request");
  TORCH_CHECK(P.Hkv > 0 && P.Hq % P.Hkv == 0, "hal: q heads must be a multiple of KV heads");
  TORCH_CHECK(!P.cmask || mask_start.numel() == B, "hal: mask_start must have one entry per request");
  const int64_t R2T_rows = req_to_token.size(0), keys_per_entry = P.by_page ? P.page : 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(P.rows[b] >= 0 && P.rows[b] < R2T_rows, "hal: req_pool_indices[", b, "] = ", P.rows[b],
                ": expected a row of ", P.by_page ? "req_to_page" : "req_to_token", " in [0, ", R2T_rows, ")");
    TORCH_CHECK(P.q_lens[b] >= 0 && P.q_lens[b] <= P.kv_lens[b] && P.kv_lens[b] <= P.r2t_cols * keys_per_entry,
                "hal: request ", b, " has ", P.q_lens[b], " query tokens over ", P.kv_lens[b],
                " keys: expected 0 <= query tokens <= keys <= ", P.r2t_cols * keys_per_entry,
                P.by_page ? " (req_to_page columns x page size)" : " (req_to_token columns)");
    TORCH_CHECK(P.q_start[b] >= 0 && P.q_start[b] + P.q_lens[b] <= T, "hal: request ", b,
                "'s query tokens run past the ", T, " rows of q");
    if (P.cmask) {
      TORCH_CHECK(P.m_start[b] >= 0 && P.m_start[b] + P.q_lens[b] * P.kv_lens[b] <= custom_mask.numel(),
                  "hal: custom_mask has ", custom_mask.numel(), " entries: too few for request ", b);
    }
  }
  return B;
}

// Runs every task of the B requests bound into P (bind_buffers, bind_step, q, out and the layer's fields set);
// a slot outside the pool found midway stops the run and is raised after it.
void run_tasks(Problem& P, int64_t B, int64_t tile_rows, bool bf16) {
  std::atomic<int64_t> bad_slot(0);
  std::atomic<bool> bad(false);
  P.bad_slot = &bad_slot;
  P.bad = &bad;
  std::vector<Task> tasks;
  // Row tasks take every KV head of a request when there are requests enough to keep the threads
  // busy (HAL_HEADS_PER_TASK overrides: 1 = one task per (request, KV head)).
  int64_t row_requests = 0;
  for (int64_t b = 0; b < B; ++b) row_requests += P.q_lens[b] > 0 && !(tile_rows > 0 && P.q_lens[b] * P.G >= tile_rows);
  int64_t heads_per_task = row_requests >= 4 * at::get_num_threads() ? P.Hkv : 1;
  if (const char* env = std::getenv("HAL_HEADS_PER_TASK")) heads_per_task = std::max<int64_t>(1, std::atoll(env));
  // (tests: a small WidenedRows, so a tile's later blocks widen over its first ones)
  if (const char* env = std::getenv("HAL_WIDENED_KEYS")) P.widened_keys = std::max<int64_t>(0, std::atoll(env));
  // A task takes several tiles of a request's rows where there are tiles enough to leave each thread 4 tasks:
  // AMX packs K and V once for all of them, the float vector path widens them once (WidenedRows), and the bf16
  // dot path finds the rows the first tile read still in L2.
  const int64_t tile_step = std::max<int64_t>(1, tile_rows / std::max<int64_t>(P.G, 1));
  int64_t tiles_per_task = 1;
  if (tile_rows > 0) {
    int64_t tiles = 0;
    for (int64_t b = 0; b < B; ++b)
      if (P.q_lens[b] * P.G >= tile_rows) tiles += (P.q_lens[b] + tile_step - 1) / tile_step * P.Hkv;
    tiles_per_task = std::max<int64_t>(1, tiles / (4 * at::get_num_threads()));
  }
  tasks.reserve(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = P.q_lens[b], kv = P.kv_lens[b];
    if (nq <= 0) continue;
    const bool tile = tile_rows > 0 && nq * P.G >= tile_rows;
    const int64_t step = tile ? tile_step * tiles_per_task : nq;
    const int64_t hstep = tile ? 1 : std::min(heads_per_task, P.Hkv);
    for (int64_t h = 0; h < P.Hkv; h += hstep) {
      const int64_t nh = std::min(hstep, P.Hkv - h);
      for (int64_t i0 = 0; i0 < nq; i0 += step) {
        const int64_t i1 = std::min(nq, i0 + step);
        int64_t keys = kv;  // upper bound on keys the tile reads
        if (P.causal && !P.cmask) keys = kv - nq + i1;
        if (P.window >= 0) keys = std::min<int64_t>(keys, P.window + (i1 - i0));
        tasks.push_back({b, h, i0, i1, nh, double(keys) * double(nh) * double(i1 - i0 + (tile ? 0 : 8)), tile,
                         tile ? tile_step : 0});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& c) { return a.cost > c.cost; });
  std::atomic<int64_t> next(0);
  const int64_t n = int64_t(tasks.size());
  auto worker = [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) {
      if (bad.load()) return;
      const Task& task = tasks[t];
      if (bf16) {
        task.tile ? run_tile<at::BFloat16>(P, task) : run_row<at::BFloat16>(P, task);
      } else {
        task.tile ? run_tile<float>(P, task) : run_row<float>(P, task);
      }
    }
  };
  double total = 0;
  for (const Task& task : tasks) total += task.cost;
  // A step this small (microseconds of work) costs more to hand to a second thread than to run.
  const int64_t threads = total < 16384 ? 1 : std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n, 1));
  if (threads <= 1) {
    worker(0, 1);
  } else {
    at::parallel_for(0, threads, 1, worker);
  }
  TORCH_CHECK(!bad.load(), "hal: ", P.by_page ? "req_to_page holds page " : "req_to_token holds slot ",
              bad_slot.load(), ": expected ", table_entries(P));
}

// The layer's sink logits (P.Hq float32, contiguous, on the CPU), or none (an empty tensor); false: not these.
bool bind_sinks(Problem& P, const at::Tensor& sinks) {
  P.sinks = nullptr;
  if (sinks.numel() == 0) return true;
  if (sinks.scalar_type() != at::kFloat || !sinks.is_contiguous() || !sinks.device().is_cpu() ||
      sinks.numel() != P.Hq)
    return false;
  P.sinks = sinks.data_ptr<float>();
  return true;
}

void set_layer(Problem& P, int64_t Hq, int64_t D, double scale, double logit_cap, int64_t window, bool causal) {
  P.Hq = Hq;
  P.G = P.Hkv > 0 ? Hq / P.Hkv : 0;
  P.D = D;
  P.scale = float(scale);
  P.cap = float(logit_cap);
  P.window = window;
  P.causal = causal;
}

// Whether t is [T, H * D] or [T, H, D] of dtype dt on the CPU, unit-strided along D; sets its token and head strides.
bool token_rows(const at::Tensor& t, at::ScalarType dt, int64_t T, int64_t H, int64_t D, int64_t& s0, int64_t& s1) {
  if (!t.defined() || t.scalar_type() != dt || !t.device().is_cpu() || t.dim() < 2 || t.size(0) != T) return false;
  if (t.dim() == 2 && t.size(1) == H * D && t.stride(1) == 1) {
    s0 = t.stride(0);
    s1 = D;
    return true;
  }
  if (t.dim() == 3 && t.size(1) == H && t.size(2) == D && t.stride(2) == 1) {
    s0 = t.stride(0);
    s1 = t.stride(1);
    return true;
  }
  return false;
}

// One token's K and V rows (knew: D values, vnew: Dv, of E's size) stored at their places in a packed pool (krow,
// vrow: where the token's rows lie, row_at).
template <typename E>
void scatter_packed(const Problem& P, char* krow, char* vrow, const char* knew, const char* vnew) {
  E* k = reinterpret_cast<E*>(krow);
  E* v = reinterpret_cast<E*>(vrow);
  const E* kn = reinterpret_cast<const E*>(knew);
  const E* vn = reinterpret_cast<const E*>(vnew);
  for (int64_t d = 0; d < P.D; ++d) k[packed_k_dim(d)] = kn[d];
  for (int64_t d = 0; d < P.Dv; ++d) v[packed_v_dim(d, P.page)] = vn[d];
}

bool index_vector(const at::Tensor& t) {
  return t.defined() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() && t.device().is_cpu();
}

}  // namespace

// q: float32 [T, Hq, D] (last dim contiguous); k/v_buffer: float32 or bf16, [S, Hkv, D|Dv] slots or
// [N, Hkv, page, D|Dv] pages of any strides (bind_buffers); req_to_token: int32 [R, C], each request's slots, or
// with by_page its pages (req_to_page [R, max pages]); rows, kv_lens, q_lens, q_start, mask_start: int64 [B] (CPU);
// custom_mask: bool flat or empty; out: float32 [T, Hq, Dv], written. Errors (messages start "hal: ") are raised
// before any read out of bounds; a slot or page outside the pool found midway stops the run and is raised after it.
void paged_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                     const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& kv_lens,
                     const at::Tensor& q_lens, const at::Tensor& q_start, const at::Tensor& custom_mask,
                     const at::Tensor& mask_start, const at::Tensor& sinks, const at::Tensor& out, double scale,
                     double logit_cap, int64_t window, bool causal, int64_t tile_rows, bool by_page,
                     bool amx_packed) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "q and out must be float32");
  TORCH_CHECK(k_buffer.scalar_type() == v_buffer.scalar_type(), "k and v buffers differ in dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "last dims must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token: int32 rows");
  const bool bf16 = k_buffer.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k_buffer.scalar_type() == at::kFloat, "KV buffers must be float32 or bfloat16");
  Problem P;
  TORCH_CHECK(bind_buffers(P, k_buffer, v_buffer, amx_packed) && k_buffer.size(k_buffer.dim() - 1) == q.size(2) &&
                  out.size(2) == P.Dv,
              "hal: k/v buffers ", k_buffer.sizes(), " / ", v_buffer.sizes(), ": expected ",
              amx_packed ? "AMX-packed [pages, kv heads, page, dim] (page and dims multiples of 32, each (page, head) "
                           "slab dense)"
                         : "[slots, kv heads, dim] or [pages, kv heads, page, dim]",
              " of the queries' dim, last dims contiguous");
  P.by_page = by_page;
  set_layer(P, q.size(1), q.size(2), scale, logit_cap, window, causal);
  TORCH_CHECK(bind_sinks(P, sinks), "hal: sinks must be float32, contiguous, one per q head (", P.Hq, ")");
  P.q = q.data_ptr<float>();
  P.q_s0 = q.stride(0);
  P.q_s1 = q.stride(1);
  P.out = out.data_ptr<float>();
  P.o_s0 = out.stride(0);
  P.o_s1 = out.stride(1);
  const int64_t B = bind_step(P, req_to_token, rows, kv_lens, q_lens, q_start, custom_mask, mask_start, q.size(0));
  run_tasks(P, B, tile_rows, bf16);
}

// One layer's forward in one call, prologue included: checks q/k/v ([T, H * D] or [T, H, D], the pool's dtype,
// float32 or bf16) against the layer's heads and dims and the pool, writes the new tokens' k/v at out_cache_loc
// (int32/int64 [T]), attends as paged_attention, and returns [T, q_heads * v_head_dim] in the pool's dtype; or,
// given `out` ([T, q_heads, v_head_dim] or [T, q_heads * v_head_dim] in the pool's dtype, last dim contiguous, any
// row and head strides: a view of an engine's buffer), writes each row there and returns out, allocating nothing.
// Inputs this path does not take (another layout, dtype or device, a shape that does not match, an MLA pool
// whose value buffer views the key buffer) return an undefined tensor (None) with nothing written: the caller's
// checked path serves them or names what is wrong. Bad indices raise ("hal: ...") before anything is written.
at::Tensor write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& loc,
                            const at::Tensor& k_buffer, const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& rows, const at::Tensor& kv_lens, const at::Tensor& q_lens,
                            const at::Tensor& q_start, const at::Tensor& custom_mask, const at::Tensor& mask_start,
                            const at::Tensor& sinks, int64_t q_heads, int64_t kv_heads, int64_t v_heads, int64_t head_dim, int64_t v_head_dim,
                            double scale, double logit_cap, int64_t window, bool causal, int64_t tile_rows,
                            bool by_page, bool amx_packed, const std::optional<at::Tensor>& out) {
  const at::ScalarType dt = k_buffer.scalar_type();
  const bool bf16 = dt == at::kBFloat16;
  if (!(bf16 || dt == at::kFloat) || v_buffer.scalar_type() != dt || !k_buffer.device().is_cpu() ||
      !v_buffer.device().is_cpu())
    return {};
  Problem P;
  if (!bind_buffers(P, k_buffer, v_buffer, amx_packed)) return {};
  const int64_t last = k_buffer.dim() - 1;
  if (P.Hkv != kv_heads || k_buffer.size(last) != head_dim || P.Dv != v_head_dim || v_heads != kv_heads ||
      kv_heads <= 0 || q_heads % kv_heads || k_buffer.data_ptr() == v_buffer.data_ptr())
    return {};
  if (loc.dim() != 1 || !loc.device().is_cpu() || !(loc.scalar_type() == at::kLong || loc.scalar_type() == at::kInt))
    return {};
  const int64_t T = loc.size(0);
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;
  if (!token_rows(q, dt, T, q_heads, head_dim, qs0, qs1) || !token_rows(k, dt, T, kv_heads, head_dim, ks0, ks1) ||
      !token_rows(v, dt, T, kv_heads, v_head_dim, vs0, vs1))
    return {};
  int64_t os0 = q_heads * v_head_dim, os1 = v_head_dim;
  TORCH_CHECK(!out || token_rows(*out, dt, T, q_heads, v_head_dim, os0, os1), "hal: out ",
              out ? out->sizes() : at::IntArrayRef{}, ": expected [", T, ", ", q_heads, ", ", v_head_dim,
              "] of the pool's dtype on the CPU, its last dim contiguous");
  if (req_to_token.scalar_type() != at::kInt || req_to_token.dim() != 2 || req_to_token.stride(1) != 1 ||
      !index_vector(rows) || !index_vector(kv_lens) || !index_vector(q_lens) || !index_vector(q_start) ||
      !(custom_mask.numel() == 0 || (custom_mask.scalar_type() == at::kBool && custom_mask.is_contiguous())) ||
      !(custom_mask.numel() == 0 || index_vector(mask_start)))
    return {};
  P.by_page = by_page;
  set_layer(P, q_heads, head_dim, scale, logit_cap, window, causal);
  if (!bind_sinks(P, sinks)) return {};
  const int64_t B = bind_step(P, req_to_token, rows, kv_lens, q_lens, q_start, custom_mask, mask_start, T);
  // each new token's row offsets (head 0) in K and V; -1: a padding token, whose KV is written nowhere
  std::vector<int64_t> k_at(T), v_at(T);
  const int64_t loc_s = loc.stride(0), slots = P.num_pages * P.page;
  const bool loc64 = loc.scalar_type() == at::kLong;
  const int64_t* loc_l = loc64 ? loc.data_ptr<int64_t>() : nullptr;
  const int32_t* loc_i = loc64 ? nullptr : loc.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = loc64 ? loc_l[t * loc_s] : int64_t(loc_i[t * loc_s]);
    TORCH_CHECK(s >= -1 && s < slots, "hal: out_cache_loc[", t, "] = ", s, ": expected a slot in [0, ", slots,
                ") or -1 (a padding token: nothing written)");
    const int64_t pg = s / P.page, o = s - pg * P.page;
    row_at(P, pg, o, k_at[t], v_at[t]);
    if (s < 0) k_at[t] = v_at[t] = -1;
  }
  const int64_t elt = bf16 ? 2 : 4;
  char* K = static_cast<char*>(k_buffer.data_ptr());
  char* V = static_cast<char*>(v_buffer.data_ptr());
  const char* kin = static_cast<const char*>(k.data_ptr());
  const char* vin = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (k_at[t] < 0) continue;
      for (int64_t h = 0; h < kv_heads; ++h) {
        char* krow = K + (k_at[t] + h * P.k_hs) * elt;
        char* vrow = V + (v_at[t] + h * P.v_hs) * elt;
        const char* knew = kin + (t * ks0 + h * ks1) * elt;
        const char* vnew = vin + (t * vs0 + h * vs1) * elt;
        if (!P.packed) {
          std::memcpy(krow, knew, head_dim * elt);
          std::memcpy(vrow, vnew, v_head_dim * elt);
        } else if (bf16) {
          scatter_packed<uint16_t>(P, krow, vrow, knew, vnew);
        } else {
          scatter_packed<uint32_t>(P, krow, vrow, knew, vnew);
        }
      }
    }
  });
  P.q_s0 = qs0;
  P.q_s1 = qs1;
  const at::Tensor result = out ? *out : at::empty({T, q_heads * v_head_dim}, at::TensorOptions().dtype(dt));
  P.o_s0 = os0;
  P.o_s1 = os1;
  if (bf16) {
    P.q_bf16 = q.data_ptr<at::BFloat16>();
    P.out_bf16 = result.data_ptr<at::BFloat16>();
  } else {
    P.q = q.data_ptr<float>();
    P.out = result.data_ptr<float>();
  }
  run_tasks(P, B, tile_rows, bf16);
  return result;
}

// This path's arithmetic ceiling, GFLOP/s over all torch threads: `kind` "fma" (float32 multiply-adds at the
// path's vector width: 16 lanes under AVX-512, 8 under AVX2, whatever the compiler makes of plain loops) or
// "bf16_dot" (_mm512_dpbf16_ps, 64 flops each) or "amx_bf16" (tdpbf16ps, 16 x 16 x 32 x 2 flops each; -1 where
// the path has none, or the OS does not grant the tile state). Each thread runs `iters` rounds
// of 16 independent chains (4 tiles for AMX; enough to cover the latency of two pipes), from registers: no
// memory traffic.
double peak_gflops(const std::string& kind, int64_t iters) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::atomic<double> flops(0);
  auto one = [&](int64_t, int64_t) {
    double done = 0;
    float sink = 0;
    if (kind == "fma") {
#ifdef HAL_VEC
      vf acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = vset(1.f + 1e-3f * i);
      const vf a = vset(0.999999f), c = vset(1e-7f);
      for (int64_t it = 0; it < iters; ++it)
        for (int i = 0; i < 16; ++i) acc[i] = vfma(acc[i], a, c);
      for (int i = 0; i < 16; ++i) sink += hsum(acc[i]);
      done = 2.0 * kW * 16 * iters;
#else
      float acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = 1.f + 1e-3f * i;
      for (int64_t it = 0; it < iters; ++it)
        for (int i = 0; i < 16; ++i) acc[i] = acc[i] * 0.999999f + 1e-7f;
      for (int i = 0; i < 16; ++i) sink += acc[i];
      done = 2.0 * 16 * iters;
#endif
    }
#ifdef HAL_BF16DOT
    if (kind == "bf16_dot") {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(1e-3f * i);
      const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
      for (int64_t it = 0; it < iters; ++it)
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, a);
      for (int i = 0; i < 16; ++i) sink += _mm512_reduce_add_ps(acc[i]);
      done = 64.0 * 16 * iters;
    }
#endif
#ifdef HAL_AMX
    if (kind == "amx_bf16" && amx_ready()) {  // 4 independent C tiles, A and B from tile registers
      alignas(64) static const uint16_t ones[16 * 32] = {};
      alignas(64) float c[16 * 16];
      amx_begin();
      HAL_TILE_LOAD(4, ones, 64);
      HAL_TILE_LOAD(6, ones, 64);
      HAL_TILE_LOAD(7, ones, 64);
      HAL_TILE_ZERO(0);
      HAL_TILE_ZERO(1);
      HAL_TILE_ZERO(2);
      HAL_TILE_ZERO(3);
      for (int64_t it = 0; it < iters; ++it) {
        HAL_TILE_DP(0, 4, 6);
        HAL_TILE_DP(1, 4, 7);
        HAL_TILE_DP(2, 4, 6);
        HAL_TILE_DP(3, 4, 7);
      }
      HAL_TILE_STORE(0, c, 64);
      amx_end();
      sink += c[0];
      done = 4.0 * 16 * 16 * 32 * 2 * iters;
    }
#endif
    volatile float keep = sink;  // the chains' result is used: the loops stay
    (void)keep;
    double seen = flops.load();
    while (!flops.compare_exchange_weak(seen, seen + done)) {
    }
  };
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, one);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return flops.load() > 0 ? flops.load() / seconds / 1e9 : -1.0;
}

std::string build_info() {
  std::string s = HAL_STR(HAL_ISA);
#ifdef HAL_VEC
  s += HAL_VEC == 16 ? ": 16-lane avx512 fma" : ": 8-lane avx2 fma";
#else
  s += ": plain loops";
#endif
#if defined(HAL_BF16DOT) && defined(HAL_AMX)
  s += ", bf16 widened to fp32 on the row path, dotted by avx512_bf16 in vector extend tiles";
#elif defined(HAL_BF16DOT)
  s += ", bf16 keys dotted by avx512_bf16";
#else
  s += ", bf16 widened to fp32";
#endif
#if defined(HAL_AMX_EMULATE)
  s += ", bf16 extend tiles (and AMX-packed decode) through emulated AMX tiles (a test build)";
#elif defined(HAL_AMX)
  s += ", bf16 extend tiles and AMX-packed decode through AMX";
#endif
  return s;
}

// The entry points are dispatcher ops (torch.ops.hal.<name>_<isa>), so any torch mode (hal's eager graph
// guard, a profiler) sees every tensor they read and write. One name per ISA: builds for several ISAs
// can live in one process (a forced lower path beside the native one).
#define HAL_OP(name) HAL_STR(name) "_" HAL_STR(HAL_ISA)
TORCH_LIBRARY_FRAGMENT(hal, m) {
  m.def(HAL_OP(paged_attention)
        "(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor rows, Tensor kv_lens, "
        "Tensor q_lens, Tensor q_start, Tensor custom_mask, Tensor mask_start, Tensor sinks, Tensor(a!) out, "
        "float scale, float logit_cap, int window, bool causal, int tile_rows, bool by_page=False, "
        "bool amx_packed=False) -> ()");
  m.def(HAL_OP(build_info) "() -> str", &build_info);
}
TORCH_LIBRARY_IMPL(hal, CPU, m) { m.impl(HAL_OP(paged_attention), &paged_attention); }

// The same entry point without the dispatcher, for calls no torch mode watches (hal.kernels.cpu decides):
// a dispatcher call parses its 16 arguments against the schema, about 15 us on a 2-core Zen 2. write_and_attend
// (a whole forward, KV write included) exists only here: where a mode watches, hal runs the checked prologue
// and the op above instead.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, py::arg("q"), py::arg("k_buffer"), py::arg("v_buffer"),
        py::arg("req_to_token"), py::arg("rows"), py::arg("kv_lens"), py::arg("q_lens"), py::arg("q_start"),
        py::arg("custom_mask"), py::arg("mask_start"), py::arg("sinks"), py::arg("out"), py::arg("scale"),
        py::arg("logit_cap"), py::arg("window"), py::arg("causal"), py::arg("tile_rows"), py::arg("by_page") = false,
        py::arg("amx_packed") = false);
  m.def("write_and_attend", &write_and_attend, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("loc"),
        py::arg("k_buffer"), py::arg("v_buffer"), py::arg("req_to_token"), py::arg("rows"), py::arg("kv_lens"),
        py::arg("q_lens"), py::arg("q_start"), py::arg("custom_mask"), py::arg("mask_start"), py::arg("sinks"),
        py::arg("q_heads"), py::arg("kv_heads"), py::arg("v_heads"), py::arg("head_dim"), py::arg("v_head_dim"),
        py::arg("scale"), py::arg("logit_cap"), py::arg("window"), py::arg("causal"), py::arg("tile_rows"),
        py::arg("by_page"), py::arg("amx_packed"), py::arg("out") = py::none());
  m.def("peak_gflops", &peak_gflops);
}

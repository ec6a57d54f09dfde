// qkv::ggml_mm and qkv::ggml_rows: matrices in GGUF's block formats, multiplied as llama.cpp multiplies them.
//
// A decode step reads every weight once, so it runs at the speed its weights are read and multiplied. llama.cpp
// keeps a matrix in the file's blocks and rounds the other operand, the activations, to 8-bit blocks too (q8_0,
// q8_1 or q8_K, by the weights' format), so that each block's product is a sum of int8 × int8 pairs, 32 of them in
// one or two instructions, times the two blocks' scales. This file does the same, from the same layouts
// (ggml-common.h), with the activations rounded exactly as ggml rounds them: the outputs equal
// dequantise(W) · dequantise(round(x)) up to the order of float sums, but for Q4_1, whose minimums multiply q8_1's
// float16 sum of each block (tests/test_quantization_blocks.py).
//
// Each output row is one sum in a fixed order, whatever the batch, the thread count or the row's neighbours, so
// a sequence's logits do not depend on the batch it is decoded in.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The products need AVX2 (with FMA and F16C): elsewhere the build stops here, and qkv falls back to PyTorch's int4
// kernel (qkv.quantization.native) rather than run a slow scalar loop.
#if !(defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#error "qkv's GGUF kernels need a CPU with AVX2, FMA and F16C"
#endif
#include <immintrin.h>

namespace {

// ggml's type ids, as the GGUF file names them
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14;

struct Format {
  int64_t weights, bytes;  // per block
};

Format format_of(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "ggml_mm: unknown block type ", type);
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float round_to_half(float x) {  // to float16 and back, ties to even
  return _cvtsh_ss(_cvtss_sh(x, 0));
}

// One activation row rounded to 8-bit blocks. q8_0: per 32, d = max|x| / 127 stored as float16, q = round(x · 127 /
// max|x|) (the unrounded inverse, as ggml). q8_1 adds s = d · Σq as float16. q8_K: per 256, d = max / −127 in
// float32 with the max of signed largest magnitude, and sums of 16 codes.
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> bsums;
};

// A code from x · inverse: round half to even (as _mm256_round_ps), clamped first so that no value (an overflowing
// inverse, a NaN) reaches the integer conversion undefined.
inline int code(float v) { return static_cast<int>(std::nearbyint(std::fmin(127.f, std::fmax(-127.f, v)))); }

// A block with a NaN or an infinity gets a NaN scale: its products are NaN, as the float product's would be.
inline bool finite(const float* x, int n) {
  for (int j = 0; j < n; ++j) {
    if (!std::isfinite(x[j])) return false;
  }
  return true;
}

void quantize_q8(const float* x, int64_t K, bool with_sums, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f, inverse = amax != 0.f ? 127.f / amax : 0.f;
    int32_t total = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = code(xb[j] * inverse);
      q[32 * b + j] = static_cast<int8_t>(v);
      total += v;
    }
    const bool ok = finite(xb, 32);
    d[b] = ok ? round_to_half(scale) : NAN;
    if (with_sums) s[b] = ok ? round_to_half(scale * static_cast<float>(total)) : NAN;
  }
}

void quantize_q8_k(const float* x, int64_t K, int8_t* q, float* d, int32_t* bsums) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* xb = x + 256 * b;
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < 256; ++j) {
      if (std::fabs(xb[j]) > amax) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
    int8_t* qb = q + 256 * b;
    const bool ok = finite(xb, 256);
    if (amax == 0.f || !ok) {
      d[b] = ok ? 0.f : NAN;
      std::memset(qb, 0, 256);
      for (int j = 0; j < 16; ++j) bsums[16 * b + j] = 0;
      continue;
    }
    const float inverse = -127.f / max;
    for (int j = 0; j < 256; ++j) qb[j] = static_cast<int8_t>(code(inverse * xb[j]));
    for (int j = 0; j < 16; ++j) {
      int32_t total = 0;
      for (int i = 0; i < 16; ++i) total += qb[16 * j + i];
      bsums[16 * b + j] = total;
    }
    d[b] = 1.f / inverse;
  }
}

// Q4_K's 12 bytes → 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4).
inline void scales_k4(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    m[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 0xF) | ((q[j] >> 6) << 4);
    m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

// The 32 weights of block part `part` as signed integers, and (for Q4_1) the block's minimum; scalar form.
inline void unpack32(int64_t type, const uint8_t* block, int part, int8_t* w) {
  if (type == Q8_0) {
    std::memcpy(w, block + 2, 32);
  } else if (type == Q4_0 || type == Q4_1) {
    const uint8_t* qs = block + (type == Q4_0 ? 2 : 4);
    const int offset = type == Q4_0 ? 8 : 0;
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<int8_t>((qs[j] & 0xF) - offset);
      w[j + 16] = static_cast<int8_t>((qs[j] >> 4) - offset);
    }
  } else if (type == Q5_0) {
    uint32_t qh;
    std::memcpy(&qh, block + 2, 4);
    const uint8_t* qs = block + 6;
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<int8_t>(((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16);
      w[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  } else if (type == Q4_K) {  // part 0..7: chunk part / 2 of 32 bytes, its low nibbles (even part) or high ones
    const uint8_t* qs = block + 16 + 32 * (part / 2);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<int8_t>(part % 2 ? qs[j] >> 4 : qs[j] & 0xF);
  } else {  // Q6_K, part 0..7: half part / 4, group part % 4 of that half
    const uint8_t* ql = block + 64 * (part / 4);
    const uint8_t* qh = block + 128 + 32 * (part / 4);
    const int g = part % 4;
    for (int l = 0; l < 32; ++l) {
      const uint8_t low = g % 2 ? ql[l + 32] : ql[l];
      const int code = (g < 2 ? low & 0xF : low >> 4) | (((qh[l] >> (2 * g)) & 3) << 4);
      w[l] = static_cast<int8_t>(code - 32);
    }
  }
}

// Unsigned codes (at most 128: without VNNI, a pair of products must fit in int16) × signed activations: 8 int32
// lanes, lane i the sum of bytes 4i..4i+3.
inline __m256i dot32u(__m256i w, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
#endif
}

// Signed × signed: |w| times a with w's sign, which the unsigned form takes.
inline __m256i dot32(__m256i w, __m256i a) { return dot32u(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)); }

inline __m256i nibbles32(const uint8_t* qs) {  // 16 bytes → low nibbles in bytes 0–15, high ones in 16–31
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(0xF));
}

inline __m256i bits32(const uint8_t* p) {  // 32 bits → bytes of 0xFF where the bit is set
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(probe, _mm256_set1_epi64x(-1));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// One activation row as the dot products read it: its codes, block scales, and q8_1's sums or q8_K's 16-sums.
struct Row {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* bsums;
};

// One weight row (K weights in blocks) times C activation rows: out[c]. Each block's weights are unpacked once for
// the C rows; each (weight row, activation row) pair runs the same operations in the same order whatever C is, so a
// row's output does not depend on how many rows are multiplied with it.
template <int64_t type, int C>
void dot_32(const uint8_t* row, int64_t K, const Row* a, float* out) {
  const Format f = format_of(type);
  const int64_t blocks = K / 32;
  __m256 acc[C];
  float minimums[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm256_setzero_ps();
    minimums[c] = 0.f;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * f.bytes;
    __m256i w;
    if constexpr (type == Q8_0) {
      w = load32(block + 2);
    } else if constexpr (type == Q4_0) {
      w = _mm256_sub_epi8(nibbles32(block + 2), _mm256_set1_epi8(8));
    } else if constexpr (type == Q4_1) {
      w = nibbles32(block + 4);  // unsigned codes; the minimum comes with q8_1's sums
    } else {  // Q5_0: a clear high bit makes the nibble − 16, a set one keeps it
      const __m256i high = _mm256_andnot_si256(bits32(block + 2), _mm256_set1_epi8(static_cast<char>(0xF0)));
      w = _mm256_or_si256(nibbles32(block + 6), high);
    }
    const float scale = half_to_float(block);
    for (int c = 0; c < C; ++c) {
      const __m256i x = load32(a[c].q + 32 * b);
      const __m256i p = type == Q4_1 ? dot32u(w, x) : dot32(w, x);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale * a[c].d[b]), acc[c]);
      if (type == Q4_1) minimums[c] += half_to_float(block + 2) * a[c].s[b];
    }
  }
  for (int c = 0; c < C; ++c) out[c] = hsum(acc[c]) + minimums[c];
}

// The K-quants: per 256 weights, integer sums over sub-blocks with 6- or 8-bit scales, then two float scales.
template <int64_t type, int C>
void dot_k(const uint8_t* row, int64_t K, const Row* a, float* out) {
  for (int c = 0; c < C; ++c) out[c] = 0.f;
  for (int64_t b = 0; b < K / 256; ++b) {
    int32_t sumi[C] = {}, mins[C] = {};
    const uint8_t* block = row + b * (type == Q4_K ? 144 : 210);
    if constexpr (type == Q4_K) {
      uint8_t sc[8], m[8];
      scales_k4(block + 4, sc, m);
      for (int c = 0; c < C; ++c) {
        for (int j = 0; j < 8; ++j) mins[c] += m[j] * (a[c].bsums[16 * b + 2 * j] + a[c].bsums[16 * b + 2 * j + 1]);
      }
      __m256i acc[C];
      for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i bytes = load32(block + 16 + 32 * j);
        const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi8(0xF));
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0xF));
        const __m256i sc_low = _mm256_set1_epi32(sc[2 * j]), sc_high = _mm256_set1_epi32(sc[2 * j + 1]);
        for (int c = 0; c < C; ++c) {
          const int8_t* x = a[c].q + 256 * b + 64 * j;
          acc[c] = _mm256_add_epi32(acc[c], _mm256_mullo_epi32(dot32u(low, load32(x)), sc_low));
          acc[c] = _mm256_add_epi32(acc[c], _mm256_mullo_epi32(dot32u(high, load32(x + 32)), sc_high));
        }
      }
      for (int c = 0; c < C; ++c) sumi[c] = hsum_i32(acc[c]);
    } else {  // Q6_K: scales of 16 weights, int8
      const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
      __m256i acc[C];
      for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_si256();
      const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = load32(block + 64 * h), ql1 = load32(block + 64 * h + 32);
        const __m256i qh = load32(block + 128 + 32 * h);
        const __m256i groups[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4))};
        for (int g = 0; g < 4; ++g) {
          const int at = 8 * h + 2 * g;  // the two 16-weight scales of this group
          const __m256i scales = _mm256_setr_epi32(sc[at], sc[at], sc[at], sc[at], sc[at + 1], sc[at + 1],
                                                   sc[at + 1], sc[at + 1]);
          const __m256i w = _mm256_sub_epi8(groups[g], bias);
          for (int c = 0; c < C; ++c) {
            const __m256i p = dot32(w, load32(a[c].q + 256 * b + 128 * h + 32 * g));
            acc[c] = _mm256_add_epi32(acc[c], _mm256_mullo_epi32(p, scales));
          }
        }
      }
      for (int c = 0; c < C; ++c) sumi[c] = hsum_i32(acc[c]);
    }
    // Integer sums are exact in any order; the floats below run in one order for every C.
    const float d = half_to_float(block + (type == Q4_K ? 0 : 208));
    const float dmin = type == Q4_K ? half_to_float(block + 2) : 0.f;
    for (int c = 0; c < C; ++c) {
      out[c] += a[c].d[b] * d * static_cast<float>(sumi[c]) - a[c].d[b] * dmin * static_cast<float>(mins[c]);
    }
  }
}

template <int C>
void dot(int64_t type, const uint8_t* row, int64_t K, const Row* a, float* out) {
  switch (type) {  // the format as a template argument: its branches go at compile time
    case Q4_0: return dot_32<Q4_0, C>(row, K, a, out);
    case Q4_1: return dot_32<Q4_1, C>(row, K, a, out);
    case Q5_0: return dot_32<Q5_0, C>(row, K, a, out);
    case Q8_0: return dot_32<Q8_0, C>(row, K, a, out);
    case Q4_K: return dot_k<Q4_K, C>(row, K, a, out);
    default: return dot_k<Q6_K, C>(row, K, a, out);
  }
}


void check(const at::Tensor& blocks, int64_t type, int64_t K) {
  const Format f = format_of(type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "ggml_mm: blocks must be a contiguous (N, row bytes) uint8 matrix");
  TORCH_CHECK(K % f.weights == 0 && blocks.size(1) == K / f.weights * f.bytes,
              "ggml_mm: ", K, " inputs do not fill rows of ", blocks.size(1), " bytes of type ", type);
}

constexpr int64_t COLS = 8;    // activation rows per pass over a weight row's blocks (then 4, 2, 1 for the rest)
constexpr int64_t TILE = 16;   // weight rows per task: they share one chunk of activations in the L1 cache
constexpr int64_t CHUNK = 32;  // activation rows per chunk

// One weight row times activation rows m..m+C into the output column `out` (rows of N); the next m.
template <int C>
int64_t columns(int64_t type, const uint8_t* row, int64_t K, const Row* a, int64_t m, float* out, int64_t N,
                float* result) {
  dot<C>(type, row, K, a + m, result);
  for (int c = 0; c < C; ++c) out[(m + c) * N] = result[c];
  return m + C;
}

at::Tensor ggml_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "ggml_mm: x must be a (M, K) float32 matrix");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  check(blocks, type, K);
  const bool k_quant = type == Q4_K || type == Q6_K;
  const auto xc = x.contiguous();
  Acts a;
  a.q.resize(M * K);
  a.d.resize(M * K / 32);
  a.s.resize(M * K / 32);
  a.bsums.resize(M * K / 16);
  std::vector<Row> rows(M);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = xc.data_ptr<float>() + m * K;
      if (k_quant) {
        quantize_q8_k(xm, K, a.q.data() + m * K, a.d.data() + m * K / 256, a.bsums.data() + m * K / 16);
      } else {
        quantize_q8(xm, K, type == Q4_1, a.q.data() + m * K, a.d.data() + m * K / 32, a.s.data() + m * K / 32);
      }
      rows[m] = {a.q.data() + m * K, a.d.data() + m * K / (k_quant ? 256 : 32), a.s.data() + m * K / 32,
                 a.bsums.data() + m * K / 16};
    }
  });
  auto y = at::empty({M, N}, xc.options());
  float* out = y.data_ptr<float>();
  const uint8_t* W = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t t0, int64_t t1) {
    float result[COLS];
    for (int64_t n0 = t0 * TILE; n0 < std::min(N, t1 * TILE); n0 += TILE) {
      for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        const int64_t m1 = std::min(M, m0 + CHUNK);
        for (int64_t n = n0; n < std::min(N, n0 + TILE); ++n) {
          const uint8_t* row = W + n * row_bytes;
          int64_t m = m0;
          for (; m + COLS <= m1; m += COLS) columns<COLS>(type, row, K, rows.data(), m, out + n, N, result);
          if (m + 4 <= m1) m = columns<4>(type, row, K, rows.data(), m, out + n, N, result);
          if (m + 2 <= m1) m = columns<2>(type, row, K, rows.data(), m, out + n, N, result);
          if (m < m1) columns<1>(type, row, K, rows.data(), m, out + n, N, result);
        }
      }
    }
  });
  return y;
}

// Rows of the weight matrix in float32, (R, K): a tied embedding's lookup, and the off-CPU fallback.
at::Tensor ggml_rows(const at::Tensor& blocks, const at::Tensor& index, int64_t type, int64_t K) {
  check(blocks, type, K);
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "ggml_rows: index must be a 1-D int64 tensor");
  const Format f = format_of(type);
  const auto ic = index.contiguous();
  const int64_t R = ic.size(0), N = blocks.size(0), row_bytes = blocks.size(1);
  auto y = at::empty({R, K}, blocks.options().dtype(at::kFloat));
  const int64_t* rows = ic.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rows[r] >= 0 && rows[r] < N, "ggml_rows: row ", rows[r], " out of ", N);
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    int8_t w[32];
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = blocks.data_ptr<uint8_t>() + rows[r] * row_bytes;
      float* out = y.data_ptr<float>() + r * K;
      for (int64_t b = 0; b < K / f.weights; ++b) {
        const uint8_t* block = row + b * f.bytes;
        for (int part = 0; part < f.weights / 32; ++part) {
          unpack32(type, block, part, w);
          float* o = out + b * f.weights + 32 * part;
          if (type == Q4_K) {
            uint8_t sc[8], m[8];
            scales_k4(block + 4, sc, m);
            const float scale = half_to_float(block) * sc[part], minimum = half_to_float(block + 2) * m[part];
            for (int j = 0; j < 32; ++j) o[j] = scale * w[j] - minimum;
          } else if (type == Q6_K) {
            const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
            const float d = half_to_float(block + 208);
            for (int j = 0; j < 32; ++j) o[j] = d * sc[2 * part + j / 16] * w[j];
          } else {
            const float d = half_to_float(block), minimum = type == Q4_1 ? half_to_float(block + 2) : 0.f;
            for (int j = 0; j < 32; ++j) o[j] = d * w[j] + minimum;
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(qkv, m) {
  m.def("ggml_mm(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("ggml_rows(Tensor blocks, Tensor index, int type, int K) -> Tensor");
}

TORCH_LIBRARY_IMPL(qkv, CPU, m) {
  m.impl("ggml_mm", &ggml_mm);
  m.impl("ggml_rows", &ggml_rows);
}

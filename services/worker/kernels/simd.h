// AVX-512 helpers shared by the kernels: bfloat16 loads and stores, a 16-way horizontal fold, e^x. The bfloat16
// stores need AVX-512 BF16 (the bfloat16 library); the rest needs only AVX-512 F: the quant library's avx512
// build includes this header too, for native_glue.h's decode attention.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>

namespace llmserve {

using bf16 = uint16_t;

// 16 bf16 → 16 fp32
inline __m512 load16(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// 16 fp16 or int8 (the native KV pool's fp16 and q8) or fp32 → 16 fp32, exactly
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 widen16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }

#ifdef __AVX512BF16__
// 16 fp32 → 16 bf16 (round to nearest even)
inline void store16(bf16* p, __m512 x) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(x)); }

// to bf16 and back: what a bf16 tensor op's result holds
inline __m512 round16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

#endif

// The levels of a 16-way fold: each sums lanes of x and y pairwise into one vector, halving the vectors a level
// (fold2: neighbouring lanes; fold4: neighbouring pairs; fold8: 128-bit quarters, used for the last two levels)
inline __m512 fold2(__m512 x, __m512 y) { return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y)); }
inline __m512 fold4(__m512 x, __m512 y) {
    const __m512d a = _mm512_castps_pd(x), b = _mm512_castps_pd(y);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}
inline __m512 fold8(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// r[i] = sum of the 16 lanes of a[i], i = 0..15 (a shuffle tree: no horizontal sum per vector)
inline __m512 fold16(const __m512* a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) b[i] = fold2(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 4; ++i) c[i] = fold4(b[2 * i], b[2 * i + 1]);
    for (int i = 0; i < 2; ++i) d[i] = fold8(c[2 * i], c[2 * i + 1]);
    return fold8(d[0], d[1]);
}

// The largest of s[0, n), with s[n, round16(n)) set to -inf (a softmax's padding to whole vectors)
inline float padded_max16(float* s, int64_t n) {
    const int64_t padded = (n + 15) & ~int64_t(15);
    for (int64_t p = n; p < padded; ++p) s[p] = -INFINITY;
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t p = 0; p < padded; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + p));
    return _mm512_reduce_max_ps(m);
}

// e^x for x in [-87, 88] (clamped outside): 2^n · p(f), p a degree-6 polynomial, relative error < 2e-7
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

}  // namespace llmserve

// AVX-512 helpers shared by the kernels: bfloat16 loads and stores, a 16-way horizontal fold, e^x.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace llmserve {

using bf16 = uint16_t;

// 16 bf16 → 16 fp32
inline __m512 load16(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// 16 fp32 → 16 bf16 (round to nearest even)
inline void store16(bf16* p, __m512 x) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(x)); }

// to bf16 and back: what a bf16 tensor op's result holds
inline __m512 round16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

// r[i] = sum of the 16 lanes of a[i], i = 0..15 (a shuffle tree: no horizontal sum per vector)
inline __m512 fold16(const __m512* a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
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

// GGUF Q4_1 and Q8_0 weights times fp32 activation rows, one matmul a call: y[m, n] = x[m, k] · W[n, k]ᵀ
// (blocks.h describes the layouts and the activation schemes). Built twice (kernels/__init__.py): with AVX2 the
// 4-row layout and three schemes (int16, int8, fp32); with AVX-512 VNNI the 16-row vertical layout and int16,
// the one served (the same bits as the AVX2 build's int16).
#include <vector>

#include <omp.h>

#include "blocks.h"

namespace {

using namespace llmserve;

// whether a product of n outputs, m rows and k inputs is worth an OpenMP region (4-row tiles × rows × blocks)
inline bool threaded(int64_t n, int64_t m, int64_t k) { return n / 4 * m * (k / QK) >= 4096; }

#ifndef LLMSERVE_VERTICAL
template <class Body>
void over_tiles(int64_t n, int64_t m, int64_t k, Body body) {
#pragma omp parallel if (threaded(n, m, k))
    tiles_for(n / 4, m, body);
}

template <class F>
void matmul_f32(const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy) {
    const int64_t nb = k / QK;
    over_tiles(n, m, k, [&](int64_t t, int64_t m0, int64_t m1) {
        const uint8_t* wt = w + t * nb * F::GROUP;
        in_passes(m0, m1, [&](auto R, int64_t r) {
            tile_f32<F, decltype(R)::value>(wt, nb, x + r * ldx, ldx, y + r * ldy + 4 * t, ldy);
        });
    });
}

template <class F, class A>
void matmul_int(const uint8_t* w, int64_t n, int64_t k, const typename A::Q* xq, const float* xd, const float* xs,
                int64_t m, float* y, int64_t ldy) {
#pragma omp parallel if (threaded(n, m, k))
    int_tiles<F, A>(w, n, k, xq, xd, xs, m, y, ldy);
}

#endif

// int16 activations quantized here, on the calling thread (576-1536 values a row), then the integer tiles; on the
// AMX tiles (from amx_min_rows rows) the rows are quantized and put in tile form by the region's threads first
template <class F>
void matmul_i16(const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy) {
    thread_local Quants x16;
    x16.reserve(m, k);
#ifdef LLMSERVE_VERTICAL
    if (amx_rows(m)) {
        thread_local AmxActivations tiles;
        tiles.reserve(m, k);
        Quants* q = &x16;
        AmxActivations* t = &tiles;
        const int64_t nb = k / QK;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < t->padded; ++r) {
                if (r < m) {
                    q->row(x + r * ldx, r, k);
                    t->row(r, q->q.data() + r * k, q->d.data() + r * nb, q->s.data() + r * nb);
                } else {
                    t->row(r, nullptr, nullptr, nullptr);
                }
            }
            amx_tiles<typename Vertical<F>::type>(w, n, k, *t, y, ldy);
        }
        return;
    }
#endif
    for (int64_t r = 0; r < m; ++r) x16.row(x + r * ldx, r, k);
    // the region's threads see the calling thread's buffers through these (not their own thread_local x16)
    const int16_t* xq = x16.q.data();
    const float *xd = x16.d.data(), *xs = x16.s.data();
#pragma omp parallel if (threaded(n, m, k))
    i16_tiles<F>(w, n, k, xq, xd, xs, m, y, ldy);
}

#ifdef LLMSERVE_VERTICAL
// rows (original order) of a vertical matrix, dequantized to fp32 (an embedding lookup: a weight at a time)
template <class F>
void dequant_rows(const uint8_t* w, int64_t k, const int64_t* rows, int64_t count, float* out) {
    using V = typename Vertical<F>::type;
    const int64_t nb = k / QK, tile_bytes = nb * V::GROUP;
    for (int64_t c = 0; c < count; ++c) {
        const int64_t row = rows[c];
        const int j = (int)(row % TILE);
        const uint8_t* wt = w + (row / TILE) * tile_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* g = wt + b * V::GROUP;
            uint16_t dh, mh = 0;
            std::memcpy(&dh, g + 2 * j, 2);
            if constexpr (V::HAS_MIN) std::memcpy(&mh, g + 32 + 2 * j, 2);
            const float d = fp16_to_f32(dh), m = fp16_to_f32(mh);
            for (int kk = 0; kk < QK; ++kk) out[c * k + b * QK + kk] = std::fma((float)V::value(g, j, kk), d, m);
        }
    }
}
#else
// rows (original order) of a repacked matrix, dequantized to fp32. One thread: a whole 3072 × 576 matrix takes
// ~0.25 ms, and an OpenMP region around it costs more than that whenever the other core is busy (on a shared
// machine, up to a scheduler slice: 8 ms measured per region, ~2.5 s over a 2,000-token prefill's 480 matrices)
template <class F>
void dequant_rows(const uint8_t* w, int64_t k, const int64_t* rows, int64_t count, float* out) {
    const int64_t nb = k / QK, tile_bytes = nb * F::GROUP;
    for (int64_t c = 0; c < count; ++c) {
        const int64_t row = rows[c], i = row % 4;
        const uint8_t* wt = w + (row / 4) * tile_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* g = wt + b * F::GROUP;
            alignas(32) float dm[8];
            _mm256_store_ps(dm, F::scales(g));
            __m256 v[4];
            F::values(g, (int)i, v);
            const __m256 d = _mm256_set1_ps(dm[i]), m = _mm256_set1_ps(F::HAS_MIN ? dm[4 + i] : 0.0f);
            for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + c * k + b * QK + 8 * j, _mm256_fmadd_ps(v[j], d, m));
        }
    }
}
#endif

}  // namespace

extern "C" {

// 1: the CPU this runs on has what this build uses (AVX2, FMA, F16C; and AVX-512 F/BW/VL/VNNI for the vertical one)
int llmserve_quant_cpu_ok() {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#ifdef LLMSERVE_VERTICAL
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return avx2;
#endif
}

// From how many activation rows the int16 products run on the AMX tiles (0: never; the same bits either way);
// returns 1 where this CPU and process can use them (the avx512 build), else 0
int llmserve_quant_amx(int64_t min_rows) {
#ifdef LLMSERVE_VERTICAL
    amx_min_rows = min_rows;
    return amx_usable() ? 1 : 0;
#else
    (void)min_rows;
    return 0;
#endif
}

// rows a tile of this build's layout holds (quant_linear.repack): 4, or 16 for the vertical one
int64_t llmserve_quant_tile_rows() { return TILE; }

#ifndef LLMSERVE_VERTICAL

// Activations per 32-block to int8: x [m, k] (row stride ldx) → xq [m, k], xd [m, k/32] (scale), xs [m, k/32]
// (scale · Σq). Scale = max|x| / 127, q = round-half-even(x / scale).
void llmserve_quantize_q8(const float* x, int64_t ldx, int64_t m, int64_t k, int8_t* xq, float* xd, float* xs) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (m >= 16)
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            __m256i qi[4];
            int32_t sum;
            quantize_block(x + r * ldx + b * QK, 127.0f, qi, xd[r * nb + b], sum);
            // int32 → int8 in order: packs work per 128-bit lane, so the lanes are put back in order after
            const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
            const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
            const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i*)(xq + r * k + b * QK), ordered);
            xs[r * nb + b] = xd[r * nb + b] * (float)sum;
        }
    }
}

// y [m, n] (row stride ldy) = activations · Wᵀ, W repacked [n/4 tiles][k/32 blocks][group]; n % 4 == 0, k % 32 == 0
void llmserve_q4_1_matmul_i8(const uint8_t* w, int64_t n, int64_t k, const int8_t* xq, const float* xd,
                             const float* xs, int64_t m, float* y, int64_t ldy) {
    matmul_int<Q4_1, I8<Q4_1>>(w, n, k, xq, xd, xs, m, y, ldy);
}
void llmserve_q8_0_matmul_i8(const uint8_t* w, int64_t n, int64_t k, const int8_t* xq, const float* xd,
                             const float* xs, int64_t m, float* y, int64_t ldy) {
    matmul_int<Q8_0, I8<Q8_0>>(w, n, k, xq, xd, xs, m, y, ldy);
}
void llmserve_q4_1_matmul_f32(const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t ldx, int64_t m,
                              float* y, int64_t ldy) {
    matmul_f32<Q4_1>(w, n, k, x, ldx, m, y, ldy);
}
void llmserve_q8_0_matmul_f32(const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t ldx, int64_t m,
                              float* y, int64_t ldy) {
    matmul_f32<Q8_0>(w, n, k, x, ldx, m, y, ldy);
}
#endif
void llmserve_q4_1_matmul_i16(const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t ldx, int64_t m,
                              float* y, int64_t ldy) {
    matmul_i16<Q4_1>(w, n, k, x, ldx, m, y, ldy);
}
void llmserve_q8_0_matmul_i16(const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t ldx, int64_t m,
                              float* y, int64_t ldy) {
    matmul_i16<Q8_0>(w, n, k, x, ldx, m, y, ldy);
}
void llmserve_q4_1_dequant_rows(const uint8_t* w, int64_t k, const int64_t* rows, int64_t count, float* out) {
    dequant_rows<Q4_1>(w, k, rows, count, out);
}
void llmserve_q8_0_dequant_rows(const uint8_t* w, int64_t k, const int64_t* rows, int64_t count, float* out) {
    dequant_rows<Q8_0>(w, k, rows, count, out);
}

}

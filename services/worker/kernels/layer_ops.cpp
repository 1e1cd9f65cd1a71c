// The elementwise work between a decoder layer's matmuls, fused, bfloat16, AVX-512 (avx512f/bw/vl + bf16).
//
// At batch 1 a decode step's glue is per-op overhead: F.rms_norm alone is seven tensor ops in bfloat16
// (20 µs for 576 numbers), the rotary embedding five, the KV write two. Each function here is one call:
//   add_rms_norm   h += delta (rounded to bf16), out = rms_norm(h) · w (fp32 inside, rounded once,
//                  as F.rms_norm does);
//   rope_store     the rotary embedding on q and k in place (rounded as torch's x·cos + rotate_half(x)·sin
//                  is: each product, then the sum), then k and v written into their KV slots;
//   silu_mul       silu(gate) · up (silu rounded to bf16, then the product, as torch's two ops).
// Rows are spread over torch's OpenMP threads when there are enough of them.
#include "simd.h"

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

namespace {

using namespace llmserve;

constexpr int64_t PARALLEL_ROWS = 8;   // fewer rows run on the calling thread alone

void add_rms_norm_row(bf16* h, const bf16* delta, const bf16* w, bf16* out, int64_t dim, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        __m512 x = load16(h + i);
        if (delta) {
            x = round16(_mm512_add_ps(x, load16(delta + i)));
            store16(h + i, x);
        }
        ss = _mm512_fmadd_ps(x, x, ss);
    }
    const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / float(dim) + eps));
    for (int64_t i = 0; i < dim; i += 16)
        store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(h + i), r), load16(w + i)));
}

}  // namespace

extern "C" {

// h: [rows, dim] (row stride h_stride), updated to h + delta when delta is given (row stride delta_stride);
// out: [rows, dim] contiguous; dim % 16 == 0
void llmserve_add_rms_norm(bf16* h, int64_t h_stride, const bf16* delta, int64_t delta_stride, const bf16* w,
                           bf16* out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r)
        add_rms_norm_row(h + r * h_stride, delta ? delta + r * delta_stride : nullptr, w, out + r * dim, dim, eps);
}

// qkv: [rows, (heads + 2 kv_heads) * head_dim] (row stride qkv_stride): q heads, k heads, v heads;
// cos, sin: [rows, head_dim]; q and k rotated in place, then k and v copied to slot slots[r] of the
// caches ([slots, kv_heads, head_dim]); head_dim % 32 == 0
void llmserve_rope_store(bf16* qkv, int64_t qkv_stride, int64_t rows, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, const bf16* cos, const bf16* sin, const int64_t* slots, bf16* k_cache,
                         bf16* v_cache) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        bf16* row = qkv + r * qkv_stride;
        const bf16* c = cos + r * head_dim;
        const bf16* s = sin + r * head_dim;
        for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
            bf16* x = row + hd * head_dim;
            for (int64_t i = 0; i < half; i += 16) {
                const __m512 x1 = load16(x + i), x2 = load16(x + half + i);
                // first half: x1·cos - x2·sin; second half: x2·cos + x1·sin (each product rounded, then the sum)
                const __m512 a1 = round16(_mm512_mul_ps(x1, load16(c + i)));
                const __m512 b1 = round16(_mm512_mul_ps(x2, load16(s + i)));
                const __m512 a2 = round16(_mm512_mul_ps(x2, load16(c + half + i)));
                const __m512 b2 = round16(_mm512_mul_ps(x1, load16(s + half + i)));
                store16(x + i, _mm512_sub_ps(a1, b1));
                store16(x + half + i, _mm512_add_ps(a2, b2));
            }
        }
        const int64_t kv_bytes = kv_heads * head_dim * int64_t(sizeof(bf16));
        std::memcpy(k_cache + slots[r] * kv_heads * head_dim, row + heads * head_dim, kv_bytes);
        std::memcpy(v_cache + slots[r] * kv_heads * head_dim, row + (heads + kv_heads) * head_dim, kv_bytes);
    }
}

// gate_up: [rows, 2 * inter] (gate | up); out: [rows, inter] = silu(gate) · up; inter % 16 == 0
void llmserve_silu_mul(const bf16* gate_up, bf16* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const bf16* g = gate_up + r * 2 * inter;
        const bf16* u = g + inter;
        bf16* o = out + r * inter;
        for (int64_t i = 0; i < inter; i += 16) {
            const __m512 x = load16(g + i);
            const __m512 silu = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
            store16(o + i, _mm512_mul_ps(silu, load16(u + i)));
        }
    }
}

}

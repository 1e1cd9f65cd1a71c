// The native path's glue, one op a call (native_glue.h has the arithmetic): the same four functions as
// layer_ops.cpp / paged_attention.cpp, which need AVX-512 BF16 and run bfloat16 only. The native step runs them
// all in one call (native_step.cpp) when every row of a step is a decode row; these serve the other steps.
//
// At batch 1 a decode step is per-op overhead: torch runs RMSNorm as several tensor ops, the rotary embedding
// as five, the KV write as two, SiLU · up as two, and the decode attention as a gather of the paged slots and an
// SDPA call; each op costs ~5-20 µs of dispatch for a few hundred numbers. Each function here is one call.
// The elementwise functions run on the calling thread (they take ~0.1 ms at 512 rows, less than an OpenMP
// region costs whenever the other core is busy); the attention spreads its items over torch's OpenMP threads
// when there is enough of it.
#include <omp.h>

#include "native_glue.h"

namespace {

using namespace llmserve;

template <class TK, class TV>
int paged_decode(const float* q, int64_t q_stride, int64_t rows, const TK* k_cache, const TV* v_cache, int64_t kv_heads,
                 int64_t head_dim, int64_t group, const int64_t* tables, int64_t width, const int64_t* lens,
                 int64_t block_size, float scale, float* out, int64_t out_stride) {
    if (head_dim % 8 != 0 || head_dim > 256 || group > 64 || (is_q8<TV> && head_dim % 16 != 0)) return 1;
    DecodePlan plan;
    plan.build(rows, lens, block_size, kv_heads, group, head_dim, tables, width, omp_get_max_threads());
#pragma omp parallel if (plan.work * kv_heads * group * head_dim >= (1 << 19))
    {
        std::vector<float> scores(plan.scratch);
        OmpShare share;
        decode_parts(plan, q, q_stride, k_cache, v_cache, kv_heads, head_dim, group, tables, width, lens, block_size,
                     scale, scores.data(), share);
#pragma omp barrier
        decode_merge(plan, rows, kv_heads, head_dim, group, out, out_stride, share);
    }
    return 0;
}

template <class TK, class TV>
void rope_store(float* qkv, int64_t qkv_stride, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const float* cos, const float* sin, const int64_t* slots, TK* k_cache, TV* v_cache) {
    for (int64_t r = 0; r < rows; ++r)
        rope_store_row(qkv + r * qkv_stride, heads, kv_heads, head_dim, cos + r * head_dim, sin + r * head_dim, slots[r],
                       k_cache, v_cache);
}

}  // namespace

extern "C" {

// h: [rows, dim] (row stride h_stride), updated to h + delta when delta is given (row stride delta_stride);
// out: [rows, dim] contiguous; dim % 8 == 0
void llmserve_f32_add_rms_norm(float* h, int64_t h_stride, const float* delta, int64_t delta_stride,
                               const float* w, float* out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; ++r)
        add_rms_norm_row(h + r * h_stride, delta ? delta + r * delta_stride : nullptr, w, out + r * dim, dim, eps);
}

// qkv: [rows, (heads + 2 kv_heads) * head_dim] (row stride qkv_stride): q heads, k heads, v heads;
// cos, sin: [rows, head_dim] contiguous; q and k rotated in place, then k and v written to slot slots[r] of the
// caches ([slots, kv_heads, head_dim]; fp32, or fp16 rounded to nearest: f16_; in the avx512 build fp16 keys and
// q8 values, [slots, kv_heads, head_dim + 4]: f16q8_, native_glue.h); head_dim % 16 == 0
void llmserve_f32_rope_store(float* qkv, int64_t qkv_stride, int64_t rows, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, const float* cos, const float* sin, const int64_t* slots,
                             float* k_cache, float* v_cache) {
    rope_store(qkv, qkv_stride, rows, heads, kv_heads, head_dim, cos, sin, slots, k_cache, v_cache);
}
void llmserve_f16_rope_store(float* qkv, int64_t qkv_stride, int64_t rows, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, const float* cos, const float* sin, const int64_t* slots,
                             uint16_t* k_cache, uint16_t* v_cache) {
    rope_store(qkv, qkv_stride, rows, heads, kv_heads, head_dim, cos, sin, slots, k_cache, v_cache);
}

#ifdef __AVX512F__
void llmserve_f16q8_rope_store(float* qkv, int64_t qkv_stride, int64_t rows, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, const float* cos, const float* sin, const int64_t* slots,
                               uint16_t* k_cache, int8_t* v_cache) {
    rope_store(qkv, qkv_stride, rows, heads, kv_heads, head_dim, cos, sin, slots, k_cache, v_cache);
}
#endif

// gate_up: [rows, 2 * inter] (gate | up); out: [rows, inter] = silu(gate) · up; inter % 8 == 0
void llmserve_f32_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; ++r)
        silu_mul_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
}

// Decode attention: row b's query q [rows, heads, head_dim] (row stride q_stride, heads contiguous) attends to
// the first lens[b] positions of block table b (tables [rows, width], int64), into out [rows, heads, head_dim]
// (row stride out_stride). Caches [slots, kv_heads, head_dim], fp32 (f32_) or fp16 (f16_), or in the avx512
// build fp16 keys and q8 values ([slots, kv_heads, head_dim + 4]: f16q8_). Returns 0; 1 when head_dim is not a
// multiple of 8 (q8: 16) up to 256 or more than 64 query heads share a KV head.
int llmserve_f32_paged_decode(const float* q, int64_t q_stride, int64_t rows, const float* k_cache,
                              const float* v_cache, int64_t kv_heads, int64_t head_dim, int64_t group,
                              const int64_t* tables, int64_t width, const int64_t* lens, int64_t block_size,
                              float scale, float* out, int64_t out_stride) {
    return paged_decode(q, q_stride, rows, k_cache, v_cache, kv_heads, head_dim, group, tables, width, lens,
                        block_size, scale, out, out_stride);
}
int llmserve_f16_paged_decode(const float* q, int64_t q_stride, int64_t rows, const uint16_t* k_cache,
                              const uint16_t* v_cache, int64_t kv_heads, int64_t head_dim, int64_t group,
                              const int64_t* tables, int64_t width, const int64_t* lens, int64_t block_size,
                              float scale, float* out, int64_t out_stride) {
    return paged_decode(q, q_stride, rows, k_cache, v_cache, kv_heads, head_dim, group, tables, width, lens,
                        block_size, scale, out, out_stride);
}
#ifdef __AVX512F__
int llmserve_f16q8_paged_decode(const float* q, int64_t q_stride, int64_t rows, const uint16_t* k_cache,
                                const int8_t* v_cache, int64_t kv_heads, int64_t head_dim, int64_t group,
                                const int64_t* tables, int64_t width, const int64_t* lens, int64_t block_size,
                                float scale, float* out, int64_t out_stride) {
    return paged_decode(q, q_stride, rows, k_cache, v_cache, kv_heads, head_dim, group, tables, width, lens,
                        block_size, scale, out, out_stride);
}
#endif

}

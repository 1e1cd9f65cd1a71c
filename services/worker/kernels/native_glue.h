// The native path's glue between its block matmuls, fp32, AVX2 + FMA: one row at a time, and the decode
// attention's parts (AVX-512 in the quant library's avx512 build). Shared by native_ops.cpp (one op a call) and
// native_step.cpp (a whole decode step a call), so both compute each row bit for bit alike.
//   add_rms_norm_row   h += delta, out = h · rsqrt(mean(h²) + eps) · w;
//   rope_store_row     the rotary embedding on q and k in place (x·cos + rotate_half(x)·sin), then k and v written
//                      into their KV slot;
//   silu_mul_row       silu(gate) · up;
//   DecodePlan, decode_parts, decode_merge
//                      attention of one query row per sequence over its paged context (block tables), fp32, fp16
//                      or q8 KV: each row in parts of SPLIT keys, then merged; a part runs each (row, KV head) with
//                      its group of query heads (AVX2; fp32 and fp16), or in the avx512 build every KV head of the
//                      row at once.
//
// The KV pool's element types: float (fp32) and uint16_t (fp16) for keys and values alike, or fp16 keys with
// int8_t values (q8: each (slot, KV head) is head_dim int8 values q and then their fp32 scale s, the value being
// q · s; head_stride<T> elements a head, so a slot's row is kv_heads · head_stride<T>). q8 values take a quarter
// off the bytes a long context reads (SmolLM2 at 2,000 positions: 46 MB of fp16 keys and values a step, half its
// weights). Keys stay fp16: rounded per head to int8 they flipped the argmax at 2.1% of a text's positions
// against fp32, values at 0.2% (docs/performance.md).
#pragma once

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "share.h"
#ifdef __AVX512F__
#include "simd.h"
#endif

namespace llmserve {


inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// n rounded up to a multiple of 8 (a scores row's stride in attend_heads)
inline int64_t round8(int64_t n) { return (n + 7) & ~int64_t(7); }

inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// e^x, 8 lanes (Cephes' expf: 2^n · e^r, |r| ≤ ln2/2, degree-5 polynomial; relative error ~2e-7); x clamped to
// [-87.3, 88.7] so 2^n stays a normal float
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.72283f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <class T>
constexpr bool is_q8 = std::is_same<T, int8_t>::value;

// elements from one KV head's values to the next in a slot's row (q8: the values, then the 4 bytes of the scale)
template <class T>
constexpr int64_t head_stride(int64_t d) { return is_q8<T> ? d + 4 : d; }

// the scale of the KV head whose values start at p (head_dim d): q8's stored scale, 1 for fp32 and fp16
template <class T>
inline float kv_scale(const T* p, int64_t d) {
    if constexpr (is_q8<T>) {
        float s;
        std::memcpy(&s, p + d, sizeof s);
        return s;
    } else {
        (void)p, (void)d;
        return 1.0f;
    }
}

// 8 cache values as fp32: the KV pool is fp32 or fp16 (half the bytes a long context reads; the conversion is
// exact, so both round only where the values were stored), or q8 (the integers, without their scale)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }

// one slot's row of kv_heads heads of d floats (d % 8 == 0) into the cache's element type; q8: each head rounded
// to the nearest of 255 levels, ±max|x| (s = max|x| / 127, q = round(x / s); all zeros: s = 0)
inline void store_row(float* dst, const float* src, int64_t kv_heads, int64_t d) {
    std::memcpy(dst, src, kv_heads * d * sizeof(float));
}
inline void store_row(uint16_t* dst, const float* src, int64_t kv_heads, int64_t d) {
    for (int64_t i = 0; i < kv_heads * d; i += 8)
        _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}
inline void store_row(int8_t* dst, const float* src, int64_t kv_heads, int64_t d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t h = 0; h < kv_heads; ++h, src += d, dst += d + 4) {
        __m256 mx = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float s = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int64_t i = 0; i < d; i += 8) {
            const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i), inv));   // to nearest even
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64((__m128i*)(dst + i), _mm_packs_epi16(w, w));
        }
        std::memcpy(dst + d, &s, sizeof s);
    }
}

constexpr int64_t PF_KEYS = 16;   // keys ahead a head's score and value loops prefetch (fp16: 10.6 -> 10.4 ms
                                  // for 30 layers at 2,000 keys from DRAM; fp32 unchanged)
// into L1, or only into L2; inlined by force: g++ 12 left it a call inside the avx512 attention's pair and key
// loops, where the spread prefetches then bought nothing (30 layers at 2,000 keys, two threads: 2.85 against 2.35
// ms)
template <class T>
__attribute__((always_inline)) inline void prefetch_row(const T* p, int64_t d, bool l2 = false) {
    const char* c = (const char*)p;
    for (int64_t off = 0; off < d * int64_t(sizeof(T)); off += 64)
        l2 ? _mm_prefetch(c + off, _MM_HINT_T1) : _mm_prefetch(c + off, _MM_HINT_T0);
}

// The levels of an 8-way fold (AVX2): each sums lanes of x and y pairwise into one vector, halving the vectors a
// level, so 8 vectors of partial sums become one vector of their 8 totals in 7 folds (no horizontal sum per key)
inline __m256 fold2x8(__m256 x, __m256 y) { return _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y)); }
inline __m256 fold4x8(__m256 x, __m256 y) {
    const __m256d a = _mm256_castps_pd(x), b = _mm256_castps_pd(y);
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
}
inline __m256 fold8x8(__m256 x, __m256 y) {
    return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}

// G query heads' scores (q heads q_head_stride apart) of 8 keys (rows kr[0..7], d values each), times scale, into
// s[g * stride .. + 8): per (key, head) one 8-lane FMA chain over d, the 8 keys' chains folded as they finish. D: d
// known when compiled (0: not), so the loop unrolls
template <class T, int G, int D>
inline void scores8(const float* q, int64_t q_head_stride, const T* const* kr, int64_t d_, __m256 scale, float* s,
                    int64_t stride) {
    const int64_t d = D ? D : d_;
    __m256 quad[G][2];
    for (int h = 0; h < 2; ++h) {
        const T* k0 = kr[4 * h];
        const T* k1 = kr[4 * h + 1];
        const T* k2 = kr[4 * h + 2];
        const T* k3 = kr[4 * h + 3];
        __m256 a[G][4];
        for (int g = 0; g < G; ++g)
            for (int u = 0; u < 4; ++u) a[g][u] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 x0 = load8(k0 + i), x1 = load8(k1 + i), x2 = load8(k2 + i), x3 = load8(k3 + i);
            for (int g = 0; g < G; ++g) {
                const __m256 qv = _mm256_loadu_ps(q + g * q_head_stride + i);
                a[g][0] = _mm256_fmadd_ps(qv, x0, a[g][0]);
                a[g][1] = _mm256_fmadd_ps(qv, x1, a[g][1]);
                a[g][2] = _mm256_fmadd_ps(qv, x2, a[g][2]);
                a[g][3] = _mm256_fmadd_ps(qv, x3, a[g][3]);
            }
        }
        for (int g = 0; g < G; ++g) quad[g][h] = fold4x8(fold2x8(a[g][0], a[g][1]), fold2x8(a[g][2], a[g][3]));
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(s + g * stride, _mm256_mul_ps(fold8x8(quad[g][0], quad[g][1]), scale));
}

// out[g][i0 .. i0 + 8 W) += Σ_t p[g · stride + t] · v_t[i0 .. i0 + 8 W) over the n value rows vb + t · row_floats,
// each row's W vectors widened once for the G heads; W compile-time, so the G × W sums stay in registers (with W
// a variable g++ kept them on the stack: a load and a store around every FMA). The pass at i0 = 0 prefetches
// the rows PF_KEYS ahead.
template <class T, int G, int W>
inline void values8(const T* vb, int64_t row_floats, int64_t n, const float* p, int64_t stride, float* out, int64_t d,
                    int64_t i0) {
    __m256 acc[G][W];
    for (int g = 0; g < G; ++g)
        for (int v = 0; v < W; ++v) acc[g][v] = _mm256_loadu_ps(out + g * d + i0 + 8 * v);
    for (int64_t t = 0; t < n; ++t) {
        const T* vr = vb + t * row_floats + i0;
        if (i0 == 0) prefetch_row(vr + PF_KEYS * row_floats, d);
        __m256 w[G];
        for (int g = 0; g < G; ++g) w[g] = _mm256_set1_ps(p[g * stride + t]);
        for (int v = 0; v < W; ++v) {
            const __m256 x = load8(vr + 8 * v);
            for (int g = 0; g < G; ++g) acc[g][v] = _mm256_fmadd_ps(w[g], x, acc[g][v]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int v = 0; v < W; ++v) _mm256_storeu_ps(out + g * d + i0 + 8 * v, acc[g][v]);
}

// Up to 4 query heads (G) of one (row, KV head) over the keys at positions begin..end-1 (begin a multiple of
// block_size) → out [G][d] = Σ e^(s - m) · v, unnormalized, with each head's m (the largest score) and l
// (Σ e^(s - m)); scores is scratch of G × round8(end - begin) floats. Scores 8 keys at a time (scores8; past the
// last key the group repeats its first, lanes not used), each key row widened to fp32 once for the G heads; the
// values block by block (a block's base address once, no division per key), each value row widened once for the G
// heads (8 lanes at a time, into G accumulators: with 3 heads half the conversions and loads of one pass a head).
// Every score and every output lane is one FMA chain in the same order whatever G and the keys beside it, so the
// bits depend on neither.
template <class T, int G>
void attend_heads(const float* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                  const int64_t* table, int64_t begin, int64_t end, int64_t block_size, int64_t kv_heads,
                  int64_t head, int64_t d, float scale, float* out, float* m_out, float* l_out, float* scores) {
    const int64_t row_floats = kv_heads * d, len = end - begin, stride = round8(len);
    const __m256 scale8 = _mm256_set1_ps(scale);
    // cursors (block, offset) over the positions: the keys being scored, and the keys PF_KEYS ahead being
    // prefetched (this head's rows are row_floats apart: the other heads' lie between, so the hardware prefetchers
    // miss them and each row would cost a DRAM latency)
    int64_t blk = begin / block_size, off = 0;
    int64_t ahead = PF_KEYS < len ? PF_KEYS : len, ablk = (begin + ahead) / block_size, aoff = (begin + ahead) % block_size;
    const T* krow[8];
    for (int64_t j = 0; j < len; j += 8) {
        for (; ahead < len && ahead < j + 8 + PF_KEYS; ++ahead) {
            const int64_t at = (table[ablk] * block_size + aoff) * row_floats + head * d;
            prefetch_row(k_cache + at, d);
            prefetch_row(v_cache + at, d, true);   // into L2, for the value pass
            if (++aoff == block_size) aoff = 0, ++ablk;
        }
        for (int u = 0; u < 8; ++u) {
            if (j + u < len) {
                krow[u] = k_cache + (table[blk] * block_size + off) * row_floats + head * d;
                if (++off == block_size) off = 0, ++blk;
            } else {
                krow[u] = krow[0];
            }
        }
        if (d == 64)
            scores8<T, G, 64>(q, q_head_stride, krow, d, scale8, scores + j, stride);
        else
            scores8<T, G, 0>(q, q_head_stride, krow, d, scale8, scores + j, stride);
    }
    for (int g = 0; g < G; ++g) {
        float* sg = scores + g * stride;
        // the max over vectors, then the softmax: e^(s - max), 8 at a time, then the sum
        __m256 big8 = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= len; j += 8) big8 = _mm256_max_ps(big8, _mm256_loadu_ps(sg + j));
        float mx = hmax(big8);
        for (; j < len; ++j) mx = sg[j] > mx ? sg[j] : mx;
        __m256 sum8 = _mm256_setzero_ps();
        const __m256 m8 = _mm256_set1_ps(mx);
        j = 0;
        for (; j + 8 <= len; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), m8));
            _mm256_storeu_ps(sg + j, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum(sum8);
        for (; j < len; ++j) {
            sg[j] = std::exp(sg[j] - mx);
            sum += sg[j];
        }
        m_out[g] = mx;
        l_out[g] = sum;
    }
    // values, block by block, 8·W output lanes at a time (values8)
    for (int g = 0; g < G; ++g) std::memset(out + g * d, 0, d * sizeof(float));
    constexpr int W = G <= 3 ? 4 : 2;
    for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const T* vb = v_cache + table[(begin + j0) / block_size] * block_size * row_floats + head * d;
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        const float* p = scores + j0;
        int64_t i0 = 0;
        for (; i0 + 8 * W <= d; i0 += 8 * W) values8<T, G, W>(vb, row_floats, n, p, stride, out, d, i0);
        for (; i0 < d; i0 += 8) values8<T, G, 1>(vb, row_floats, n, p, stride, out, d, i0);
    }
}

#ifdef __AVX512F__
// The avx512 build's decode attention (head_dim a multiple of 16; else the AVX2 items above). An item is a part
// of a row with every KV head: its keys' rows are read whole (kv_heads × head_dim values, contiguous within a
// block), so each block of the pool is one run for the hardware prefetchers, instead of a head's slice every
// row. Per 16 keys and KV head, each key row widened to fp32 once for the group's query heads (vcvtph2ps, 16
// lanes, up to 4 heads a pass), each (key, query head) one 16-lane FMA chain, the 16 keys' chains folded into
// one vector of 16 scores by simd.h's shuffle tree as they finish (no horizontal sum per key); then the softmax
// over vectors (simd.h's exp16) and the value pass, 64 output lanes at a time. Both passes find their rows 16
// at a time through the block table (any block size). Each pass prefetches its own rows PF16 keys ahead into L2
// (prefetcht1), a few lines at a time between its arithmetic: the score pass a pair's two key rows' head slices
// at each pair of keys, the value pass a row's head slice at each key; the first PF16 keys' rows of each pass
// before it starts (the value pass's during the softmax). Spread, because a burst of prefetches stalls the core
// once its miss queue is full, and the arithmetic waits with it (a STREAM-like read with FMAs between its loads,
// 46 MB on one core: 16.9 GB/s prefetching one line per line read, 10.2 prefetching 96 lines at each 6 KB). On
// the Intel Xeon (2026-12-07, `bench.decode_attention`): with the two passes' prefetches all issued by the score
// pass, 16 keys' rows at once (the value rows too, for the value pass to find in L2), 30 layers at 2,000 keys from
// DRAM took 2.72 ms on two threads and 5.72 on one; spread as now 2.20 and 4.65, the rows in L2 1.49 -> 1.37; a
// one-row step at 2,000 positions 8.27 -> 7.55 ms in process (at 64 positions 5.4-5.6). The same bits (only the
// prefetches moved). The arithmetic is no faster than the AVX2 kernel's: Zen 4 runs a 512-bit FMA as two 256-bit halves, and both
// reach ~92% of the FMA rate with the rows in L2; what this kernel gains is in how it reads the pool. q8 value
// rows are widened from int8 (vpmovsxbd, vcvtdq2ps), each row's scale folded into its softmax weight.
constexpr int64_t PF16 = 16;

// at[i]: where the row of position pos + i starts in the cache (elements); positions at or past end repeat the
// first (their lanes are not used)
inline void rows16(const int64_t* table, int64_t pos, int64_t end, int64_t block_size, int64_t row_floats,
                   int64_t* at) {
    int64_t blk = pos / block_size, off = pos - blk * block_size;
    for (int i = 0; i < 16; ++i, ++pos) {
        at[i] = pos < end ? (table[blk] * block_size + off) * row_floats : at[0];
        if (++off == block_size) off = 0, ++blk;
    }
}

// G query heads' scores (heads d apart in q) of 16 keys (rows k + at[i]), times scale, into scores[g * stride];
// D: d known when compiled (0: not), so the loop over the head's 16-lane slices unrolls and the 2G sums of a pair
// stay in registers (with d a variable g++ stored them to the stack and loaded them back for every pair): 42 → 38
// ns a key at 2,000 keys, 41 → 35 at 900 keys and 4 verification rows, one thread; the same operations in the
// same order, so the same bits
// pf: 16 rows to prefetch into L2 (pf + ahead[i], pf_n elements each; none when pf is null), pair u's at pair u
template <class T, int G, int D = 0>
inline void scores16(const float* q, const T* k, const int64_t* at, int64_t d_, __m512 scale, float* scores,
                     int64_t stride, const T* pf, const int64_t* ahead, int64_t pf_n) {
    const int64_t d = D ? D : d_;
    __m512 b[2][G], c[2][G], e[2][G];   // the tree's pending levels: pairs, quads, octets of keys
    // The levels are inlined by force: g++ 12 left pair() a call for 2 and 3 heads (through the PLT, its sums
    // stored to the stack and loaded back), ~15% of the decode attention (50 → 40 ns a key at 2,000 keys, one
    // thread, the same bits)
    auto pair = [&](int u, __m512* out) __attribute__((always_inline)) {
        const T *k0 = k + at[u], *k1 = k + at[u + 1];
        if (pf) {
            prefetch_row(pf + ahead[u], pf_n, true);
            prefetch_row(pf + ahead[u + 1], pf_n, true);
        }
        __m512 s0[G], s1[G];
        for (int g = 0; g < G; ++g) s0[g] = s1[g] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            const __m512 x0 = widen16(k0 + i), x1 = widen16(k1 + i);
            for (int g = 0; g < G; ++g) {
                const __m512 qv = _mm512_loadu_ps(q + g * d + i);
                s0[g] = _mm512_fmadd_ps(qv, x0, s0[g]);
                s1[g] = _mm512_fmadd_ps(qv, x1, s1[g]);
            }
        }
        for (int g = 0; g < G; ++g) out[g] = fold2(s0[g], s1[g]);
    };
    auto quad = [&](int u, __m512* out) __attribute__((always_inline)) {
        pair(u, b[0]);
        pair(u + 2, b[1]);
        for (int g = 0; g < G; ++g) out[g] = fold4(b[0][g], b[1][g]);
    };
    auto octet = [&](int u, __m512* out) __attribute__((always_inline)) {
        quad(u, c[0]);
        quad(u + 4, c[1]);
        for (int g = 0; g < G; ++g) out[g] = fold8(c[0][g], c[1][g]);
    };
    octet(0, e[0]);
    octet(8, e[1]);
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * stride, _mm512_mul_ps(fold8(e[0][g], e[1][g]), scale));
}

// scores16 for a run of 1-4 query heads (run known only at run time)
template <class T, int D>
inline void scores16_run(int run, const float* q, const T* k, const int64_t* at, int64_t d, __m512 scale,
                         float* scores, int64_t stride, const T* pf, const int64_t* ahead, int64_t pf_n) {
    switch (run) {
        case 1: return scores16<T, 1, D>(q, k, at, d, scale, scores, stride, pf, ahead, pf_n);
        case 2: return scores16<T, 2, D>(q, k, at, d, scale, scores, stride, pf, ahead, pf_n);
        case 3: return scores16<T, 3, D>(q, k, at, d, scale, scores, stride, pf, ahead, pf_n);
        default: return scores16<T, 4, D>(q, k, at, d, scale, scores, stride, pf, ahead, pf_n);
    }
}

// out[g][i0 .. i0 + 16 W) (+)= Σ_t p[g * stride + t] · v_t over n ≤ 16 keys (rows v + at[t]); first: out not
// yet written; pf: as scores16's, row t's at key t
template <class T, int G, int W>
inline void values16(const T* v, const int64_t* at, int n, int64_t d, int64_t i0, const float* p, int64_t stride,
                     float* out, bool first, const T* pf, const int64_t* ahead, int64_t pf_n) {
    __m512 acc[G][W];
    for (int g = 0; g < G; ++g)
        for (int j = 0; j < W; ++j)
            acc[g][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + g * d + i0 + 16 * j);
    for (int t = 0; t < n; ++t) {
        const T* vr = v + at[t] + i0;
        if (pf) prefetch_row(pf + ahead[t], pf_n, true);
        const float s = kv_scale(v + at[t], d);
        __m512 x[W];
        for (int j = 0; j < W; ++j) x[j] = widen16(vr + 16 * j);
        for (int g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(is_q8<T> ? p[g * stride + t] * s : p[g * stride + t]);
            for (int j = 0; j < W; ++j) acc[g][j] = _mm512_fmadd_ps(w, x[j], acc[g][j]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int j = 0; j < W; ++j) _mm512_storeu_ps(out + g * d + i0 + 16 * j, acc[g][j]);
}

template <class T, int G>
inline void values16_w(int w, const T* v, const int64_t* at, int n, int64_t d, int64_t i0, const float* p,
                       int64_t stride, float* out, bool first, const T* pf, const int64_t* ahead, int64_t pf_n) {
    switch (w) {
        case 1: return values16<T, G, 1>(v, at, n, d, i0, p, stride, out, first, pf, ahead, pf_n);
        case 2: return values16<T, G, 2>(v, at, n, d, i0, p, stride, out, first, pf, ahead, pf_n);
        case 3: return values16<T, G, 3>(v, at, n, d, i0, p, stride, out, first, pf, ahead, pf_n);
        default: return values16<T, G, 4>(v, at, n, d, i0, p, stride, out, first, pf, ahead, pf_n);
    }
}

// e^(s - max) of one head's len scores in place, the padding to 16s 0; returns the max, the sum in *sum
inline float softmax16(float* s, int64_t len, float* sum) {
    const int64_t padded = (len + 15) & ~int64_t(15);
    const float mx = padded_max16(s, len);
    const __m512 m16 = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j += 16) {
        const __mmask16 keep = len - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - j)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m16)));
        _mm512_storeu_ps(s + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    *sum = _mm512_reduce_add_ps(acc);
    return mx;
}

// Positions begin..end-1 of one row, every KV head: q [kv_heads × group][d] (the row's query heads, contiguous)
// → out [kv_heads × group][d] = Σ e^(s - m) · v, unnormalized, with each query head's m and l (as attend_heads);
// scores: scratch of kv_heads × group × round16(end - begin) floats
template <class TK, class TV>
void attend_part16(const float* q, const TK* k_cache, const TV* v_cache, const int64_t* table, int64_t begin,
                   int64_t end, int64_t block_size, int64_t kv_heads, int64_t d, int64_t group, float scale,
                   float* out, float* m_out, float* l_out, float* scores) {
    static_assert(!is_q8<TK>, "keys are fp32 or fp16");
    const int64_t k_row = kv_heads * d, hv = head_stride<TV>(d), v_row = kv_heads * hv, len = end - begin;
    const int64_t padded = (len + 15) & ~int64_t(15);
    const __m512 sc = _mm512_set1_ps(scale);
    int64_t at[16], ahead[16];
    for (int64_t j0 = 0; j0 < len && j0 < PF16; j0 += 16) {   // the score pass's first rows
        rows16(table, begin + j0, end, block_size, k_row, ahead);
        for (int t = 0; t < 16; ++t) prefetch_row(k_cache + ahead[t], k_row, true);
    }
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const bool pf = j0 + PF16 < len;
        if (pf) rows16(table, begin + j0 + PF16, end, block_size, k_row, ahead);
        rows16(table, begin + j0, end, block_size, k_row, at);
        for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t x = h * group + g0;
                const float* qx = q + x * d;
                const TK* kh = k_cache + h * d;
                const TK* pk = pf && g0 == 0 ? kh : nullptr;   // the rows ahead: this head's slices, once
                float* sx = scores + x * padded + j0;
                const int run = int(group - g0 < 4 ? group - g0 : 4);
                if (d == 64) scores16_run<TK, 64>(run, qx, kh, at, d, sc, sx, padded, pk, ahead, d);
                else scores16_run<TK, 0>(run, qx, kh, at, d, sc, sx, padded, pk, ahead, d);
            }
    }
    for (int64_t j0 = 0; j0 < len && j0 < PF16; j0 += 16) {   // the value pass's first rows, during the softmax
        rows16(table, begin + j0, end, block_size, v_row, ahead);
        for (int t = 0; t < 16; ++t) prefetch_row(v_cache + ahead[t], v_row, true);
    }
    for (int64_t x = 0; x < kv_heads * group; ++x) m_out[x] = softmax16(scores + x * padded, len, l_out + x);
    if (len == 0) std::memset(out, 0, kv_heads * group * d * sizeof(float));
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const bool pf = j0 + PF16 < len;
        if (pf) rows16(table, begin + j0 + PF16, end, block_size, v_row, ahead);
        rows16(table, begin + j0, end, block_size, v_row, at);
        const int n = len - j0 < 16 ? int(len - j0) : 16;
        for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t x = h * group + g0;
                const TV* vh = v_cache + h * hv;
                const float* px = scores + x * padded + j0;
                for (int64_t i0 = 0; i0 < d; i0 += 64) {
                    const int w = d - i0 < 64 ? int((d - i0) / 16) : 4;
                    const TV* pv = pf && g0 == 0 && i0 == 0 ? vh : nullptr;
                    float* o = out + x * d;
                    switch (group - g0 < 4 ? group - g0 : 4) {
                        case 1: values16_w<TV, 1>(w, vh, at, n, d, i0, px, padded, o, j0 == 0, pv, ahead, hv); break;
                        case 2: values16_w<TV, 2>(w, vh, at, n, d, i0, px, padded, o, j0 == 0, pv, ahead, hv); break;
                        case 3: values16_w<TV, 3>(w, vh, at, n, d, i0, px, padded, o, j0 == 0, pv, ahead, hv); break;
                        default: values16_w<TV, 4>(w, vh, at, n, d, i0, px, padded, o, j0 == 0, pv, ahead, hv); break;
                    }
                }
            }
    }
}
#endif

// One part of one (row, KV head): the group's query heads q [group][d], in runs of up to 4 heads (each head's
// result is the same whatever run it is in)
template <class T>
void attend_part(const float* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                 const int64_t* table, int64_t begin, int64_t end, int64_t block_size, int64_t kv_heads, int64_t head,
                 int64_t d, int64_t group, float scale, float* out, float* m_out, float* l_out, float* scores) {
    const int64_t len = end - begin;
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const float* qg = q + g0 * q_head_stride;
        float *o = out + g0 * d, *m = m_out + g0, *l = l_out + g0, *sc = scores + g0 * round8(len);
        switch (group - g0 < 4 ? group - g0 : 4) {
            case 1: attend_heads<T, 1>(qg, q_head_stride, k_cache, v_cache, table, begin, end, block_size, kv_heads,
                                       head, d, scale, o, m, l, sc); break;
            case 2: attend_heads<T, 2>(qg, q_head_stride, k_cache, v_cache, table, begin, end, block_size, kv_heads,
                                       head, d, scale, o, m, l, sc); break;
            case 3: attend_heads<T, 3>(qg, q_head_stride, k_cache, v_cache, table, begin, end, block_size, kv_heads,
                                       head, d, scale, o, m, l, sc); break;
            default: attend_heads<T, 4>(qg, q_head_stride, k_cache, v_cache, table, begin, end, block_size, kv_heads,
                                        head, d, scale, o, m, l, sc); break;
        }
    }
}

// Keys per part of a long context: each row is split into parts of SPLIT keys (rounded to whole blocks), run as
// items of their own (a part × KV head each in the AVX2 code, a part with every KV head in the avx512 build's)
// and merged, so one long row keeps both threads busy. 512 measured as good as 1,024 and better than 256 for the
// avx512 build (30 layers at 448, 700 and 2,000 keys, docs/performance.md). The split depends only
// on the row's own length, never on the step or the threads: a row's result is the same alone or beside others
// (speculative verification needs it bit for bit).
constexpr int64_t SPLIT = 512;

// A step's decode items: (row, KV head, part) — (row, part) in the avx512 build — the parts of a row in order,
// and their partial results, per (part, KV head)
struct DecodePlan {
    int64_t split = 0, parts = 0, items = 0, per = 0, work = 0;
    int64_t scratch = 0;          // the scores scratch a thread needs (floats): a part's, every head, padded to 16s
    std::vector<int64_t> first;   // row b's parts are first[b] .. first[b+1]-1 (per KV head)
    std::vector<float> part_out, part_m, part_l;
    // The units the threads take, in order: unit u is part number unit_part[u] of rows unit_lo[u] .. unit_hi[u]-1
    // (those that have it), run one after another by one thread. Rows with the same block table side by side (a
    // speculating sequence's verification rows: the same keys but the last few) share a unit, so the part's
    // keys and values come from memory once and from the thread's L2 for the other rows (at 900 keys, 4 sequences
    // of 4 verification rows took 2.3x the step of 4 plain rows, nearly all of it re-reading their contexts).
    // Each row's part is the same call with the same arguments whichever unit runs it: only the order changes.
    std::vector<int64_t> unit_part, unit_lo, unit_hi;

    void build(int64_t rows, const int64_t* lens, int64_t block_size, int64_t kv_heads, int64_t group,
               int64_t head_dim, const int64_t* tables, int64_t width, int64_t threads) {
        split = SPLIT > block_size ? SPLIT / block_size * block_size : block_size;
        scratch = kv_heads * group * ((split + 15) & ~int64_t(15));
        first.assign(rows + 1, 0);
        work = 0;
        for (int64_t b = 0; b < rows; ++b) {
            work += lens[b];
            first[b + 1] = first[b] + (lens[b] > 0 ? (lens[b] + split - 1) / split : 1);
        }
        parts = first[rows];
        items = parts * kv_heads;
        per = group * head_dim;
        part_out.resize(items * per);
        part_m.resize(items * group);
        part_l.resize(items * group);
        // runs of rows with the same table, and the (run, part number) pairs they make
        std::vector<int64_t> run_lo, run_parts;
        int64_t pairs = 0;
        for (int64_t b = 0; b < rows; ++b) {
            const int64_t n = first[b + 1] - first[b];
            if (b == 0 || std::memcmp(tables + (b - 1) * width, tables + b * width, width * sizeof(int64_t))) {
                run_lo.push_back(b);
                run_parts.push_back(0);
            }
            if (n > run_parts.back()) pairs += n - run_parts.back(), run_parts.back() = n;
        }
        run_lo.push_back(rows);
        // a run's rows in as many units as keep every thread busy (two units a thread), at most one a row
        const int64_t want = 2 * (threads > 0 ? threads : 1), split_into = pairs >= want ? 1 : (want + pairs - 1) / pairs;
        unit_part.clear();
        unit_lo.clear();
        unit_hi.clear();
        for (size_t r = 0; r + 1 < run_lo.size(); ++r) {
            const int64_t lo = run_lo[r], n = run_lo[r + 1] - lo, chunks = split_into < n ? split_into : n;
            for (int64_t j = 0; j < run_parts[r]; ++j)
                for (int64_t c = 0; c < chunks; ++c) {
                    unit_part.push_back(j);
                    unit_lo.push_back(lo + n * c / chunks);
                    unit_hi.push_back(lo + n * (c + 1) / chunks);
                }
        }
    }
    int64_t units() const { return int64_t(unit_part.size()); }
};

// Every item of the plan, inside a parallel region (each thread takes items; no barrier at the end: the merge
// needs one); scores: this thread's scratch of p.scratch floats. Which kernel runs depends on the build and the
// head size only, so a row's bits are the same in the one-op and the one-call step.
template <class TK, class TV, class Share>
inline void decode_parts(DecodePlan& p, const float* q, int64_t q_stride, const TK* k_cache, const TV* v_cache,
                         int64_t kv_heads, int64_t head_dim, int64_t group, const int64_t* tables, int64_t width,
                         const int64_t* lens, int64_t block_size, float scale, float* scores, Share& share) {
#ifdef __AVX512F__
    if (head_dim % 16 == 0) {   // the avx512 build: a part with every KV head (results where its (part, head)s go)
        share.each(p.units(), [&](int64_t u) {
            for (int64_t b = p.unit_lo[u]; b < p.unit_hi[u]; ++b) {
                const int64_t pt = p.first[b] + p.unit_part[u], begin = p.unit_part[u] * p.split;
                if (pt >= p.first[b + 1]) continue;   // a shorter row of the run: not this part
                const int64_t end = begin + p.split < lens[b] ? begin + p.split : lens[b];
                attend_part16(q + b * q_stride, k_cache, v_cache, tables + b * width, begin, end, block_size, kv_heads,
                              head_dim, group, scale, p.part_out.data() + pt * kv_heads * p.per,
                              p.part_m.data() + pt * kv_heads * group, p.part_l.data() + pt * kv_heads * group, scores);
            }
        });
        return;
    }
#endif
    if constexpr (std::is_same<TK, TV>::value) {   // q8 values: the avx512 build only, head_dim % 16 == 0 (callers
                                                   // check)
        share.each(p.units() * kv_heads, [&](int64_t it) {   // a part of one KV head
            for (int64_t u = it / kv_heads, h = it % kv_heads, b = p.unit_lo[u]; b < p.unit_hi[u]; ++b) {
                const int64_t pt = p.first[b] + p.unit_part[u], begin = p.unit_part[u] * p.split;
                if (pt >= p.first[b + 1]) continue;
                const int64_t end = begin + p.split < lens[b] ? begin + p.split : lens[b], at = pt * kv_heads + h;
                attend_part(q + b * q_stride + h * group * head_dim, head_dim, k_cache, v_cache, tables + b * width,
                            begin, end, block_size, kv_heads, h, head_dim, group, scale, p.part_out.data() + at * p.per,
                            p.part_m.data() + at * group, p.part_l.data() + at * group, scores);
            }
        });
    }
}

// Each (row, KV head)'s parts merged in order, inside a parallel region (no barrier at the end):
// out = Σ e^(m_p - M) o_p / Σ e^(m_p - M) l_p
template <class Share>
inline void decode_merge(const DecodePlan& p, int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t group,
                         float* out, int64_t out_stride, Share& share) {
    share.halves(rows * kv_heads, [&](int64_t bh) {
        const int64_t b = bh / kv_heads, h = bh % kv_heads;
        for (int64_t g = 0; g < group; ++g) {
            float big = -INFINITY;
            for (int64_t pt = p.first[b]; pt < p.first[b + 1]; ++pt) {
                const float m = p.part_m[(pt * kv_heads + h) * group + g];
                big = m > big ? m : big;
            }
            float* o = out + b * out_stride + (h * group + g) * head_dim;
            float total = 0.0f;
            std::memset(o, 0, head_dim * sizeof(float));
            for (int64_t pt = p.first[b]; pt < p.first[b + 1]; ++pt) {
                const int64_t at = (pt * kv_heads + h) * group + g;
                const float w = p.part_m[at] == big ? 1.0f : std::exp(p.part_m[at] - big);   // also a part with no keys
                total += w * p.part_l[at];
                const float* op = p.part_out.data() + (pt * kv_heads + h) * p.per + g * head_dim;
                const __m256 w8 = _mm256_set1_ps(w);
                for (int64_t i = 0; i < head_dim; i += 8)
                    _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w8, _mm256_loadu_ps(op + i), _mm256_loadu_ps(o + i)));
            }
            const __m256 inv = _mm256_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);   // no keys: zeros
            for (int64_t i = 0; i < head_dim; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inv));
        }
    });
}

// one row: q and k heads rotated in place (first half: x1·cos - x2·sin; second half: x2·cos + x1·sin), then k
// and v written to slot ``slot`` of the caches
template <class TK, class TV>
inline void rope_store_row(float* row, int64_t heads, int64_t kv_heads, int64_t head_dim, const float* c,
                           const float* s, int64_t slot, TK* k_cache, TV* v_cache) {
    const int64_t half = head_dim / 2;
    for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
        float* x = row + hd * head_dim;
        for (int64_t i = 0; i < half; i += 8) {
            const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
            _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                                  _mm256_mul_ps(x2, _mm256_loadu_ps(s + i))));
            _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                                         _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i))));
        }
    }
    store_row(k_cache + slot * kv_heads * head_stride<TK>(head_dim), row + heads * head_dim, kv_heads, head_dim);
    store_row(v_cache + slot * kv_heads * head_stride<TV>(head_dim), row + (heads + kv_heads) * head_dim, kv_heads,
              head_dim);
}

// one row: hr += dr (when dr is given), o = RMSNorm(hr) · w; dim % 8 == 0
inline void add_rms_norm_row(float* hr, const float* dr, const float* w, float* o, int64_t dim, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += 8) {
        __m256 x = _mm256_loadu_ps(hr + i);
        if (dr) {
            x = _mm256_add_ps(x, _mm256_loadu_ps(dr + i));
            _mm256_storeu_ps(hr + i, x);
        }
        ss = _mm256_fmadd_ps(x, x, ss);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum(ss) / float(dim) + eps));
    for (int64_t i = 0; i < dim; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(hr + i), inv), _mm256_loadu_ps(w + i)));
}

// one row: o = silu(g) · u, g and u of inter values; inter % 8 == 0
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t inter) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < inter; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
}

}  // namespace llmserve

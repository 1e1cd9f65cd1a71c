// The native path's glue between its block matmuls, fp32, AVX2 + FMA (what quant.cpp needs as well): the same
// four functions as layer_ops.cpp / paged_attention.cpp, which need AVX-512 BF16 and run bfloat16 only.
//
// At batch 1 a decode step is per-op overhead: torch runs RMSNorm as several tensor ops, the rotary embedding
// as five, the KV write as two, SiLU · up as two, and the decode attention as a gather of the paged slots and an
// SDPA call; each op costs ~5-20 µs of dispatch for a few hundred numbers. Each function here is one call:
//   add_rms_norm   h += delta, out = h · rsqrt(mean(h²) + eps) · w;
//   rope_store     the rotary embedding on q and k in place (x·cos + rotate_half(x)·sin), then k and v written
//                  into their KV slots;
//   silu_mul       silu(gate) · up;
//   paged_decode   attention of one query row per sequence over its paged context (block tables), fp32 or fp16 KV:
//                  scores, softmax, values, per KV head with its group of query heads.
// The elementwise functions run on the calling thread (they take ~0.1 ms at 512 rows, less than an OpenMP
// region costs whenever the other core is busy); the attention spreads (row, KV head) pairs over torch's OpenMP
// threads when there is enough of it.
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
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

// 8 cache values as fp32: the KV pool is fp32 or fp16 (half the bytes a long context reads; the conversion is
// exact, so both round only where the values were stored)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// a row of n floats (n % 8 == 0) into the cache's element type
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(uint16_t* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

constexpr int64_t PF_KEYS = 16;   // keys ahead a head's score and value loops prefetch (fp16: 10.6 -> 10.4 ms
                                  // for 30 layers at 2,000 keys from DRAM; fp32 unchanged)
template <class T>
inline void prefetch_row(const T* p, int64_t d) {
    const char* c = (const char*)p;
    for (int64_t off = 0; off < d * int64_t(sizeof(T)); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// One part of one (row, KV head): the group's query heads q [group][d] over the keys at positions begin..end-1
// (begin a multiple of block_size) → out [group][d] = Σ e^(s - m) · v, unnormalized, with each head's m (the
// largest score) and l (Σ e^(s - m)); scores is scratch of group × (end - begin) floats. The keys are walked
// block by block (a block's base address once, no division per key), each key row loaded once for the whole
// group, four keys at a time per head.
template <class T>
void attend_part(const float* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                 const int64_t* table, int64_t begin, int64_t end, int64_t block_size, int64_t kv_heads, int64_t head,
                 int64_t d, int64_t group, float scale, float* out, float* m_out, float* l_out, float* scores) {
    const int64_t row_floats = kv_heads * d, len = end - begin;
    float mx[64];   // group ≤ 64: checked by the caller
    for (int64_t g = 0; g < group; ++g) mx[g] = -INFINITY;
    for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const T* kb = k_cache + table[(begin + j0) / block_size] * block_size * row_floats + head * d;
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        int64_t t = 0;
        // four keys at a time: four independent FMA chains per query head (one chain per key is latency-bound)
        for (; t + 4 <= n; t += 4) {
            const T* kr = kb + t * row_floats;
            // the keys PF_KEYS ahead (this head's rows are row_floats apart: the other heads' lie between, so the
            // hardware prefetchers miss them and each row would cost a DRAM latency)
            for (int u = 0; u < 4; ++u) prefetch_row(kr + (PF_KEYS + u) * row_floats, d);
            for (int64_t g = 0; g < group; ++g) {
                const float* qg = q + g * q_head_stride;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                       a3 = _mm256_setzero_ps();
                for (int64_t i = 0; i < d; i += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + i);
                    a0 = _mm256_fmadd_ps(qv, load8(kr + i), a0);
                    a1 = _mm256_fmadd_ps(qv, load8(kr + row_floats + i), a1);
                    a2 = _mm256_fmadd_ps(qv, load8(kr + 2 * row_floats + i), a2);
                    a3 = _mm256_fmadd_ps(qv, load8(kr + 3 * row_floats + i), a3);
                }
                float* sc = scores + g * len + j0 + t;
                sc[0] = hsum(a0) * scale;
                sc[1] = hsum(a1) * scale;
                sc[2] = hsum(a2) * scale;
                sc[3] = hsum(a3) * scale;
                for (int u = 0; u < 4; ++u) mx[g] = sc[u] > mx[g] ? sc[u] : mx[g];
            }
        }
        for (; t < n; ++t) {
            const T* kr = kb + t * row_floats;
            for (int64_t g = 0; g < group; ++g) {
                const float* qg = q + g * q_head_stride;
                __m256 a0 = _mm256_setzero_ps();
                for (int64_t i = 0; i < d; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), load8(kr + i), a0);
                const float sc = hsum(a0) * scale;
                scores[g * len + j0 + t] = sc;
                mx[g] = sc > mx[g] ? sc : mx[g];
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float* sg = scores + g * len;
        // softmax: e^(s - max), 8 at a time, then the sum
        __m256 sum8 = _mm256_setzero_ps();
        const __m256 m8 = _mm256_set1_ps(mx[g]);
        int64_t j = 0;
        for (; j + 8 <= len; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), m8));
            _mm256_storeu_ps(sg + j, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum(sum8);
        for (; j < len; ++j) {
            sg[j] = std::exp(sg[j] - mx[g]);
            sum += sg[j];
        }
        m_out[g] = mx[g];
        l_out[g] = sum;
    }
    // values, block by block: per head, its output (d ≤ 256: 32 vectors at most, 8 at a time in registers)
    // accumulated over the block's rows, which stay in L1 for the group's other heads
    for (int64_t g = 0; g < group; ++g) std::memset(out + g * d, 0, d * sizeof(float));
    for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const T* vb = v_cache + table[(begin + j0) / block_size] * block_size * row_floats + head * d;
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        for (int64_t g = 0; g < group; ++g) {
            const float* pg = scores + g * len + j0;
            float* og = out + g * d;
            for (int64_t i0 = 0; i0 < d; i0 += 64) {
                const int64_t w = d - i0 < 64 ? (d - i0) / 8 : 8;
                __m256 acc[8];
                for (int64_t v = 0; v < w; ++v) acc[v] = _mm256_loadu_ps(og + i0 + 8 * v);
                for (int64_t t = 0; t < n; ++t) {
                    const __m256 p = _mm256_set1_ps(pg[t]);
                    const T* vr = vb + t * row_floats + i0;
                    if (g == 0 && i0 == 0) prefetch_row(vr + PF_KEYS * row_floats, d);
                    for (int64_t v = 0; v < w; ++v) acc[v] = _mm256_fmadd_ps(p, load8(vr + 8 * v), acc[v]);
                }
                for (int64_t v = 0; v < w; ++v) _mm256_storeu_ps(og + i0 + 8 * v, acc[v]);
            }
        }
    }
}

// Keys per part of a long context: each (row, KV head) is split into parts of SPLIT keys (rounded to whole
// blocks), run as items of their own and merged, so one long row keeps both threads busy. The split depends only
// on the row's own length, never on the step or the threads: a row's result is the same alone or beside others
// (speculative verification needs it bit for bit).
constexpr int64_t SPLIT = 512;

template <class T>
int paged_decode(const float* q, int64_t q_stride, int64_t rows, const T* k_cache, const T* v_cache, int64_t kv_heads,
                 int64_t head_dim, int64_t group, const int64_t* tables, int64_t width, const int64_t* lens,
                 int64_t block_size, float scale, float* out, int64_t out_stride) {
    if (head_dim % 8 != 0 || head_dim > 256 || group > 64) return 1;
    const int64_t split = SPLIT > block_size ? SPLIT / block_size * block_size : block_size;
    // items: (row, KV head, part), parts of a row in order
    std::vector<int64_t> first(rows + 1, 0);   // row b's parts are first[b] .. first[b+1]-1 (per KV head)
    std::vector<int64_t> owner;                // the row of each part
    int64_t work = 0;
    for (int64_t b = 0; b < rows; ++b) {
        work += lens[b];
        first[b + 1] = first[b] + (lens[b] > 0 ? (lens[b] + split - 1) / split : 1);
        owner.insert(owner.end(), first[b + 1] - first[b], b);
    }
    const int64_t parts = first[rows], items = parts * kv_heads, per = group * head_dim;
    std::vector<float> part_out(items * per), part_m(items * group), part_l(items * group);
#pragma omp parallel if (work * kv_heads * group * head_dim >= (1 << 19))
    {
        std::vector<float> scores(group * split);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t pt = it / kv_heads, h = it % kv_heads, b = owner[pt];
            const int64_t begin = (pt - first[b]) * split, end = begin + split < lens[b] ? begin + split : lens[b];
            attend_part(q + b * q_stride + h * group * head_dim, head_dim, k_cache, v_cache, tables + b * width,
                        begin, end, block_size, kv_heads, h, head_dim, group, scale, part_out.data() + it * per,
                        part_m.data() + it * group, part_l.data() + it * group, scores.data());
        }
        // merge each (row, KV head)'s parts, in order: out = Σ e^(m_p - M) o_p / Σ e^(m_p - M) l_p
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < rows * kv_heads; ++bh) {
            const int64_t b = bh / kv_heads, h = bh % kv_heads;
            for (int64_t g = 0; g < group; ++g) {
                float big = -INFINITY;
                for (int64_t pt = first[b]; pt < first[b + 1]; ++pt) {
                    const float m = part_m[(pt * kv_heads + h) * group + g];
                    big = m > big ? m : big;
                }
                float* o = out + b * out_stride + (h * group + g) * head_dim;
                float total = 0.0f;
                std::memset(o, 0, head_dim * sizeof(float));
                for (int64_t pt = first[b]; pt < first[b + 1]; ++pt) {
                    const int64_t at = (pt * kv_heads + h) * group + g;
                    const float w = part_m[at] == big ? 1.0f : std::exp(part_m[at] - big);   // also a part with no keys
                    total += w * part_l[at];
                    const float* op = part_out.data() + (pt * kv_heads + h) * per + g * head_dim;
                    const __m256 w8 = _mm256_set1_ps(w);
                    for (int64_t i = 0; i < head_dim; i += 8)
                        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w8, _mm256_loadu_ps(op + i), _mm256_loadu_ps(o + i)));
                }
                const __m256 inv = _mm256_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);   // no keys: zeros
                for (int64_t i = 0; i < head_dim; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inv));
            }
        }
    }
    return 0;
}

template <class T>
void rope_store(float* qkv, int64_t qkv_stride, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const float* cos, const float* sin, const int64_t* slots, T* k_cache, T* v_cache) {
    const int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; ++r) {
        float* row = qkv + r * qkv_stride;
        const float* c = cos + r * head_dim;
        const float* s = sin + r * head_dim;
        for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
            float* x = row + hd * head_dim;
            for (int64_t i = 0; i < half; i += 8) {
                const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
                // first half: x1·cos - x2·sin; second half: x2·cos + x1·sin
                _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                                      _mm256_mul_ps(x2, _mm256_loadu_ps(s + i))));
                _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                                             _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i))));
            }
        }
        store_row(k_cache + slots[r] * kv_heads * head_dim, row + heads * head_dim, kv_heads * head_dim);
        store_row(v_cache + slots[r] * kv_heads * head_dim, row + (heads + kv_heads) * head_dim, kv_heads * head_dim);
    }
}

}  // namespace

extern "C" {

// h: [rows, dim] (row stride h_stride), updated to h + delta when delta is given (row stride delta_stride);
// out: [rows, dim] contiguous; dim % 8 == 0
void llmserve_f32_add_rms_norm(float* h, int64_t h_stride, const float* delta, int64_t delta_stride,
                               const float* w, float* out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        float* hr = h + r * h_stride;
        const float* dr = delta ? delta + r * delta_stride : nullptr;
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
        float* o = out + r * dim;
        for (int64_t i = 0; i < dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(hr + i), inv), _mm256_loadu_ps(w + i)));
    }
}

// qkv: [rows, (heads + 2 kv_heads) * head_dim] (row stride qkv_stride): q heads, k heads, v heads;
// cos, sin: [rows, head_dim] contiguous; q and k rotated in place, then k and v written to slot slots[r] of the
// caches ([slots, kv_heads, head_dim]; fp32, or fp16 rounded to nearest: f16_); head_dim % 16 == 0
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

// gate_up: [rows, 2 * inter] (gate | up); out: [rows, inter] = silu(gate) · up; inter % 8 == 0
void llmserve_f32_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        for (int64_t i = 0; i < inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
}

// Decode attention: row b's query q [rows, heads, head_dim] (row stride q_stride, heads contiguous) attends to
// the first lens[b] positions of block table b (tables [rows, width], int64), into out [rows, heads, head_dim]
// (row stride out_stride). Caches [slots, kv_heads, head_dim], fp32 (f32_) or fp16 (f16_). Returns 0; 1 when
// head_dim is not a multiple of 8 up to 256 or more than 64 query heads share a KV head.
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

}

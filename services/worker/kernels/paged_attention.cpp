// Attention over the paged KV pool, bfloat16, AVX-512 (avx512f/bw/vl + avx512_bf16).
//
// Every query row of a step (a decode row, or one token of a prefill chunk) attends causally over its
// own sequence's first positions, read in place from the paged slots its block table names: no gather,
// no padding, one call per layer for the whole step. Its G query heads per KV head share each key read.
// Per (row, KV head):
//   1. scores: q·k for 16 keys at a time with vdpbf16ps (bf16 pairs, fp32 sums), the 16 partial
//      vectors folded into one vector of 16 scores by a shuffle tree (no horizontal sum per key);
//   2. softmax in fp32 (simd.h's vector exp);
//   3. the weighted sum of the value rows in fp32, rounded to bf16 once at the end.
// Sequences (and parts of a long one, merged by their maxima and sums) are spread over OpenMP threads.
// Plain C ABI, called through ctypes. Built with -fopenmp against libgomp.so.1, which is the copy torch
// has already loaded, so the worker's compute thread reuses torch's own thread team.
#include "simd.h"

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#include <omp.h>

namespace {

using namespace llmserve;

// How far ahead of the keys being read their rows are requested from memory.
constexpr int64_t PREFETCH_KEYS = 32;

inline void prefetch_row(const bf16* row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)row + b, _MM_HINT_T0);
}

struct Args {
    const bf16* q;
    int64_t q_row_stride;
    const int64_t* row_seq;    // [n] which table (NULL = row b uses table b)
    int64_t n;
    const bf16* k;
    const bf16* v;
    int64_t kv_heads;
    const int64_t* tables;
    int64_t table_width;
    const int64_t* ctx_lens;
    int64_t block_size;
    float scale;
    bf16* out;
    int64_t out_row_stride;
};

// Walks a sequence's positions through its block table without a division per key.
struct SlotCursor {
    const int64_t* table;
    int64_t block_size, block, offset;
    int64_t next() {
        int64_t slot = table[block] * block_size + offset;
        if (++offset == block_size) { offset = 0; ++block; }
        return slot;
    }
};

// Keys [begin, end) of one sequence's decode row, every KV head, unnormalized: per query head its
// running max m, its sum l of e^(s - m) and acc = Σ e^(s - m) · v, all fp32.
// NV: head_dim / 32 (bf16 pairs per zmm); G: query heads per KV head.
template <int NV, int G>
void attend_part(const bf16* q, const bf16* k, const bf16* v, int64_t kv_heads, const int64_t* table, int64_t begin,
                 int64_t end, int64_t block_size, float scale, float* acc, float* m_out, float* l_out,
                 std::vector<float>& buf) {
    constexpr int D = NV * 32;
    const int64_t slot_stride = kv_heads * D;
    const int64_t row_bytes = slot_stride * int64_t(sizeof(bf16));
    const int64_t n = end - begin;
    const int64_t padded = (n + 15) & ~int64_t(15);
    buf.resize(size_t(kv_heads) * G * padded);
    float* scores = buf.data();
    // 1. scores, 16 keys at a time (each key row read once, for all heads)
    SlotCursor cur{table, block_size, begin / block_size, begin % block_size};
    SlotCursor ahead = cur;
    int64_t fetched = 0;
    const bf16* rows[16];
    for (int64_t p0 = 0; p0 < n; p0 += 16) {
        for (; fetched < n && fetched < p0 + PREFETCH_KEYS; ++fetched) {
            const int64_t slot = ahead.next();   // the value rows too: pass 3 then reads them from cache
            prefetch_row(k + slot * slot_stride, row_bytes);
            prefetch_row(v + slot * slot_stride, row_bytes);
        }
        for (int i = 0; i < 16; ++i) rows[i] = p0 + i < n ? k + cur.next() * slot_stride : rows[0];
        for (int64_t h = 0; h < kv_heads; ++h) {
            for (int g = 0; g < G; ++g) {
                const bf16* qh = q + (h * G + g) * D;
                __m512bh qv[NV];
                for (int j = 0; j < NV; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qh + j * 32);
                __m512 a[16];
                for (int i = 0; i < 16; ++i) {
                    const bf16* kr = rows[i] + h * D;
                    a[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(kr), qv[0]);
                    for (int j = 1; j < NV; ++j)
                        a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(kr + j * 32), qv[j]);
                }
                _mm512_storeu_ps(scores + (h * G + g) * padded + p0, _mm512_mul_ps(fold16(a), _mm512_set1_ps(scale)));
            }
        }
    }
    // 2. e^(s - max) of each query head's scores
    for (int64_t hg = 0; hg < kv_heads * G; ++hg) {
        float* s = scores + hg * padded;
        for (int64_t p = n; p < padded; ++p) s[p] = -INFINITY;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t p = 0; p < padded; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + p));
        const float mx = _mm512_reduce_max_ps(m);
        const __m512 mxv = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < padded; p += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), mxv));
            _mm512_storeu_ps(s + p, e);
            sum = _mm512_add_ps(sum, e);
        }
        m_out[hg] = mx;
        l_out[hg] = _mm512_reduce_add_ps(sum);
    }
    // 3. weighted sum of the value rows, 64 keys at a time (each row read once, for all heads)
    std::memset(acc, 0, sizeof(float) * kv_heads * G * D);
    SlotCursor vcur{table, block_size, begin / block_size, begin % block_size};
    SlotCursor vahead = vcur;
    fetched = 0;
    constexpr int CHUNK = 64;
    const bf16* vrows[CHUNK];
    for (int64_t p0 = 0; p0 < n; p0 += CHUNK) {
        for (; fetched < n && fetched < p0 + CHUNK + PREFETCH_KEYS; ++fetched)
            prefetch_row(v + vahead.next() * slot_stride, row_bytes);
        const int nk = int(n - p0 < CHUNK ? n - p0 : CHUNK);
        for (int i = 0; i < nk; ++i) vrows[i] = v + vcur.next() * slot_stride;
        for (int64_t h = 0; h < kv_heads; ++h) {
            __m512 a[G][2 * NV];
            float* ah = acc + h * G * D;
            for (int g = 0; g < G; ++g)
                for (int j = 0; j < 2 * NV; ++j) a[g][j] = _mm512_loadu_ps(ah + g * D + j * 16);
            const float* sh = scores + h * G * padded + p0;
            for (int i = 0; i < nk; ++i) {
                __m512 vr[2 * NV];
                for (int j = 0; j < 2 * NV; ++j) vr[j] = load16(vrows[i] + h * D + j * 16);
                for (int g = 0; g < G; ++g) {
                    const __m512 w = _mm512_set1_ps(sh[g * padded + i]);
                    for (int j = 0; j < 2 * NV; ++j) a[g][j] = _mm512_fmadd_ps(w, vr[j], a[g][j]);
                }
            }
            for (int g = 0; g < G; ++g)
                for (int j = 0; j < 2 * NV; ++j) _mm512_storeu_ps(ah + g * D + j * 16, a[g][j]);
        }
    }
}

// acc / l, rounded to bf16: one query head's output
template <int D>
inline void store_normalized(const float* acc, float l, bf16* out) {
    const __m512 inv = _mm512_set1_ps(1.0f / l);
    for (int j = 0; j < D / 16; ++j)
        store16(out + j * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + j * 16), inv));
}

// A row with at least this many keys per part is split across threads when there are fewer rows than
// threads to keep busy; the parts are merged by their maxima and sums.
constexpr int64_t MIN_PART_KEYS = 256;

template <int NV, int G>
void attend_rows(const Args& a) {
    constexpr int D = NV * 32;
    const int64_t hg = a.kv_heads * G, n = a.n;
    const int threads = omp_get_max_threads();
    // Work items: (row, part). Rows are split only while there are fewer rows than 2 per thread.
    std::vector<int64_t> first(n + 1), parts(n);
    int64_t total_keys = 0;
    for (int64_t b = 0; b < n; ++b) total_keys += a.ctx_lens[b];
    for (int64_t b = 0; b < n; ++b) {
        int64_t p = 1;
        if (n < 2 * threads) {  // a share of the threads proportional to this row's keys
            const int64_t want = (2 * threads * a.ctx_lens[b] + total_keys - 1) / total_keys;
            p = std::max<int64_t>(1, std::min<int64_t>(want, a.ctx_lens[b] / MIN_PART_KEYS));
        }
        parts[b] = p;
        first[b + 1] = first[b] + p;
    }
    const int64_t items = first[n];
    const bool split = items > n;
    std::vector<float> part_acc(split ? size_t(items) * hg * D : 0), part_ml(split ? size_t(items) * hg * 2 : 0);
    std::vector<int64_t> item_row(items);
    for (int64_t b = 0; b < n; ++b)
        for (int64_t i = first[b]; i < first[b + 1]; ++i) item_row[i] = b;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
    for (int64_t it = 0; it < items; ++it) {
        static thread_local std::vector<float> buf, acc, ml;
        const int64_t b = item_row[it], p = it - first[b], len = a.ctx_lens[b];
        const int64_t begin = len * p / parts[b], end = len * (p + 1) / parts[b];
        const int64_t* table = a.tables + (a.row_seq ? a.row_seq[b] : b) * a.table_width;
        float *acc_p, *m_p, *l_p;
        if (split) {
            acc_p = part_acc.data() + it * hg * D, m_p = part_ml.data() + it * hg * 2, l_p = m_p + hg;
        } else {
            acc.resize(hg * D), ml.resize(hg * 2);
            acc_p = acc.data(), m_p = ml.data(), l_p = m_p + hg;
        }
        attend_part<NV, G>(a.q + b * a.q_row_stride, a.k, a.v, a.kv_heads, table, begin, end, a.block_size, a.scale,
                           acc_p, m_p, l_p, buf);
        if (!split)
            for (int64_t x = 0; x < hg; ++x) store_normalized<D>(acc_p + x * D, l_p[x], a.out + b * a.out_row_stride + x * D);
    }
    if (!split) return;
    // merge each row's parts: out = Σ e^(m_p - M) acc_p / Σ e^(m_p - M) l_p, rounded to bf16 once
    std::vector<float> merged(D);
    for (int64_t b = 0; b < n; ++b) {
        bf16* o = a.out + b * a.out_row_stride;
        for (int64_t x = 0; x < hg; ++x) {
            float mx = -INFINITY, l = 0;
            for (int64_t i = first[b]; i < first[b + 1]; ++i) mx = std::max(mx, part_ml[i * hg * 2 + x]);
            __m512 sum[D / 16];
            for (int j = 0; j < D / 16; ++j) sum[j] = _mm512_setzero_ps();
            for (int64_t i = first[b]; i < first[b + 1]; ++i) {
                const float w = std::exp(part_ml[i * hg * 2 + x] - mx);
                l += w * part_ml[i * hg * 2 + hg + x];
                const float* pa = part_acc.data() + (i * hg + x) * D;
                for (int j = 0; j < D / 16; ++j)
                    sum[j] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(pa + j * 16), sum[j]);
            }
            for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(merged.data() + j * 16, sum[j]);
            store_normalized<D>(merged.data(), l, o + x * D);
        }
    }
}

using Fn = void (*)(const Args&);

template <int NV>
Fn pick_g(int64_t g) {
    switch (g) {
        case 1: return attend_rows<NV, 1>;
        case 2: return attend_rows<NV, 2>;
        case 3: return attend_rows<NV, 3>;
        case 4: return attend_rows<NV, 4>;
        case 5: return attend_rows<NV, 5>;
        case 6: return attend_rows<NV, 6>;
        case 7: return attend_rows<NV, 7>;
        case 8: return attend_rows<NV, 8>;
        default: return nullptr;
    }
}

Fn pick(int64_t head_dim, int64_t g) {
    switch (head_dim) {
        case 64: return pick_g<2>(g);
        case 128: return pick_g<4>(g);
        default: return nullptr;
    }
}

}  // namespace

extern "C" {

// 1 if this build handles head_dim and the group size (query heads per KV head)
int llmserve_paged_attention_supports(int64_t head_dim, int64_t group) { return pick(head_dim, group) != nullptr; }

// q: query rows [*, kv_heads * group, head_dim] (row stride q_row_stride elements, heads contiguous);
// n rows, each attending causally to its first ctx_lens[b] positions into row b of out, row_seq[b] its
// block table (NULL = b); k, v: one layer's pool [slots, kv_heads, head_dim];
// tables: [*, table_width] block ids. A decode row is one row; a prefill chunk is one row per token.
int llmserve_paged_attention(const bf16* q, int64_t q_row_stride, const int64_t* row_seq,
                              int64_t n, const bf16* k, const bf16* v, int64_t kv_heads, int64_t head_dim,
                              int64_t group, const int64_t* tables, int64_t table_width, const int64_t* ctx_lens,
                              int64_t block_size, float scale, bf16* out, int64_t out_row_stride) {
    Fn fn = pick(head_dim, group);
    if (!fn) return -1;
    fn(Args{q, q_row_stride, row_seq, n, k, v, kv_heads, tables, table_width, ctx_lens, block_size, scale, out,
            out_row_stride});
    return 0;
}

}

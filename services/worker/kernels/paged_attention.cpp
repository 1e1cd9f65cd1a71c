// Attention over the paged KV pool, bfloat16, AVX-512 (avx512f/bw/vl + avx512_bf16).
//
// Every query row of a step (a decode row, or one token of a prefill chunk) attends causally over its
// own sequence's first positions, read in place from the paged slots its block table names: no gather,
// no padding, one call per layer for the whole step. Its G query heads per KV head share each key read.
// Per (row, KV head):
//   1. scores: q·k for 16 keys at a time with vdpbf16ps (bf16 pairs, fp32 sums), the 16 partial
//      vectors folded into one vector of 16 scores by a shuffle tree (no horizontal sum per key);
//   2. softmax in fp32 (simd.h's vector exp);
//   3. the weighted sum of the value rows: the weights rounded to bf16, two value rows interleaved and
//      summed by vdpbf16ps in fp32, rounded to bf16 once at the end.
// The tokens of a prefill chunk go in tiles of 16 rows instead (attend_tile): the rows share each tile of
// keys and values as a small matrix product with vdpbf16ps, so a key row is read once per tile, not once per
// query row, and no partial sums are folded (a 512-token chunk over 2,000 positions: attention 2x faster).
// Rows, tiles and parts of a long row (merged by their maxima and sums) are spread over OpenMP threads.
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

// The value pass by vdpbf16ps (attend_part, attend_tile) interleaves two value rows' bf16 with unpacklo/hi,
// so lane (i, t) of a 32-dim slice's lo / hi sum holds dim 8i + t / 8i + 4 + t: put back in order, in place.
template <int NV>
inline void unpermute_pairs(float* ax) {
    for (int j = 0; j < NV; ++j) {
        alignas(64) float lo[16], hi[16];
        std::memcpy(lo, ax + j * 32, sizeof lo);
        std::memcpy(hi, ax + j * 32 + 16, sizeof hi);
        for (int i = 0; i < 4; ++i)
            for (int t = 0; t < 4; ++t) ax[j * 32 + 8 * i + t] = lo[4 * i + t], ax[j * 32 + 8 * i + 4 + t] = hi[4 * i + t];
    }
}

// Softmax weights of one query head over its first n scores: s[n, round16(n)) set to -inf, then
// w[p] = e^(s[p] - max) rounded to bf16 for p < round16(n); returns the max, and the sum of the weights
// as rounded (what the value pass multiplies by) in *sum.
inline float softmax_weights(float* s, int64_t n, bf16* w, float* sum) {
    const int64_t padded = (n + 15) & ~int64_t(15);
    const float mx = padded_max16(s, n);
    const __m512 mxv = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < padded; p += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), mxv));
        store16(w + p, e);
        acc = _mm512_add_ps(acc, round16(e));
    }
    *sum = _mm512_reduce_add_ps(acc);
    return mx;
}

// Keys [begin, end) of one sequence's decode row, every KV head, unnormalized: per query head its
// running max m, its sum l of e^(s - m) and acc = Σ e^(s - m) · v, all fp32.
// NV: head_dim / 32 (bf16 pairs per zmm); G: query heads per KV head.
template <int NV, int G>
void attend_part(const bf16* q, const bf16* k, const bf16* v, int64_t kv_heads, const int64_t* table, int64_t begin,
                 int64_t end, int64_t block_size, float scale, float* acc, float* m_out, float* l_out,
                 std::vector<float>& buf, std::vector<bf16>& wbuf) {
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
    // 2. e^(s - max) of each query head's scores, rounded to bf16 for pass 3 (l sums them as rounded)
    wbuf.resize(size_t(kv_heads) * G * padded);
    for (int64_t hg = 0; hg < kv_heads * G; ++hg)
        m_out[hg] = softmax_weights(scores + hg * padded, n, wbuf.data() + hg * padded, l_out + hg);
    // 3. weighted sum of the value rows, two keys at a time by vdpbf16ps (as in attend_tile), per KV head
    //    its G query heads' sums in registers over a chunk of keys
    SlotCursor vcur{table, block_size, begin / block_size, begin % block_size};
    SlotCursor vahead = vcur;
    fetched = 0;
    constexpr int CHUNK = 64;
    const bf16* vrows[CHUNK + 1];
    std::memset(acc, 0, sizeof(float) * kv_heads * G * D);
    const int32_t* wp = (const int32_t*)wbuf.data();
    const int64_t pp = padded / 2;
    for (int64_t p0 = 0; p0 < n; p0 += CHUNK) {
        for (; fetched < n && fetched < p0 + CHUNK + PREFETCH_KEYS; ++fetched)
            prefetch_row(v + vahead.next() * slot_stride, row_bytes);
        const int nk = int(n - p0 < CHUNK ? n - p0 : CHUNK);
        for (int i = 0; i < nk; ++i) vrows[i] = v + vcur.next() * slot_stride;
        vrows[nk] = vrows[0];   // an odd last key's partner: weight 0
        for (int64_t h = 0; h < kv_heads; ++h) {
            __m512 a[G][2 * NV];
            float* ah = acc + h * G * D;
            for (int g = 0; g < G; ++g)
                for (int j = 0; j < 2 * NV; ++j) a[g][j] = _mm512_loadu_ps(ah + g * D + j * 16);
            const int32_t* wh = wp + h * G * pp + p0 / 2;
            for (int i = 0; i < nk; i += 2) {
                __m512bh lo[NV], hi[NV];
                for (int j = 0; j < NV; ++j) {
                    const __m512i x = _mm512_loadu_si512(vrows[i] + h * D + j * 32);
                    const __m512i y = _mm512_loadu_si512(vrows[i + 1] + h * D + j * 32);
                    lo[j] = (__m512bh)_mm512_unpacklo_epi16(x, y);
                    hi[j] = (__m512bh)_mm512_unpackhi_epi16(x, y);
                }
                for (int g = 0; g < G; ++g) {
                    const __m512bh w = (__m512bh)_mm512_set1_epi32(wh[g * pp + i / 2]);
                    for (int j = 0; j < NV; ++j) {
                        a[g][2 * j] = _mm512_dpbf16_ps(a[g][2 * j], lo[j], w);
                        a[g][2 * j + 1] = _mm512_dpbf16_ps(a[g][2 * j + 1], hi[j], w);
                    }
                }
            }
            for (int g = 0; g < G; ++g)
                for (int j = 0; j < 2 * NV; ++j) _mm512_storeu_ps(ah + g * D + j * 16, a[g][j]);
        }
    }
    for (int64_t x = 0; x < kv_heads * G; ++x) unpermute_pairs<NV>(acc + x * D);
}

// acc / l, rounded to bf16: one query head's output
template <int D>
inline void store_normalized(const float* acc, float l, bf16* out) {
    const __m512 inv = _mm512_set1_ps(1.0f / l);
    for (int j = 0; j < D / 16; ++j)
        store16(out + j * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + j * 16), inv));
}

// Query rows [b0, b0 + R) of one sequence at consecutive positions (tokens of a prefill chunk): row r
// attends to keys [0, len0 + r). Unlike attend_part, which folds each key's partial sums per row, the rows
// share every tile of keys as a small matrix product with vdpbf16ps (the key tile transposed once into
// pairs of dims, each query pair broadcast), and the values likewise (two value rows interleaved, the pair
// of weights broadcast); a key row is read once per tile instead of once per query row.
constexpr int TILE_ROWS = 16;

struct alignas(64) Zmm { __m512i v; };   // a vector element 64-byte aligned (C++17 aligned new)

template <int NV, int G>
void attend_tile(const Args& a, int64_t b0, int R, std::vector<float>& sbuf, std::vector<bf16>& wbuf,
                 std::vector<uint32_t>& kt, std::vector<float>& accbuf, std::vector<Zmm>& vi, std::vector<float>& l) {
    constexpr int D = NV * 32, DP = D / 2;   // DP: pairs of dims
    const int64_t H = a.kv_heads, HG = H * G;
    const int64_t len0 = a.ctx_lens[b0], n = len0 + R - 1;   // the last row's keys
    const int64_t padded = (n + 15) & ~int64_t(15);
    const int64_t* table = a.tables + a.row_seq[b0] * a.table_width;
    const int64_t slot_stride = H * D;
    const int64_t row_bytes = slot_stride * int64_t(sizeof(bf16));
    const uint32_t* qp[TILE_ROWS];   // each row's query as pairs of dims (rows past R repeat row 0: discarded)
    for (int r = 0; r < TILE_ROWS; ++r) qp[r] = (const uint32_t*)(a.q + (b0 + (r < R ? r : 0)) * a.q_row_stride);
    sbuf.resize(size_t(R) * HG * padded);
    kt.resize(size_t(H) * DP * 16);
    // 1. scores of 16 keys at a time for every row and query head
    SlotCursor cur{table, a.block_size, 0, 0};
    SlotCursor ahead = cur;
    int64_t fetched = 0;
    for (int64_t p0 = 0; p0 < n; p0 += 16) {
        for (; fetched < n && fetched < p0 + 16 + PREFETCH_KEYS; ++fetched) prefetch_row(a.k + ahead.next() * slot_stride, row_bytes);
        for (int k = 0; k < 16; ++k) {   // kt[h][dp][k] = pair dp of key k's head h
            if (p0 + k < n) {
                const uint32_t* row = (const uint32_t*)(a.k + cur.next() * slot_stride);
                for (int64_t h = 0; h < H; ++h)
                    for (int dp = 0; dp < DP; ++dp) kt[(h * DP + dp) * 16 + k] = row[h * DP + dp];
            } else {
                for (int64_t h = 0; h < H; ++h)
                    for (int dp = 0; dp < DP; ++dp) kt[(h * DP + dp) * 16 + k] = 0;
            }
        }
        for (int64_t h = 0; h < H; ++h) {
            const uint32_t* kth = kt.data() + h * DP * 16;
            for (int g = 0; g < G; ++g) {
                const int64_t x = h * G + g;
                __m512 acc[TILE_ROWS];
                for (int r = 0; r < TILE_ROWS; ++r) acc[r] = _mm512_setzero_ps();
                for (int dp = 0; dp < DP; ++dp) {
                    const __m512bh kv = (__m512bh)_mm512_loadu_si512(kth + dp * 16);
                    for (int r = 0; r < TILE_ROWS; ++r)
                        acc[r] = _mm512_dpbf16_ps(acc[r], kv, (__m512bh)_mm512_set1_epi32(qp[r][x * DP + dp]));
                }
                for (int r = 0; r < R; ++r)
                    _mm512_storeu_ps(sbuf.data() + (r * HG + x) * padded + p0, _mm512_mul_ps(acc[r], _mm512_set1_ps(a.scale)));
            }
        }
    }
    // 2. softmax weights of each row over its own keys, rounded to bf16 (0 past them); l sums them as rounded
    wbuf.resize(size_t(R) * HG * padded);
    l.resize(size_t(R) * HG);
    for (int r = 0; r < R; ++r) {
        const int64_t len = len0 + r, pr = (len + 15) & ~int64_t(15);
        for (int64_t x = 0; x < HG; ++x) {
            bf16* w = wbuf.data() + (r * HG + x) * padded;
            softmax_weights(sbuf.data() + (r * HG + x) * padded, len, w, &l[r * HG + x]);
            std::memset(w + pr, 0, sizeof(bf16) * (padded - pr));
        }
    }
    // 3. weighted sum of the values, two keys at a time: the two rows' bf16 interleaved (unpacklo/hi), times
    //    the pair of weights broadcast (sums in unpermute_pairs' order).
    accbuf.assign(size_t(R) * HG * D, 0.0f);
    constexpr int CHUNK = 32;   // keys per chunk of interleaved values
    vi.resize(size_t(CHUNK / 2) * H * 2 * NV);   // [pair][kv head][lo/hi of each 32-dim slice]
    const int32_t* wp = (const int32_t*)wbuf.data();
    SlotCursor vcur{table, a.block_size, 0, 0};
    const int64_t pairs_padded = padded / 2;
    for (int64_t p0 = 0; p0 < n; p0 += CHUNK) {
        const int nk = int(n - p0 < CHUNK ? n - p0 : CHUNK);
        const bf16* vrows[CHUNK + 1];
        for (int i = 0; i < nk; ++i) vrows[i] = a.v + vcur.next() * slot_stride;
        vrows[nk] = vrows[0];   // an odd last key's partner: weight 0
        const int np = (nk + 1) / 2;
        for (int i = 0; i < np; ++i)
            for (int64_t h = 0; h < H; ++h)
                for (int j = 0; j < NV; ++j) {
                    const __m512i x = _mm512_loadu_si512(vrows[2 * i] + h * D + j * 32);
                    const __m512i y = _mm512_loadu_si512(vrows[2 * i + 1] + h * D + j * 32);
                    vi[(i * H + h) * 2 * NV + 2 * j].v = _mm512_unpacklo_epi16(x, y);
                    vi[(i * H + h) * 2 * NV + 2 * j + 1].v = _mm512_unpackhi_epi16(x, y);
                }
        for (int r = 0; r < R; ++r) {
            if (p0 >= len0 + r) continue;   // past this row's keys
            for (int64_t h = 0; h < H; ++h) {
                float* ar = accbuf.data() + (r * HG + h * G) * D;
                __m512 acc[G][2 * NV];
                for (int g = 0; g < G; ++g)
                    for (int j = 0; j < 2 * NV; ++j) acc[g][j] = _mm512_loadu_ps(ar + g * D + j * 16);
                const int32_t* wr = wp + (r * HG + h * G) * pairs_padded + p0 / 2;
                for (int i = 0; i < np; ++i)
                    for (int g = 0; g < G; ++g) {
                        const __m512bh w = (__m512bh)_mm512_set1_epi32(wr[g * pairs_padded + i]);
                        for (int j = 0; j < 2 * NV; ++j) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], (__m512bh)vi[(i * H + h) * 2 * NV + j].v, w);
                    }
                for (int g = 0; g < G; ++g)
                    for (int j = 0; j < 2 * NV; ++j) _mm512_storeu_ps(ar + g * D + j * 16, acc[g][j]);
            }
        }
    }
    // back in order, divided by l, rounded to bf16 once
    for (int r = 0; r < R; ++r) {
        bf16* o = a.out + (b0 + r) * a.out_row_stride;
        for (int64_t x = 0; x < HG; ++x) {
            float* ax = accbuf.data() + (r * HG + x) * D;
            unpermute_pairs<NV>(ax);
            store_normalized<D>(ax, l[r * HG + x], o + x * D);
        }
    }
}

// A row with at least this many keys per part is split across threads when there are fewer rows than
// threads to keep busy; the parts are merged by their maxima and sums.
constexpr int64_t MIN_PART_KEYS = 256;

template <int NV, int G>
void attend_rows(const Args& a) {
    constexpr int D = NV * 32;
    const int64_t hg = a.kv_heads * G, n = a.n;
    const int threads = omp_get_max_threads();
    // Rows of one sequence at consecutive positions (a prefill chunk) go in tiles of up to TILE_ROWS;
    // tile[b]: the rows of the tile row b starts, 1 for a row alone, 0 for a row inside a tile.
    std::vector<int> tile(n, 1);
    int64_t units = 0, total_keys = 0;
    for (int64_t b = 0; b < n; ++units) {
        int64_t e = b + 1;
        while (a.row_seq && e < n && e - b < TILE_ROWS && a.row_seq[e] == a.row_seq[b] &&
               a.ctx_lens[e] == a.ctx_lens[e - 1] + 1)
            ++e;
        tile[b] = int(e - b);
        for (int64_t i = b + 1; i < e; ++i) tile[i] = 0;
        total_keys += a.ctx_lens[b];
        b = e;
    }
    // Work items: a tile, or (row, part): a row alone is split only while there are fewer than 2 units
    // of work per thread, into a share of the threads proportional to its keys.
    std::vector<int64_t> first(n + 1), parts(n);
    for (int64_t b = 0; b < n; ++b) {
        int64_t p = tile[b] ? 1 : 0;
        if (tile[b] == 1 && units < 2 * threads) {
            const int64_t want = (2 * threads * a.ctx_lens[b] + total_keys - 1) / total_keys;
            p = std::max<int64_t>(1, std::min<int64_t>(want, a.ctx_lens[b] / MIN_PART_KEYS));
        }
        parts[b] = p;
        first[b + 1] = first[b] + p;
    }
    const int64_t items = first[n];
    bool split = false;
    for (int64_t b = 0; b < n; ++b) split |= parts[b] > 1;
    std::vector<float> part_acc(split ? size_t(items) * hg * D : 0), part_ml(split ? size_t(items) * hg * 2 : 0);
    std::vector<int64_t> item_row(items);
    for (int64_t b = 0; b < n; ++b)
        for (int64_t i = first[b]; i < first[b + 1]; ++i) item_row[i] = b;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
    for (int64_t it = 0; it < items; ++it) {
        static thread_local std::vector<float> buf, acc, ml, tacc;
        static thread_local std::vector<bf16> wbuf;
        static thread_local std::vector<uint32_t> kt;
        static thread_local std::vector<Zmm> vi;
        const int64_t b = item_row[it];
        if (tile[b] > 1) {
            attend_tile<NV, G>(a, b, tile[b], buf, wbuf, kt, tacc, vi, ml);
            continue;
        }
        const int64_t p = it - first[b], len = a.ctx_lens[b];
        const int64_t begin = len * p / parts[b], end = len * (p + 1) / parts[b];
        const int64_t* table = a.tables + (a.row_seq ? a.row_seq[b] : b) * a.table_width;
        float *acc_p, *m_p, *l_p;
        if (parts[b] > 1) {
            acc_p = part_acc.data() + it * hg * D, m_p = part_ml.data() + it * hg * 2, l_p = m_p + hg;
        } else {
            acc.resize(hg * D), ml.resize(hg * 2);
            acc_p = acc.data(), m_p = ml.data(), l_p = m_p + hg;
        }
        attend_part<NV, G>(a.q + b * a.q_row_stride, a.k, a.v, a.kv_heads, table, begin, end, a.block_size, a.scale,
                           acc_p, m_p, l_p, buf, wbuf);
        if (parts[b] == 1)
            for (int64_t x = 0; x < hg; ++x) store_normalized<D>(acc_p + x * D, l_p[x], a.out + b * a.out_row_stride + x * D);
    }
    if (!split) return;
    // merge each row's parts: out = Σ e^(m_p - M) acc_p / Σ e^(m_p - M) l_p, rounded to bf16 once
    std::vector<float> merged(D);
    for (int64_t b = 0; b < n; ++b) {
        if (parts[b] < 2) continue;   // written by its item
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

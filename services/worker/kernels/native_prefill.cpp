// The native path's prefill attention: fp32 queries, the KV pool (fp16, q8 or fp32) read in place through the block
// tables, the scores in int16 by vpdpwssd with int32 sums, the weighted values in bf16 by vdpbf16ps with fp32 sums.
// Built in the quant library's avx512 build (the avx2 build compiles this file to nothing); vdpbf16ps needs
// AVX-512 BF16 too, checked at run time
// (llmserve_native_prefill_ok): where either is missing, a chunk's queries run as decode rows (native_ops.NativeAttention).
//
// A prefill chunk's row at position p attends to its sequence's positions 0..p. The rows go in tiles of 16
// consecutive rows, and everything a tile computes is a vector over its 16 rows (lane r = row r), so the rows
// share each key and value read and nothing is summed across lanes:
//   - the chunk's context is converted once per call, per KV head, for all its tiles (Context): each key to int16
//     with a scale of its own (k ≈ s_k · i, |i| ≤ M = 5,792 for 64 dims: i16_max) as 16-key groups of pairs of
//     dims, the values to bf16 as pairs of keys interleaved;
//   - a tile's queries (times the scale) are rounded likewise, one scale a row and query head, and transposed
//     once: q2[g][pair of dims] = 16 rows';
//   - per block of KB keys and query head: scores s[k] = s_q · s_k · Σ q2[i] · k[k][i] (vpdpwssd, the key's pair of
//     dims broadcast: one instruction adds 16 rows' two products, exact in int32: d products of M² at most), the
//     online softmax per lane (running max m and sum l, the output rescaled by e^(m_old - m)), the
//     weights rounded to bf16 (l sums them as rounded), then the transposed output ot[j] += (p[2i], p[2i+1]) ·
//     (v[2i][j], v[2i+1][j]) (vdpbf16ps, the values' pair broadcast);
//   - causality: only the blocks past the tile's first position are masked (key position ≤ row position).
// The scores are where rounding shows: a score's error moves its weight by e^error, and over 2,048 tokens of text
// q and k in bf16 (2^-9 each) flipped the argmax at 0.39% of positions against fp32 scores, integers of 12 bits
// and more with a scale a head at 0.10%, as fp32 attention does (docs/performance.md); the weights and values in
// bf16 cost little (0.05%). The same instruction count as bf16 scores.
//
// Where the CPU has AMX (AMX-BF16, the tile registers granted: amx.h) the weighted values run on the tiles
// instead, the same bf16 operands and fp32 sums: C[16 dims][16 rows] += values transposed [16][32 keys] · weights
// [16 pairs of keys][16], so the context keeps, per block of KB keys, values [d][KB]. The scores stay on vpdpwssd
// (AMX has no int16 products).
//
// Work items are (tile, KV head), largest first, over torch's OpenMP threads; where a step has fewer items than
// 4 a thread (a short chunk over a long context), each item's keys are cut into parts (whole blocks of KB keys)
// merged by their maxima and sums.
#if defined(__AVX512F__)
#include "blocks.h"   // (amx.h, in the build with VNNI)
#include "native_glue.h"   // the KV pool's element types (head_stride, kv_scale)
#include "simd.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace llmserve;

constexpr int ROWS = 16;          // query rows a tile (one zmm of lanes)
constexpr int64_t KB = 128;       // keys a block of the online softmax
constexpr int64_t MIN_PART = 512; // keys a part at least, when an item's keys are cut into parts
constexpr int64_t MAX_PARTS = 32;

#ifdef LLMSERVE_AVX512_VNNI
bool use_amx = true;   // the AMX tiles' products where the CPU has them (llmserve_native_prefill_amx)
inline bool amx_here(int64_t d) { return use_amx && d % 32 == 0 && amx_bf16_usable(); }
#else
inline bool amx_here(int64_t) { return false; }
#endif

struct Chunk { int64_t first, rows, start, table; };   // flat row of its first query, queries, start position,
                                                        // its block table's row in tables

struct Tile { int64_t chunk, r0; int rows; int64_t keys; };   // rows r0..r0+rows-1 of a chunk; keys: the last's
                                                              // position + 1

template <class TK, class TV>
struct Args {
    const float* q;
    int64_t q_stride;
    const Chunk* chunks;
    const TK* k;
    const TV* v;
    int64_t kv_heads, d, group;
    const int64_t* tables;
    int64_t width, block_size;
    float scale;
    float* out;
    int64_t out_stride;
};

// One thread's scratch: the tile's queries as int16 pairs of dims [G][d/2][16] and their scales [G][16],
// transposed output sums [G][d][16], per query head m and l [G][16], a block's scores / weights [KB][16] and the
// weights as pairs of keys [KB/2][16]
struct Scratch {
    std::vector<float> ot, ml, s, qs;
    std::vector<uint32_t> q2, pp;
    void size(int64_t g, int64_t d) {
        ot.resize(g * d * ROWS), ml.resize(2 * g * ROWS), s.resize(KB * ROWS), qs.resize(g * ROWS);
        q2.resize(g * d / 2 * ROWS), pp.resize(KB / 2 * ROWS);
    }
};

// The scores' integers for head size d: |i| ≤ M = ⌊√((2^31 - 1) / d)⌋, so no sum of d products overflows int32
// (5,792 for 64 dims, 4,095 for 128; in double: 2^31 - 1 as a float is 2^31, which gave 4,096)
inline float i16_max(int64_t d) { return float(std::floor(std::sqrt(2147483647.0 / double(d)))); }

// x's n floats (n % 16 == 0) as int16 x ≈ s · i, |i| ≤ top, s = max|x| / top (0 for all zeros); the integers to
// i16, returns s
inline float to_i16(const float* x, int64_t n, float top, int16_t* i16) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? top / amax : 0.0f);
    for (int64_t j = 0; j < n; j += 16)   // to nearest even; x · top / amax rounds to at most top
        _mm256_storeu_si256((__m256i*)(i16 + j), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), inv))));
    return amax / top;
}

// to_i16 of x's d floats, the integers as d / 2 pairs of dims (32 bits each) to dst[0], dst[ROWS], dst[2 ROWS], ...:
// one lane of the [d / 2][16] layouts the score products read (a tile's queries, a group of 16 keys); returns s
inline float to_i16_pairs(const float* x, int64_t d, float top, uint32_t* dst) {
    alignas(64) int16_t i16[256];
    const float s = to_i16(x, d, top, i16);
    for (int64_t i = 0; i < d / 2; ++i) std::memcpy(dst + i * ROWS, i16 + 2 * i, sizeof(uint32_t));
    return s;
}

// bf16 bits (round to nearest even) of 16 floats, in the low half of each lane
inline __m512i bf16_bits(__m512 x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}

// e^x for weights rounded to bf16 next (relative error < 5e-5, under a bf16 weight's 2^-9): 2^n · e^y, |y| ≤ ln2/2,
// degree-4 Taylor; x clamped to [-87, 88] as simd.h's exp16 is (so -inf and NaN give e^-87, weighed 0 by masks)
inline __m512 exp16_bf(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 y = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), x);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), y, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// A chunk's context, per KV head, converted once for all its tiles, padded with zeros to whole blocks of KB: the
// keys in int16 as groups of 16 keys [n / 16][d / 2][16] of 32-bit pairs of dims and their scales [n], the values
// in bf16 as pairs of keys interleaved, [n / 2][d] of (v[2i][j], v[2i+1][j]) or, for the AMX tiles, per block of KB
// keys transposed, [n / KB][d][KB]
struct Context {
    std::vector<int64_t> offset;   // chunk c's KV head h: keys at offset[c] + h n_c (2d + 2), values n_c d after
                                   // them, then the keys' scales (n_c floats): head()
    std::vector<uint16_t> buf;

    struct Head { uint16_t* keys; uint16_t* values; float* scales; };
    // chunk c's KV head h, its context padded to n keys
    Head head(int64_t c, int64_t h, int64_t n, int64_t d) {
        uint16_t* k = buf.data() + offset[c] + h * n * (2 * d + 2);
        return {k, k + n * d, (float*)(k + 2 * n * d)};
    }
    std::vector<int64_t> items_before;   // (KV head, block) items of the chunks before c

    template <class TK, class TV>
    void size(const Args<TK, TV>& a, int64_t n_chunks) {
        const int64_t d = a.d, H = a.kv_heads;
        offset.assign(n_chunks + 1, 0);
        items_before.assign(n_chunks + 1, 0);
        for (int64_t c = 0; c < n_chunks; ++c) {
            const int64_t blocks = (a.chunks[c].start + a.chunks[c].rows + KB - 1) / KB;
            offset[c + 1] = offset[c] + H * blocks * KB * (2 * d + 2);
            items_before[c + 1] = items_before[c] + blocks * H;
        }
        buf.resize(offset[n_chunks]);
    }

    // inside the parallel region, the items handed out by `share` (no wait at the end); tiles: the AMX layouts
    template <class TK, class TV>
    void fill(const Args<TK, TV>& a, int64_t n_chunks, bool tiles, PhaseShare& share) {
        static_assert(!is_q8<TK>, "keys are fp32 or fp16");
        const int64_t d = a.d, H = a.kv_heads, hk = head_stride<TK>(d), hv = head_stride<TV>(d);
        const std::vector<int64_t>& blocks_before = items_before;
        // (chunk, KV head, block) items, spread over the threads
        share.guided(blocks_before[n_chunks], [&](int64_t it) {
            const int64_t c = std::upper_bound(blocks_before.begin(), blocks_before.end(), it) - blocks_before.begin() - 1;
            const Chunk& ch = a.chunks[c];
            const int64_t keys = ch.start + ch.rows, n = (keys + KB - 1) / KB * KB;
            const int64_t h = (it - blocks_before[c]) % H, p0 = (it - blocks_before[c]) / H * KB;
            const int64_t* table = a.tables + ch.table * a.width;
            const Head hd = head(c, h, n, d);
            uint16_t *kd = hd.keys, *vd = hd.values;
            alignas(64) float vf[2][256], kf[256];
            const float top = i16_max(d);
            for (int64_t i = 0; i < KB; ++i) {
                const int64_t p = p0 + i;
                const TK* kr = nullptr;
                const TV* vr = nullptr;
                __m512 vs = _mm512_set1_ps(1.0f);   // q8 values: the row's scale
                if (p < keys) {
                    const int64_t slot = table[p / a.block_size] * a.block_size + p % a.block_size;
                    kr = a.k + (slot * H + h) * hk, vr = a.v + (slot * H + h) * hv;
                    if constexpr (is_q8<TV>) vs = _mm512_set1_ps(kv_scale(vr, d));
                }
                // the key's and the value's 16 values j.. as fp32 (q8: times the scale; past the context zeros)
                auto key16 = [&](int64_t j) { return kr ? widen16(kr + j) : _mm512_setzero_ps(); };
                auto value16 = [&](int64_t j) {
                    if (!vr) return _mm512_setzero_ps();
                    return is_q8<TV> ? _mm512_mul_ps(widen16(vr + j), vs) : widen16(vr + j);
                };
                // the key in int16, to [p / 16][pair][p % 16]
                for (int64_t j = 0; j < d; j += 16) _mm512_store_ps(kf + j, key16(j));
                hd.scales[p] = to_i16_pairs(kf, d, top, (uint32_t*)kd + (p / 16) * (d / 2) * ROWS + p % 16);
                if (tiles) {   // the AMX layout: values per block of KB transposed [d][KB]
                    for (int64_t j = 0; j < d; j += 16) {
                        const __m512 v16 = value16(j);
                        alignas(32) uint16_t vb[16];
                        _mm256_store_si256((__m256i*)vb, _mm512_cvtepi32_epi16(bf16_bits(v16)));
                        uint16_t* vt = vd + p0 * d + j * KB + i;
                        for (int x = 0; x < 16; ++x) vt[x * KB] = vb[x];
                    }
                    continue;
                }
                for (int64_t j = 0; j < d; j += 16) _mm512_storeu_ps(vf[i & 1] + j, value16(j));
                if (i & 1)   // keys p - 1 and p interleaved
                    for (int64_t j = 0; j < d; j += 16)
                        _mm512_storeu_si512(vd + (p - 1) * d + 2 * j, _mm512_or_si512(
                            bf16_bits(_mm512_loadu_ps(vf[0] + j)), _mm512_slli_epi32(bf16_bits(_mm512_loadu_ps(vf[1] + j)), 16)));
            }
        });
    }
};

// acc + vpdpwssd(q, the pair at p broadcast): the broadcast folded into the instruction ({1to16}); g++ 12 loads it
// with a vpbroadcastd of its own, and those extra operations took the loop from vdpbf16ps's time to 1.4x it
// (128 keys × 16 rows, 64 dims: 548 against 758 ns, one thread, AMD Zen 5)
inline __m512i dpwssd_bcst(__m512i acc, __m512i q, const uint32_t* p) {
    asm("vpdpwssd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*p), "v"(q));
    return acc;
}

// scores of `padded` keys (int16 rows kb as pairs of dims, scales ks) for 16 rows (q2: [d/2][16] int16 pairs, their
// scales qs [16]): vpdpwssd, then s = qs · ks · the sum
inline void scores_i16(const uint32_t* q2, const float* qs, const uint32_t* kb, const float* ks, int64_t padded,
                       int64_t dp, float* s) {
    const __m512 qsv = _mm512_loadu_ps(qs);
    for (int64_t k0 = 0; k0 < padded; k0 += 16) {
        __m512i acc[16];
        for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_si512();
        const uint32_t* kr = kb + k0 * dp;   // 16 keys' pairs of dims, [dp][16]
        for (int64_t j = 0; j < dp; ++j) {
            const __m512i qv = _mm512_loadu_si512(q2 + j * ROWS);
            for (int k = 0; k < 16; ++k) acc[k] = dpwssd_bcst(acc[k], qv, kr + j * 16 + k);
        }
        for (int k = 0; k < 16; ++k)
            _mm512_storeu_ps(s + (k0 + k) * ROWS, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[k]), _mm512_mul_ps(qsv, _mm512_set1_ps(ks[k0 + k]))));
    }
}

// og[j] = og[j] · alpha + Σ p[k] · v[k][j] over `pairs` pairs of keys (pp [pairs][16], vi [pairs][d]): vdpbf16ps
__attribute__((target("avx512bf16"))) void values_bf16(const uint32_t* pp, const uint32_t* vi, int64_t pairs,
                                                        int64_t d, float* og, const float* alpha) {
    const __m512 al = _mm512_loadu_ps(alpha);
    for (int64_t j0 = 0; j0 < d; j0 += 16) {
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_mul_ps(_mm512_loadu_ps(og + (j0 + j) * ROWS), al);
        for (int64_t k = 0; k < pairs; ++k) {
            const __m512bh p = (__m512bh)_mm512_loadu_si512(pp + k * ROWS);
            const uint32_t* vr = vi + k * d + j0;
            for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], p, (__m512bh)_mm512_set1_epi32(int(vr[j])));
        }
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(og + (j0 + j) * ROWS, acc[j]);
    }
}

#ifdef LLMSERVE_AVX512_VNNI
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

// every tile 16 rows of 64 bytes: 16 × 32 bf16 operands, 16 × 16 fp32 sums
void amx_bf16_configure() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.tile(t, 16, 64);
    cfg.load();
}

// values_bf16 on the tiles: og[j][r] = og[j][r] · alpha[r] + Σ_k p[k][r] · v[k][j] over `keys` keys (a multiple of
// 32; pp [keys/2][16] pairs, zero past the block's), vt the block's values transposed [d][KB]
void values_amx(const uint32_t* pp, const uint16_t* vt, int64_t keys, int64_t d, float* og, const float* alpha) {
    const __m512 al = _mm512_loadu_ps(alpha);
    for (int64_t j = 0; j < d; ++j) _mm512_storeu_ps(og + j * ROWS, _mm512_mul_ps(_mm512_loadu_ps(og + j * ROWS), al));
    for (int64_t j0 = 0; j0 < d; j0 += 16) {
        _tile_loadd(4, og + j0 * ROWS, 64);
        for (int64_t k0 = 0; k0 < keys; k0 += 32) {
            _tile_loadd(0, vt + j0 * KB + k0, 2 * KB);
            _tile_loadd(2, pp + k0 / 2 * ROWS, 64);
            _tile_dpbf16ps(4, 0, 2);
        }
        _tile_stored(4, og + j0 * ROWS, 64);
    }
}

#pragma GCC pop_options
#else
void amx_bf16_configure() {}
void values_amx(const uint32_t*, const uint16_t*, int64_t, int64_t, float*, const float*) {}
#endif

// keys [begin, end) of KV head h for one tile (kc, ks, vc: its chunk's converted keys, their scales and values of head
// h): into sc.ot (unnormalized, transposed), sc.ml (m then l per head)
template <class TK, class TV>
void attend_tile(const Args<TK, TV>& a, const Tile& t, int64_t h, int64_t begin, int64_t end, const uint16_t* kc,
                 const float* ks, const uint16_t* vc, Scratch& sc, bool tiles) {
    const Chunk& c = a.chunks[t.chunk];
    const int64_t d = a.d, G = a.group;
    const int64_t pos0 = c.start + t.r0;   // the tile's first position; lanes past its rows repeat its last row
    alignas(64) int32_t lane_pos[ROWS];
    for (int r = 0; r < ROWS; ++r) lane_pos[r] = int32_t(pos0 + (r < t.rows ? r : t.rows - 1));
    const __m512i posv = _mm512_load_si512(lane_pos);
    float *ot = sc.ot.data(), *s = sc.s.data();
    alignas(64) float qf[256];
    const float top = i16_max(d);
    for (int r = 0; r < ROWS; ++r) {   // each row's query heads times the scale, to int16 with a scale of their own
        const float* qr = a.q + (c.first + t.r0 + (r < t.rows ? r : t.rows - 1)) * a.q_stride + h * G * d;
        for (int64_t g = 0; g < G; ++g) {
            for (int64_t j = 0; j < d; j += 16)
                _mm512_store_ps(qf + j, _mm512_mul_ps(_mm512_loadu_ps(qr + g * d + j), _mm512_set1_ps(a.scale)));
            sc.qs[g * ROWS + r] = to_i16_pairs(qf, d, top, sc.q2.data() + g * d / 2 * ROWS + r);
        }
    }
    std::fill(ot, ot + G * d * ROWS, 0.0f);
    for (int64_t g = 0; g < G; ++g) {
        _mm512_storeu_ps(sc.ml.data() + g * ROWS, _mm512_set1_ps(-INFINITY));
        _mm512_storeu_ps(sc.ml.data() + (G + g) * ROWS, _mm512_setzero_ps());
    }
    for (int64_t p0 = begin; p0 < end; p0 += KB) {
        const int64_t nk = std::min(KB, end - p0), padded = (nk + 15) & ~int64_t(15);
        const bool masked = p0 + padded - 1 > pos0 || nk < padded;   // some key here lies past some row (or past end)
        for (int64_t g = 0; g < G; ++g) {
            float* og = ot + g * d * ROWS;
            scores_i16(sc.q2.data() + g * d / 2 * ROWS, sc.qs.data() + g * ROWS, (const uint32_t*)(kc + p0 * d),
                       ks + p0, padded, d / 2, s);
            // online softmax, per lane: masked scores take no part in the max and weigh exactly 0
            __m512 m = _mm512_loadu_ps(sc.ml.data() + g * ROWS), l = _mm512_loadu_ps(sc.ml.data() + (G + g) * ROWS);
            __m512 mx = m;
            for (int64_t k = 0; k < padded; ++k) {
                const __m512 sk = _mm512_loadu_ps(s + k * ROWS);
                mx = masked ? _mm512_mask_max_ps(mx, k < nk ? _mm512_cmpge_epi32_mask(posv, _mm512_set1_epi32(int32_t(p0 + k))) : 0, mx, sk)
                            : _mm512_max_ps(mx, sk);
            }
            const __m512 alpha = exp16(_mm512_sub_ps(m, mx));   // m = mx = -inf (no key yet): 0 · anything
            __m512 sum = _mm512_setzero_ps();
            for (int64_t k = 0; k < padded; ++k) {
                const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + k * ROWS), mx);
                __m512 p = exp16_bf(x);
                if (masked)
                    p = _mm512_maskz_mov_ps(k < nk ? _mm512_cmpge_epi32_mask(posv, _mm512_set1_epi32(int32_t(p0 + k))) : 0, p);
                p = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(p), 16));   // l sums them as rounded
                _mm512_storeu_ps(s + k * ROWS, p);
                sum = _mm512_add_ps(sum, p);
            }
            _mm512_storeu_ps(sc.ml.data() + g * ROWS, mx);
            _mm512_storeu_ps(sc.ml.data() + (G + g) * ROWS, _mm512_fmadd_ps(l, alpha, sum));
            // values: ot[j] = ot[j] · alpha + Σ_k p[k] · v[k][j], the weights as pairs of keys
            for (int64_t k = 0; k < padded / 2; ++k)
                _mm512_storeu_si512(sc.pp.data() + k * ROWS, _mm512_or_si512(
                    _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(s + 2 * k * ROWS)), 16),
                    _mm512_castps_si512(_mm512_loadu_ps(s + (2 * k + 1) * ROWS))));
            alignas(64) float al[ROWS];
            _mm512_store_ps(al, alpha);
            if (tiles) {   // whole products of 32 keys: the weights past the block's keys zero
                const int64_t keys32 = (nk + 31) & ~int64_t(31);
                for (int64_t k = padded / 2; k < keys32 / 2; ++k) _mm512_storeu_si512(sc.pp.data() + k * ROWS, _mm512_setzero_si512());
                values_amx(sc.pp.data(), vc + p0 * d, keys32, d, og, al);
            } else {
                values_bf16(sc.pp.data(), (const uint32_t*)(vc + p0 * d), (nk + 1) / 2, d, og, al);
            }
        }
    }
}

// ot / l for each row of the tile, written into its rows of out (KV head h's query heads)
template <class TK, class TV>
void store_tile(const Args<TK, TV>& a, const Tile& t, int64_t h, const float* ot, const float* l) {
    const Chunk& c = a.chunks[t.chunk];
    const int64_t d = a.d, G = a.group;
    alignas(64) float col[ROWS], inv[ROWS];
    for (int64_t g = 0; g < G; ++g) {
        _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l + g * ROWS)));
        for (int64_t j = 0; j < d; ++j) {
            _mm512_store_ps(col, _mm512_mul_ps(_mm512_loadu_ps(ot + (g * d + j) * ROWS), _mm512_load_ps(inv)));
            for (int r = 0; r < t.rows; ++r) a.out[(c.first + t.r0 + r) * a.out_stride + (h * G + g) * d + j] = col[r];
        }
    }
}

template <class TK, class TV>
void prefill(const Args<TK, TV>& a, int64_t n_chunks) {
    const int64_t d = a.d, G = a.group, H = a.kv_heads;
    std::vector<Tile> tiles;
    for (int64_t c = 0; c < n_chunks; ++c)
        for (int64_t r0 = 0; r0 < a.chunks[c].rows; r0 += ROWS) {
            const int rows = int(std::min<int64_t>(ROWS, a.chunks[c].rows - r0));
            tiles.push_back({c, r0, rows, a.chunks[c].start + r0 + rows});
        }
    // largest first: the threads take items in turn, and the last ones taken are the short ones
    std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& x, const Tile& y) { return x.keys > y.keys; });
    const int64_t threads = omp_get_max_threads(), n_tiles = int64_t(tiles.size());
    int64_t parts = 1;
    if (n_tiles * H < 4 * threads) {
        const int64_t longest = tiles.empty() ? 0 : tiles[0].keys;
        parts = std::clamp<int64_t>(std::min((4 * threads + n_tiles * H - 1) / (n_tiles * H), longest / MIN_PART), 1,
                                    MAX_PARTS);
    }
    const int64_t per = G * d * ROWS, items = n_tiles * H * parts;
    std::vector<float> part_o(parts > 1 ? items * per : 0), part_ml(parts > 1 ? items * 2 * G * ROWS : 0);
    static thread_local Context kept;   // the calling thread's, kept between calls (no page faults a layer)
    Context& ctx = kept;                // (the region's threads share the calling thread's, by this reference)
    ctx.size(a, n_chunks);
    const bool amx = amx_here(d);
    thread_local Phases phases_;
    Phases& phases = phases_;
    phases.reset(3);
#pragma omp parallel if (items > 1)
    {
        PhaseShare share(phases, omp_get_num_threads());
        Scratch sc;
        sc.size(G, d);
        ctx.fill(a, n_chunks, amx, share);
        share.wait();
        if (amx) amx_bf16_configure();
        share.each(items, [&](int64_t it) {
            const Tile& t = tiles[it / (H * parts)];
            const int64_t h = it / parts % H, p = it % parts;
            // part p's keys: whole blocks of KB, the last part to the end
            const int64_t blocks = (t.keys + KB - 1) / KB;
            const int64_t begin = blocks * p / parts * KB, end = std::min(t.keys, blocks * (p + 1) / parts * KB);
            const int64_t n = (a.chunks[t.chunk].start + a.chunks[t.chunk].rows + KB - 1) / KB * KB;
            const Context::Head hd = ctx.head(t.chunk, h, n, d);
            attend_tile(a, t, h, begin, end, hd.keys, hd.scales, hd.values, sc, amx);
            if (parts == 1) {
                store_tile(a, t, h, sc.ot.data(), sc.ml.data() + G * ROWS);
            } else {
                std::memcpy(part_o.data() + it * per, sc.ot.data(), per * sizeof(float));
                std::memcpy(part_ml.data() + it * 2 * G * ROWS, sc.ml.data(), 2 * G * ROWS * sizeof(float));
            }
        });
        if (parts > 1) {
            share.wait();
            // each (tile, KV head)'s parts merged: o = Σ e^(m_p - M) o_p, l = Σ e^(m_p - M) l_p (a part with no
            // key for a row has m_p = -inf: weight 0 · zeros)
            share.each(n_tiles * H, [&](int64_t th) {
                const int64_t first = th * parts;
                for (int64_t g = 0; g < G; ++g) {
                    __m512 big = _mm512_set1_ps(-INFINITY);
                    for (int64_t p = 0; p < parts; ++p)
                        big = _mm512_max_ps(big, _mm512_loadu_ps(part_ml.data() + (first + p) * 2 * G * ROWS + g * ROWS));
                    __m512 w[MAX_PARTS];
                    __m512 l = _mm512_setzero_ps();
                    for (int64_t p = 0; p < parts; ++p) {
                        const float* ml = part_ml.data() + (first + p) * 2 * G * ROWS;
                        w[p] = exp16(_mm512_sub_ps(_mm512_loadu_ps(ml + g * ROWS), big));
                        l = _mm512_fmadd_ps(w[p], _mm512_loadu_ps(ml + (G + g) * ROWS), l);
                    }
                    _mm512_storeu_ps(sc.ml.data() + (G + g) * ROWS, l);
                    for (int64_t j = 0; j < d; ++j) {
                        __m512 o = _mm512_setzero_ps();
                        for (int64_t p = 0; p < parts; ++p)
                            o = _mm512_fmadd_ps(w[p], _mm512_loadu_ps(part_o.data() + (first + p) * per + (g * d + j) * ROWS), o);
                        _mm512_storeu_ps(sc.ot.data() + (g * d + j) * ROWS, o);
                    }
                }
                store_tile(a, tiles[th / H], th % H, sc.ot.data(), sc.ml.data() + G * ROWS);
            });
        }
        share.leave(omp_get_thread_num() == 0);
    }
}

template <class TK, class TV>
int run(const float* q, int64_t q_stride, const int64_t* chunks, int64_t n_chunks, const TK* k, const TV* v,
        int64_t kv_heads, int64_t head_dim, int64_t group, const int64_t* tables, int64_t width, int64_t block_size,
        float scale, float* out, int64_t out_stride) {
    if (head_dim % 16 != 0 || head_dim > 256 || group < 1 || group > 16) return 1;
    static_assert(sizeof(Chunk) == 4 * sizeof(int64_t), "chunks are [n, 4] int64");
    prefill(Args<TK, TV>{q, q_stride, (const Chunk*)chunks, k, v, kv_heads, head_dim, group, tables, width, block_size,
                    scale, out, out_stride}, n_chunks);
    return 0;
}

}  // namespace

extern "C" {

// 1: this CPU has AVX-512 BF16 (vdpbf16ps), which the kernel needs beyond the build's AVX-512 F/BW/VL
int llmserve_native_prefill_ok() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}

// Whether the products run on the AMX tiles where the CPU has them (on: 1, off: 0; the default on); returns 1
// where they can (AMX-BF16, the tile registers granted), else 0
int llmserve_native_prefill_amx(int on) {
#ifdef LLMSERVE_AVX512_VNNI
    use_amx = on != 0;
    return amx_bf16_usable() ? 1 : 0;
#else
    (void)on;
    return 0;
#endif
}

// Prefill chunks: chunks [n_chunks, 4] int64 = (flat row of its first query, queries, start position, row of
// tables); query i of a chunk (position start + i) attends to positions 0..start + i of its block table.
// q: [*, kv_heads * group, head_dim] fp32 (row stride q_stride, heads contiguous); out likewise (out_stride);
// caches [slots, kv_heads, head_dim], fp16 (f16_) or fp32 (f32_), or fp16 keys and q8 values [slots, kv_heads,
// head_dim + 4] (f16q8_: native_glue.h); tables [*, width] int64. Returns 0; 1 when
// head_dim is not a multiple of 16 up to 256 or the group is over 16.
int llmserve_f16_paged_prefill(const float* q, int64_t q_stride, const int64_t* chunks, int64_t n_chunks,
                               const uint16_t* k, const uint16_t* v, int64_t kv_heads, int64_t head_dim,
                               int64_t group, const int64_t* tables, int64_t width, int64_t block_size, float scale,
                               float* out, int64_t out_stride) {
    return run(q, q_stride, chunks, n_chunks, k, v, kv_heads, head_dim, group, tables, width, block_size, scale, out,
               out_stride);
}
int llmserve_f16q8_paged_prefill(const float* q, int64_t q_stride, const int64_t* chunks, int64_t n_chunks,
                              const uint16_t* k, const int8_t* v, int64_t kv_heads, int64_t head_dim, int64_t group,
                              const int64_t* tables, int64_t width, int64_t block_size, float scale, float* out,
                              int64_t out_stride) {
    return run(q, q_stride, chunks, n_chunks, k, v, kv_heads, head_dim, group, tables, width, block_size, scale, out,
               out_stride);
}
int llmserve_f32_paged_prefill(const float* q, int64_t q_stride, const int64_t* chunks, int64_t n_chunks,
                               const float* k, const float* v, int64_t kv_heads, int64_t head_dim, int64_t group,
                               const int64_t* tables, int64_t width, int64_t block_size, float scale, float* out,
                               int64_t out_stride) {
    return run(q, q_stride, chunks, n_chunks, k, v, kv_heads, head_dim, group, tables, width, block_size, scale, out,
               out_stride);
}

}
#endif

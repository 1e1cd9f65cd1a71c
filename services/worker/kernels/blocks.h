// The GGUF block formats (Q4_1, Q8_0) in the kernels' repacked layout, and the tiles that multiply them: shared
// by quant.cpp (one matmul a call) and native_step.cpp (a whole decode step a call), in both of the library's builds
// (kernels/__init__.py): AVX-512 VNNI, and AVX2 + FMA + F16C.
//
// The weights stay in the file's blocks of 32 (Q4_1: fp16 d, fp16 m, 16 bytes of nibbles, value d·q + m, low
// nibbles are weights 0-15 and high nibbles 16-31; Q8_0: fp16 d, 32 int8, value d·q), repacked at load time
// (services/worker/quant_linear.py) into 16-row tiles in a vertical order (below: "The layout"). Each activation
// row is quantized per 32-block to int16 inside the call (scale max|x| / 32767; docs/performance.md compares this
// with llama.cpp's int8 and with fp32 activations), and each block's products are summed exactly in int32, then one
// fp32 FMA with d · xd (and Q4_1's m · xs). Both builds do those steps in the same order, so their results are
// equal bit for bit, and a row's result never depends on the rows it shares a call with (row-invariant). Rows come
// in chunks of 64 so a chunk's activations stay in L1/L2 while the weight tiles stream. Tiles are spread over
// torch's OpenMP threads (libgomp, as the other kernels).
#pragma once

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "share.h"

namespace llmserve {

constexpr int QK = 32;         // weights per block
constexpr int64_t MB = 64;     // activation rows per chunk

inline float fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

// ---------------------------------------------------------------------------------------------------------------
// The layout. A tile is 16 weight rows, and each vector of the unpacked weights holds one pair of inputs
// (k = 2p, 2p+1) for the tile's rows (int16 lane 2j+e = w[row j][2p+e]), so a multiply-add against the activation
// pair broadcast adds the pair's products into every row's int32 sum with no horizontal work. Per tile and block
// index (the repack is services/worker/quant_linear.py's):
// - Q4_1: 16 fp16 d, 16 fp16 m, then 4 chunks of 32 16-bit words; chunk c, word t = 2j + e holds in its nibble s
//   (bits 4s..4s+3) w[j][2p + e] for pair p = 4c + s: one load and a shift and mask give four pairs;
// - Q8_0: 16 fp16 d, then 8 chunks of 32 16-bit words; chunk c, word t holds w[j][2p + e] in its low byte for
//   p = 2c and in its high byte for p = 2c + 1 (sign-extended by shifts).
// A chunk's 64 bytes are one 512-bit vector (16 rows) in the AVX-512 build, two 256-bit halves (rows 0-7, 8-15)
// in the AVX2 one. The layout is the file's bytes, reordered: a matrix holds the same bytes as the file.
constexpr int64_t TILE = 16;

struct Q4_1 {
    static constexpr int64_t GROUP = 64 + 256;
    static constexpr bool HAS_MIN = true;
    // w[j][kk] of a block (one weight, for row lookups)
    static inline int value(const uint8_t* g, int j, int kk) {
        const int p = kk >> 1, e = kk & 1, c = p >> 2, s = p & 3;
        uint16_t word;
        std::memcpy(&word, g + 64 + 64 * c + 2 * (2 * j + e), 2);
        return (word >> (4 * s)) & 0xF;
    }
};

struct Q8_0 {
    static constexpr int64_t GROUP = 32 + 512;
    static constexpr bool HAS_MIN = false;
    static inline int value(const uint8_t* g, int j, int kk) {
        const int p = kk >> 1, e = kk & 1;
        return (int8_t)g[32 + 64 * (p >> 1) + 2 * (2 * j + e) + (p & 1)];
    }
};

// pass(R, r) over rows [r, m1): passes of MAX rows, then the 1..MAX-1 rows left in one pass (each row's sums are
// the same whatever R: row-invariant)
template <int N, class Pass>
inline void last_pass(int64_t left, int64_t r, Pass& pass) {
    if constexpr (N > 0) {
        if (left == N) pass(std::integral_constant<int, N>{}, r);
        else last_pass<N - 1>(left, r, pass);
    }
}

// pass(R, r) over rows [r, m1) in as few passes of at most MAX rows as there can be, their sizes within one of
// each other (MAX = 8: 9 rows 5 + 4, 13 → 7 + 6, 17 → 6 + 6 + 5, 64 → 8 × 8): no pass of a lone row beside full
// ones, whose cost is nearly a full pass's (each pass unpacks the tile's weights again)
template <int MAX, class Pass>
inline void in_even_passes(int64_t r, int64_t m1, Pass pass) {
    const int64_t left = m1 - r, passes = (left + MAX - 1) / MAX;
    for (int64_t i = 0; i < passes; ++i) {
        const int64_t rows = left / passes + (i < left % passes);
        last_pass<MAX>(rows, r, pass);
        r += rows;
    }
}

// The activations' quants: |q| ≤ QUANT_LEVELS, 12 bits (so AMX multiplies Q4_1's nibbles by q >> 4 and q & 15 in
// one product: amx.h asserts it)
constexpr int QUANT_LEVELS = 2047;

// One 32-block of activations rounded to 12 bits: qi (4 × 8 int32, in order), the scale (max|x| / 2047) and Σq.
// q = round-half-even(x · 2047 / max|x|); an all-zero block has scale 0, quants 0.
inline void quantize_block(const float* p, __m256i qi[4], float& scale, int32_t& sum) {
    constexpr float levels = QUANT_LEVELS;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(p + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4), id = mx > 0.0f ? levels / mx : 0.0f;
    for (int j = 0; j < 4; ++j)
        qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(id)),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    scale = mx / levels;
    sum = _mm_cvtsi128_si32(s4);
}

// Activations per 32-block to 12-bit quants held in int16 (scale xd = max|x| / 2047, xs = xd · Σq): the rounding
// is 2^-12 of the block's largest value, against bfloat16's 2^-9 of each value
inline void quantize_row_q16(const float* x, int64_t nb, int16_t* xq, float* xd, float* xs) {
    for (int64_t b = 0; b < nb; ++b) {
        __m256i qi[4];
        int32_t sum;
        quantize_block(x + b * QK, qi, xd[b], sum);
        // int32 → int16 in order (packs works per 128-bit lane)
        _mm256_storeu_si256((__m256i*)(xq + b * QK), _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8));
        _mm256_storeu_si256((__m256i*)(xq + b * QK + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8));
        xs[b] = xd[b] * (float)sum;
    }
}

// Activation rows quantized per 32-block to int16 (quantize_row_q16): quants [rows, k], scales and scale · Σq
// [rows, k/32]; grown as needed and kept (the int16 matmuls and the one-call step)
struct Quants {
    std::vector<int16_t> q;
    std::vector<float> d, s;
    void reserve(int64_t rows, int64_t k) {
        if ((int64_t)q.size() < rows * k) q.resize(rows * k);
        if ((int64_t)d.size() < rows * (k / QK)) { d.resize(rows * (k / QK)); s.resize(rows * (k / QK)); }
    }
    void row(const float* x, int64_t r, int64_t k) {
        const int64_t nb = k / QK;
        quantize_row_q16(x, nb, q.data() + r * k, d.data() + r * nb, s.data() + r * nb);
    }
};

// body(t, m0, m1) for every weight tile t and chunk [m0, m1) of activation rows, inside a parallel region (each
// thread takes tiles as `share` hands them out; no barrier at the end): the chunks in order, the tiles of each in
// shrinking runs (guided: the first a thread takes is 1/threads of what is left, the last 8 tiles). At one row a
// matmul reads its weights at memory speed, and long contiguous runs are what the hardware prefetchers stream
// best: the step's layer matmuls in 4.7-5.1 ms against 6.2-6.4 ms in runs of 8 (dynamic, 8), as static
// halves do; unlike static halves, when another process takes one core for a while the other thread goes on
// with what is left instead of waiting at the region's end.
template <class Share, class Body>
inline void tiles_for(int64_t tiles, int64_t m, Share& share, Body body) {
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        const int64_t m1 = m0 + MB < m ? m0 + MB : m;
        share.guided(tiles, [&](int64_t t) { body(t, m0, m1); });
    }
}

// fn(c) for c = 0..N-1 in order, each c a compile-time constant (std::integral_constant): unrolled, so a pair's
// and a row's offsets are displacements in the instructions
template <class Fn, int... C>
inline void unrolled_seq(Fn& fn, std::integer_sequence<int, C...>) { (fn(std::integral_constant<int, C>{}), ...); }
template <int N, class Fn>
inline void unrolled(Fn fn) { unrolled_seq(fn, std::make_integer_sequence<int, N>{}); }
template <int P> constexpr std::integral_constant<int, P> pair{};

// 32 bits of int16 activations (one input pair) read where they lie (no alignment, no strict-aliasing promise)
typedef int32_t pair_t __attribute__((may_alias, aligned(2)));

// Activation row r (0..8) of a pass at base[row_base(r)] + row_scale(r) · stride with bases at rows 0, 3, 6 and
// scales 0, 1, 2, 4 or 8: every broadcast is one x86 address (base + stride register × scale + the pair's offset),
// 8 rows in 4 registers with no address arithmetic (row pointers computed per row spill to the stack)
constexpr int row_base(int r) { return r == 3 || r == 5 || r == 7 ? 1 : r == 6 ? 2 : 0; }
constexpr int row_scale(int r) { return r - 3 * row_base(r); }

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 VNNI (-mavx512vnni): one 512-bit vector a pair for all 16 rows; vpdpwssd against the activation pair
// broadcast adds 32 products into the 16 rows' int32 sums: a block is 16 vpdpwssd a row, then per row one
// conversion and the fp32 FMAs, lane j for row j. A tile's weights are unpacked once a pass of up to 8 activation
// rows, the rows split into passes of near-equal size (in_even_passes: 9 rows are 5 + 4, not 8 + 1). From 8 rows a
// pass the kernel runs at what the FP pipes allow: a row's block is 16 vpdpwssd and 3-4 fp32 ops (conversion,
// d · xd, one or two FMAs) whose order fixes the bits, so larger passes (12 rows, one integer sum a row) measured
// 2-4% slower than 8 with two.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LLMSERVE_AVX512_VNNI 1
constexpr int64_t PAIRED_MIN_ROWS = 4;   // from how many activation rows the tiles run in pairs (tile_v16's T)

struct V16Q4_1 : Q4_1 {
    static inline __m512 d(const uint8_t* g) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)g)); }
    static inline __m512 m(const uint8_t* g) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + 32))); }
    // fn(p, w) for the 16 pairs in order, w[i] the pair's 32 int16 weights in tile i's block (at g + i · apart)
    template <int T, class Fn>
    static inline void pairs(const uint8_t* g, int64_t apart, Fn fn) {
        const __m512i mask = _mm512_set1_epi16(0x000F);
        unrolled<4>([&](auto c) {
            __m512i v[T], w[T];
            for (int i = 0; i < T; ++i) v[i] = _mm512_loadu_si512(g + i * apart + 64 + 64 * c);
            for (int i = 0; i < T; ++i) w[i] = _mm512_and_si512(v[i], mask);
            fn(pair<4 * c>, w);
            for (int i = 0; i < T; ++i) w[i] = _mm512_and_si512(_mm512_srli_epi16(v[i], 4), mask);
            fn(pair<4 * c + 1>, w);
            for (int i = 0; i < T; ++i) w[i] = _mm512_and_si512(_mm512_srli_epi16(v[i], 8), mask);
            fn(pair<4 * c + 2>, w);
            for (int i = 0; i < T; ++i) w[i] = _mm512_srli_epi16(v[i], 12);
            fn(pair<4 * c + 3>, w);
        });
    }
};

struct V16Q8_0 : Q8_0 {
    static inline __m512 d(const uint8_t* g) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)g)); }
    template <int T, class Fn>
    static inline void pairs(const uint8_t* g, int64_t apart, Fn fn) {
        unrolled<8>([&](auto c) {
            __m512i v[T], w[T];
            for (int i = 0; i < T; ++i) v[i] = _mm512_loadu_si512(g + i * apart + 32 + 64 * c);
            for (int i = 0; i < T; ++i) w[i] = _mm512_srai_epi16(_mm512_slli_epi16(v[i], 8), 8);
            fn(pair<2 * c>, w);
            for (int i = 0; i < T; ++i) w[i] = _mm512_srai_epi16(v[i], 8);
            fn(pair<2 * c + 1>, w);
        });
    }
};

// s + w · x over the pair, x the activation pair at p broadcast to the 16 rows; first: s is not read, the
// pair's products are the sum (vpmaddwd, exact as vpdpwssd from zero: |w| ≤ 128, |x| ≤ 32767)
template <bool first>
inline __m512i dp_pair(__m512i s, __m512i w, const char* p) {
    const __m512i x = _mm512_set1_epi32(*(const pair_t*)p);
    if constexpr (first) return _mm512_madd_epi16(w, x);
    else return _mm512_dpwssd_epi32(s, w, x);
}

// T = 1 or 2 consecutive 16-row tiles (T × 16 weight rows, the tiles nb · GROUP bytes apart) times R ≤ 8 int16
// activation rows (quants xq [R, k], scales xd, xs [R, nb]) → y [R, 16 T] (row stride ldy); first_pass: the
// chunk's first pass over these tiles. Per row the blocks in order, one fp32 accumulator a weight row:
// row-invariant, and the same bits whatever T. Registers (T = 1): R fp32 accumulators, R × A int32
// sums, the pair's weights, the mask, d and m (8 rows: 28 of the 32). T = 2 shares each activation pair's
// broadcast between the two tiles' weights (16 vpdpwssd a broadcast and two unpacks, against 8 and one): g++
// emits the broadcast as an operation of its own, and on Zen 5 a loop of 8 rows × 2 tiles ran ~1.2x the products a
// second of 8 × 1; its R × 2 fp32 accumulators live in memory (one load and store a row and block).
template <class V, int R, int T = 1>
inline void tile_v16(const uint8_t* w, int64_t nb, int64_t k, const int16_t* xq, const float* xd, const float* xs,
                     float* y, int64_t ldy, bool first_pass) {
    static_assert(R >= 1 && R <= 8 && (T == 1 || T == 2));
    // A independent integer sums a row (pair p into sum p % A, added at the end: exact), so the vpdpwssd chains
    // overlap instead of waiting on each other's latency: 2 a row is 4-6% faster than 1 even at 8 rows (T = 2: the
    // 2R chains overlap already)
    constexpr int A = T == 2 ? 1 : R >= 4 ? 2 : 4;
    constexpr int BASES = R > 6 ? 3 : R > 3 ? 2 : 1;
    const int64_t stride = 2 * k;   // bytes
    const char* base[BASES];
    for (int i = 0; i < BASES; ++i) base[i] = (const char*)(xq + 3 * i * k);
    // The next tile's bytes (mostly the same thread's next: tiles_for hands out runs) fetched a tile ahead, in a
    // chunk's first pass over this tile (first_pass): at 5-8 rows a pass the hardware prefetchers fall behind (a
    // matrix from memory: 8-32 rows 9-19% faster), at 1-4 they keep up and the prefetches only cost (1 row: +15%)
    const int64_t apart = nb * V::GROUP, ahead = T * apart;
    __m512 acc[T][R];
    for (int i = 0; i < T; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* g = w + b * V::GROUP;
        if (R >= 5 && first_pass)
            for (int i = 0; i < T; ++i)
                for (int64_t o = 0; o < V::GROUP; o += 64) _mm_prefetch((const char*)g + i * apart + ahead + o, _MM_HINT_T0);
        __m512i s[A][T][R];
        V::template pairs<T>(g, apart, [&](auto p, const __m512i* wv) {
            unrolled<R>([&](auto r) {
                const char* x = base[row_base(r)] + row_scale(r) * stride + 4 * p;
                unrolled<T>([&](auto i) { s[p % A][i][r] = dp_pair<(p < A)>(s[p % A][i][r], wv[i], x); });
            });
        });
        for (int i = 0; i < BASES; ++i) base[i] += 2 * QK;
        for (int a = 1; a < A; ++a)
            for (int i = 0; i < T; ++i)
                for (int r = 0; r < R; ++r) s[0][i][r] = _mm512_add_epi32(s[0][i][r], s[a][i][r]);
        // per row: the int32 sums to fp32, d · xd (xd an embedded broadcast), one FMA, then Q4_1's m · xs: the
        // order tile_v8's lanes take, so the same bits (m · xs can't leave the loop without changing them)
        for (int i = 0; i < T; ++i) {
            const __m512 dv = V::d(g + i * apart);
            __m512 mv;
            if constexpr (V::HAS_MIN) mv = V::m(g + i * apart);
            for (int r = 0; r < R; ++r) {
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0][i][r]), _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * nb + b])),
                                            acc[i][r]);
                if constexpr (V::HAS_MIN) acc[i][r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nb + b]), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < T; ++i)
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy + TILE * i, acc[i][r]);
}

#else
// ---------------------------------------------------------------------------------------------------------------
// AVX2 (the portable build): each 64-byte chunk is two 256-bit halves, rows 0-7 and 8-15. vpmaddwd against the
// activation pair broadcast gives 16 products in a half's 8 rows' int32 lanes and vpaddd adds them to the row's sum;
// unlike vpdpwssd's chain, the add's latency is one cycle, so one sum a row and half keeps the multiplies
// independent. Both halves of a block run at once, so each activation pair is broadcast once for the tile's 16 rows
// (a broadcast, two multiplies and two adds a pair and row, where a half at a time takes a broadcast a multiply:
// 1.05-1.35x). Measured on Zen 3 in docs/performance.md.

// 8 fp16 scales at p (one half's d or m) in fp32
inline __m256 half_scales(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

struct V16Q4_1 : Q4_1 {
    // d (m) of rows 8h..8h+7
    static inline __m256 d(const uint8_t* g, int h) { return half_scales(g + 16 * h); }
    static inline __m256 m(const uint8_t* g, int h) { return half_scales(g + 32 + 16 * h); }
    // fn(p, w0, w1) for the 16 pairs in order, w0 (w1) the pair's 16 int16 weights of rows 0-7 (8-15)
    template <class Fn>
    static inline void pairs(const uint8_t* g, Fn fn) {
        const __m256i mask = _mm256_set1_epi16(0x000F);
        unrolled<4>([&](auto c) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(g + 64 + 64 * c));
            const __m256i u = _mm256_loadu_si256((const __m256i*)(g + 64 + 64 * c + 32));
            // pair 4c + s: bits 4s..4s+3 of each 16-bit lane (the top nibble needs no mask), both halves alike
            unrolled<4>([&](auto sh) {
                const auto nibble = [&](__m256i x) {
                    const __m256i y = _mm256_srli_epi16(x, 4 * sh);
                    return sh == 3 ? y : _mm256_and_si256(y, mask);
                };
                fn(pair<4 * c + sh>, nibble(v), nibble(u));
            });
        });
    }
};

struct V16Q8_0 : Q8_0 {
    static inline __m256 d(const uint8_t* g, int h) { return half_scales(g + 16 * h); }
    template <class Fn>
    static inline void pairs(const uint8_t* g, Fn fn) {
        unrolled<8>([&](auto c) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(g + 32 + 64 * c));
            const __m256i u = _mm256_loadu_si256((const __m256i*)(g + 32 + 64 * c + 32));
            // pair 2c: each 16-bit lane's low byte, sign-extended; pair 2c + 1: its high byte
            const auto low = [](__m256i x) { return _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8); };
            const auto high = [](__m256i x) { return _mm256_srai_epi16(x, 8); };
            fn(pair<2 * c>, low(v), low(u));
            fn(pair<2 * c + 1>, high(v), high(u));
        });
    }
};

// How far ahead tile_v8 prefetches its weights in a chunk's first pass over a tile (this tile's later blocks, then
// the next tile's: tiles_for hands out runs). On an AVX2-only Zen 3 the hardware prefetchers alone left a one-row
// step waiting on memory (docs/performance.md, "A software prefetch in the AVX2 tiles"); tile_v16's rule differs
// because on the AVX-512 machines a prefetch at one row cost 15%.
constexpr int64_t V8_PREFETCH_AHEAD = 4096;

// One 16-row tile times R ≤ 4 int16 activation rows → y [R, 16] (row stride ldy). Registers: 2R int32 sums, the
// pair's two weight vectors, the two raw chunks, the mask and the broadcast (14 of the 16 at 4 rows; the fp32
// accumulators live in memory, one load and store a row, half and block). Per row the blocks in order, one fp32
// accumulator a weight row: row-invariant, and bit for bit tile_v16.
template <class V, int R>
inline void tile_v8(const uint8_t* w, int64_t nb, int64_t k, const int16_t* xq, const float* xd, const float* xs,
                    float* y, int64_t ldy, bool first_pass) {
    static_assert(R >= 1 && R <= 4);
    constexpr int BASES = R > 3 ? 2 : 1;
    const int64_t stride = 2 * k;   // bytes
    const char* base[BASES];
    for (int i = 0; i < BASES; ++i) base[i] = (const char*)(xq + 3 * i * k);
    __m256 acc[2][R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* g = w + b * V::GROUP;
        if (first_pass)
            for (int64_t o = 0; o < V::GROUP; o += 64) _mm_prefetch((const char*)g + V8_PREFETCH_AHEAD + o, _MM_HINT_T0);
        __m256i s[2][R];
        V::pairs(g, [&](auto p, __m256i w0, __m256i w1) {
            unrolled<R>([&](auto r) {
                const char* x = base[row_base(r)] + row_scale(r) * stride + 4 * p;
                const __m256i xb = _mm256_set1_epi32(*(const pair_t*)x);
                const __m256i p0 = _mm256_madd_epi16(w0, xb), p1 = _mm256_madd_epi16(w1, xb);
                if constexpr (p == 0) {
                    s[0][r] = p0;
                    s[1][r] = p1;
                } else {
                    s[0][r] = _mm256_add_epi32(s[0][r], p0);
                    s[1][r] = _mm256_add_epi32(s[1][r], p1);
                }
                // each sum in its register here: without this g++ 12 reassociates the integer adds, keeps
                // every product of the block and spills them to the stack (a store and a load a multiply:
                // 1.2-1.5x slower)
                __asm__("" : "+x"(s[0][r]), "+x"(s[1][r]));
            });
        });
        for (int i = 0; i < BASES; ++i) base[i] += 2 * QK;
        // the order tile_v16's lanes take: the conversion, d · xd, one FMA, then Q4_1's m · xs
        for (int h = 0; h < 2; ++h) {
            const __m256 dv = V::d(g, h);
            __m256 mv;
            if constexpr (V::HAS_MIN) mv = V::m(g, h);
            for (int r = 0; r < R; ++r) {
                acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h][r]),
                                            _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * nb + b])), acc[h][r]);
                if constexpr (V::HAS_MIN) acc[h][r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * nb + b]), acc[h][r]);
            }
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy + 8 * h, acc[h][r]);
}
#endif

template <class F> struct Vertical;
template <> struct Vertical<Q4_1> { using type = V16Q4_1; };
template <> struct Vertical<Q8_0> { using type = V16Q8_0; };

}  // namespace llmserve

#ifdef LLMSERVE_AVX512_VNNI
#include "amx.h"
#endif

namespace llmserve {

// How many loops (phases, share.h) i16_tiles runs over m activation rows
inline int64_t matmul_phases(int64_t m) {
#ifdef LLMSERVE_AVX512_VNNI
    if (amx_rows(m)) return ((m + 15) / 16 + AMX_CHUNK - 1) / AMX_CHUNK;
#endif
    return (m + MB - 1) / MB;
}

// y [m, n] (row stride ldy) = int16 activations · Wᵀ (TILE rows a tile), inside a parallel region (no barrier at
// the end), the tiles handed out as `share` does: what quant.cpp's *_i16 and the one-call step run. From
// amx_min_rows rows, on the AMX tiles where there are any (amx.h: the same bits)
template <class F, class Share = OmpShare>
inline void i16_tiles(const uint8_t* w, int64_t n, int64_t k, const int16_t* xq, const float* xd, const float* xs,
                      int64_t m, float* y, int64_t ldy, Share&& share = Share{}) {
    using V = typename Vertical<F>::type;
    const int64_t nb = k / QK;
#ifdef LLMSERVE_AVX512_VNNI
    if (amx_rows(m)) {
        amx_tiles<V>(w, n, k, xq, xd, xs, m, y, ldy, share);
        return;
    }
    auto run = [&](auto tiles) {   // T consecutive tiles a call of tile_v16
        constexpr int T = decltype(tiles)::value;
        tiles_for(n / (T * TILE), m, share, [&](int64_t t, int64_t m0, int64_t m1) {
            const uint8_t* wt = w + T * t * nb * V::GROUP;
            in_even_passes<8>(m0, m1, [&](auto R, int64_t r) {
                tile_v16<V, decltype(R)::value, T>(wt, nb, k, xq + r * k, xd + r * nb, xs + r * nb,
                                                   y + r * ldy + T * TILE * t, ldy, r == m0);
            });
        });
    };
    if (m >= PAIRED_MIN_ROWS && n % (2 * TILE) == 0) run(std::integral_constant<int, 2>{});   // tiles in pairs
    else run(std::integral_constant<int, 1>{});
#else
    tiles_for(n / TILE, m, share, [&](int64_t t, int64_t m0, int64_t m1) {
        const uint8_t* wt = w + t * nb * V::GROUP;
        in_even_passes<4>(m0, m1, [&](auto R, int64_t r) {
            tile_v8<V, decltype(R)::value>(wt, nb, k, xq + r * k, xd + r * nb, xs + r * nb, y + r * ldy + TILE * t,
                                           ldy, r == m0);
        });
    });
#endif
}

}  // namespace llmserve

// The integer block products on AMX tiles (Intel Sapphire Rapids and later), bit for bit what tile_v16 computes:
// included by blocks.h in the AVX-512 build, chosen at run time (amx_rows) where the CPU has AMX-TILE, AMX-INT8 and
// AVX512-VBMI and the kernel lets this process use the tile registers (arch_prctl XTILEDATA).
//
// AMX multiplies bytes, not int16 words. The activations' quants are 12-bit (|x| ≤ 2047, blocks.h), so for Q4_1,
// whose weights are nibbles, x = 16·(x >> 4) + (x & 15) and a block's sum is Σ 16w·(x >> 4) + w·(x & 15): one
// TDPBSUD of the 64 activation bytes (32 high parts, signed; 32 low nibbles) by 16w (≤ 240) and w, 16 activation
// rows × 16 weight rows a product. Q8_0's signed bytes times 16 are not bytes, so there x = 256·hi + lo (hi
// signed, lo unsigned) and Σw·x = 256·Σw·hi + Σw·lo: two products (TDPBSSD/TDPBUSD) of half a tile each. The
// sums are exact in int32 either way, so Σw·x is the integer vpdpwssd sum. Per row the fp32 steps are then
// tile_v16's, in its order: the conversion, d · xd, one FMA, and Q4_1's m · xs. Where vpdpwssd spends 16 multiply
// instructions a row and block, the tiles take one or two instructions for 16 rows, and the fp32 steps are what is
// left.
//
// Layouts. B's rows are 64 bytes, 4 bytes for each of the 16 weight rows; a tile row of activations is 64 bytes
// (Q4_1) or 32 (Q8_0: two tiles, the low and the high bytes). The vertical layout's 64-byte chunks (blocks.h) are B
// rows already for Q8_0: chunk c, word 2j + e holds w[j][4c + e] low and w[j][4c + 2 + e] high, so weight row j's
// dword is k = 4c + (0, 2, 1, 3). Q4_1's chunks hold four pairs in nibbles and are spread into two such rows per
// chunk, and the 8 rows again times 16 before them. The activation bytes are laid out in that order (0, 2, 1, 3)
// within each group of four; a dot product over the four does not depend on it.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

namespace llmserve {

// activation rows from which a product runs on the tiles (0: never); llmserve_quant_amx sets it
inline int64_t amx_min_rows = 16;

inline bool amx_usable();
// a product of m activation rows runs on the tiles
inline bool amx_rows(int64_t m) { return amx_min_rows > 0 && m >= amx_min_rows && amx_usable(); }
constexpr int64_t AMX_CHUNK = 8;   // 16-row tiles
// the nibble form: x >> 4 a signed byte, x & 15 a nibble
static_assert(QUANT_LEVELS <= 2047, "Q4_1's one-product form needs |x| <= 2047");

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512vbmi")

// unrolled (blocks.h) compiled for these targets, so that its calls inline here: the 16 accumulator rows of a
// product are then 16 registers (as loops they lived on the stack, a store and a load a row and block)
template <class Fn, int... C>
__attribute__((always_inline)) inline void amx_unrolled_seq(Fn& fn, std::integer_sequence<int, C...>) {
    (fn(std::integral_constant<int, C>{}), ...);
}
template <int N, class Fn>
__attribute__((always_inline)) inline void amx_unrolled(Fn fn) {
    amx_unrolled_seq(fn, std::make_integer_sequence<int, N>{});
}

// CPUID leaf 7's feature words (ebx unused): AMX-TILE edx 24, AMX-INT8 edx 25, AMX-BF16 edx 22, AVX512-VBMI ecx 1
inline bool cpuid7_has(int edx_bit, int ecx_bit = -1) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return ((d >> edx_bit) & 1) && (ecx_bit < 0 || ((c >> ecx_bit) & 1));
}

// the CPU has tile registers and the kernel lets this process use them (asked once: arch_prctl XTILEDATA)
inline bool tiles_granted() {
    static const bool ok = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return cpuid7_has(24) && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
}

// the int16 products' instructions (AMX-INT8, and VBMI for the activations' byte shuffle), tiles granted
inline bool amx_usable() {
    static const bool ok = cpuid7_has(25, 1) && tiles_granted();
    return ok;
}

// the prefill attention's (AMX-BF16), tiles granted
inline bool amx_bf16_usable() {
    static const bool ok = cpuid7_has(22) && tiles_granted();
    return ok;
}

// a 64-byte aligned buffer of at least n bytes, grown as needed
struct AlignedBytes {
    std::vector<uint8_t> raw;
    uint8_t* get(size_t n) {
        if (raw.size() < n + 64) raw.resize(n + 64);
        return (uint8_t*)(((uintptr_t)raw.data() + 63) & ~(uintptr_t)63);
    }
};

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    // tile t: `rows` rows of `colsb` bytes
    void tile(int t, int tile_rows, int bytes) {
        rows[t] = (uint8_t)tile_rows;
        colsb[t] = (uint16_t)bytes;
    }
    // this thread's tile registers shaped so (ldtilecfg)
    void load() {
        // (GCC's ldtilecfg builtin does not tell the optimizer it reads the config: without this the stores can go)
        asm volatile("" : : "r"(this) : "memory");
        _tile_loadconfig(this);
    }
};

// Q8_0: tmm0 activations' low bytes, tmm1 their high bytes (16 rows × 32), tmm2 the weights (8 × 64), tmm4-tmm7 two
// sets of the two int32 sums (16 × 16). Q4_1: two sets of three, tmm0-tmm2 and tmm3-tmm5: the activations (16 rows
// × 64: a block's high parts, then its low nibbles), the weights (16 × 64: 16·w for the high parts, then w), the
// one int32 sum (16 × 16)
template <bool NIBBLES>
inline void amx_configure() {
    TileConfig cfg;
    if constexpr (NIBBLES) {
        for (int t = 0; t < 6; ++t) cfg.tile(t, 16, 64);
    } else {
        cfg.tile(0, 16, 32);
        cfg.tile(1, 16, 32);
        cfg.tile(2, 8, 64);
        for (int t = 4; t < 8; ++t) cfg.tile(t, 16, 64);
    }
    cfg.load();
}

// A product's activations in tile form, per row and block 64 bytes (order 0, 2, 1, 3 in each four): for Q8_0's
// products the 32 low bytes of the int16 quants, then the 32 high bytes; for Q4_1's (`nibbles`) the 32 high parts
// x >> 4 (signed, |x| ≤ 2047), then the 32 low nibbles x & 15. Rows padded with zeros to a multiple of 16, each 16
// rows' blocks in one piece (row r, block b at ((r / 16) · nb + b) · 1024 + (r % 16) · 64); the scales padded alike
struct AmxActivations {
    AlignedBytes buf;
    uint8_t* a = nullptr;
    float *d = nullptr, *s = nullptr;
    int64_t m = 0, padded = 0, nb = 0;
    bool nibbles = false;
    void reserve(int64_t rows, int64_t k, bool nibble_form) {
        m = rows;
        padded = (rows + 15) / 16 * 16;
        nb = k / QK;
        nibbles = nibble_form;
        const size_t a_bytes = padded * nb * 64;
        a = buf.get(a_bytes + 2 * padded * nb * sizeof(float));
        d = (float*)(a + a_bytes);
        s = d + padded * nb;
    }
    // row r (< padded) from its int16 quants and scales (nullptr: a padding row of zeros)
    void row(int64_t r, const int16_t* xq, const float* xd, const float* xs) {
        // the low bytes of words 0, 2, 1, 3, 4, 6, ...; then the high bytes of the same words (+ 1) or, for the
        // nibble form, the low bytes of the second operand's (+ 64)
        alignas(32) static const uint8_t low[32] = {0,  4,  2,  6,  8,  12, 10, 14, 16, 20, 18, 22, 24, 28, 26, 30,
                                                    32, 36, 34, 38, 40, 44, 42, 46, 48, 52, 50, 54, 56, 60, 58, 62};
        const __m256i first = _mm256_load_si256((const __m256i*)low);
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(first),
                                               _mm256_add_epi8(first, _mm256_set1_epi8(nibbles ? 64 : 1)), 1);
        uint8_t* out = a + (r / 16) * nb * 1024 + (r % 16) * 64;
        for (int64_t b = 0; b < nb; ++b) {
            __m512i v = _mm512_setzero_si512();
            if (xq) {
                const __m512i x = _mm512_loadu_si512(xq + 32 * b);
                v = nibbles ? _mm512_permutex2var_epi8(_mm512_srai_epi16(x, 4), idx,
                                                       _mm512_and_si512(x, _mm512_set1_epi16(15)))
                            : _mm512_permutexvar_epi8(idx, x);
            }
            _mm512_store_si512(out + b * 1024, v);
        }
        for (int64_t b = 0; b < nb; ++b) {
            d[r * nb + b] = xq ? xd[b] : 0.0f;
            s[r * nb + b] = xq ? xs[b] : 0.0f;
        }
    }
    void rows(const int16_t* xq, const float* xd, const float* xs, int64_t rows, int64_t k, bool nibble_form) {
        reserve(rows, k, nibble_form);
        for (int64_t r = 0; r < padded; ++r)
            if (r < m) row(r, xq + r * k, xd + r * nb, xs + r * nb);
            else row(r, nullptr, nullptr, nullptr);
    }
};

// Q4_1's block as 16 B rows: chunk c (pairs 4c..4c+3 in nibbles) as rows 8 + 2c and 9 + 2c, word 2j + e holding
// w[j][4c' + e] low and w[j][4c' + 2 + e] high (c' the row); rows 0-7 the same times 16 (≤ 240: a byte), the
// weights of the activations' high parts
inline void q4_1_rows(const uint8_t* g, uint8_t* out) {
    const __m512i lo = _mm512_set1_epi16(0x000F), hi = _mm512_set1_epi16(0x0F00);
    for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(g + 64 + 64 * c);
        const __m512i r0 = _mm512_or_si512(_mm512_and_si512(v, lo), _mm512_and_si512(_mm512_slli_epi16(v, 4), hi));
        const __m512i r1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 8), lo),
                                           _mm512_and_si512(_mm512_srli_epi16(v, 4), hi));
        _mm512_store_si512(out + 512 + 128 * c, r0);
        _mm512_store_si512(out + 512 + 128 * c + 64, r1);
        _mm512_store_si512(out + 128 * c, _mm512_slli_epi16(r0, 4));
        _mm512_store_si512(out + 128 * c + 64, _mm512_slli_epi16(r1, 4));
    }
}

// One 32-block of a 16 × 16 product onto the tiles: the activations and weights loaded, the sums into the SET's
// tiles (two sets, so one block's products run while the last one's fp32 steps do). Q4_1: one product,
// Σ 16w·(x >> 4) + w·(x & 15) = Σ w·x (TDPBSUD, |16w·(x >> 4)| ≤ 240·128); Q8_0: two, Σ w·hi and Σ w·lo
template <class V, int SET>
__attribute__((always_inline)) inline void amx_issue(const uint8_t* a, const uint8_t* brows) {
    // (the tile intrinsics take their registers' numbers as literals)
    if constexpr (V::HAS_MIN) {
#define LLMSERVE_AMX_ISSUE(A, B, C)              \
    _tile_loadd(A, a, 64);                       \
    _tile_loadd(B, brows, 64);                   \
    _tile_zero(C);                               \
    _tile_dpbsud(C, A, B);
        if constexpr (SET == 0) {
            LLMSERVE_AMX_ISSUE(0, 1, 2)
        } else {
            LLMSERVE_AMX_ISSUE(3, 4, 5)
        }
#undef LLMSERVE_AMX_ISSUE
    } else {
#define LLMSERVE_AMX_ISSUE(H, L)                 \
    _tile_loadd(0, a, 64);                       \
    _tile_loadd(1, a + 32, 64);                  \
    _tile_loadd(2, brows, 64);                   \
    _tile_zero(H);                               \
    _tile_zero(L);                               \
    _tile_dpbssd(H, 1, 2);                       \
    _tile_dpbusd(L, 0, 2);
        if constexpr (SET == 0) {
            LLMSERVE_AMX_ISSUE(4, 5)
        } else {
            LLMSERVE_AMX_ISSUE(6, 7)
        }
#undef LLMSERVE_AMX_ISSUE
    }
}

// The block's sums out of SET's tiles, then per row tile_v16's fp32 steps: Σ (Q8_0: 256·Σhi + Σlo) converted,
// times d · xd (FMA), then Q4_1's m · xs
template <class V, int SET>
__attribute__((always_inline)) inline void amx_drain(const uint8_t* g, const float* d, const float* s, int64_t nb,
                                                     int32_t (*sums)[16][16], __m512* acc) {
    if constexpr (V::HAS_MIN) {
        if constexpr (SET == 0) _tile_stored(2, sums[0], 64);
        else _tile_stored(5, sums[0], 64);
    } else if constexpr (SET == 0) {
        _tile_stored(4, sums[0], 64);
        _tile_stored(5, sums[1], 64);
    } else {
        _tile_stored(6, sums[0], 64);
        _tile_stored(7, sums[1], 64);
    }
    const __m512 dv = V::d(g);
    __m512 mv;
    if constexpr (V::HAS_MIN) mv = V::m(g);
    amx_unrolled<16>([&](auto r) __attribute__((always_inline)) {
        __m512i x;
        if constexpr (V::HAS_MIN) x = _mm512_load_si512(sums[0][r]);
        else x = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[0][r]), 8), _mm512_load_si512(sums[1][r]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x), _mm512_mul_ps(dv, _mm512_set1_ps(d[r * nb])), acc[r]);
        if constexpr (V::HAS_MIN) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(s[r * nb]), acc[r]);
    });
}

// y [m, n] (row stride ldy) = activations in tile form (x) · Wᵀ over the vertical layout, on the tiles, inside a
// parallel region (no barrier at the end): the threads take weight tiles; per tile and 16 activation rows the
// blocks in order, each block's products issued before the last block's fp32 steps
template <class V, class Share = OmpShare>
inline void amx_tiles(const uint8_t* w, int64_t n, int64_t k, const AmxActivations& x, float* y, int64_t ldy,
                      Share&& share = Share{}) {
    const int64_t nb = k / QK, m = x.m, mtiles = x.padded / 16;
    thread_local AlignedBytes bbuf;       // Q4_1: one weight tile's B rows
    uint8_t* bscratch = bbuf.get(nb * 1024);
    amx_configure<V::HAS_MIN>();
    alignas(64) int32_t sums[2][2][16][16];
    // 16-row tiles in chunks of AMX_CHUNK (their activations stay in L2 while every weight tile passes; a weight
    // tile's blocks stay in L1 for the chunk's row tiles)
    for (int64_t i0 = 0; i0 < mtiles; i0 += AMX_CHUNK) {
        const int64_t i1 = i0 + AMX_CHUNK < mtiles ? i0 + AMX_CHUNK : mtiles;
        share.halves(n / 16, [&](int64_t t) {
            const uint8_t* wt = w + t * nb * V::GROUP;
            const uint8_t* brows;
            int64_t bstep;
            if constexpr (V::HAS_MIN) {
                for (int64_t b = 0; b < nb; ++b) q4_1_rows(wt + b * V::GROUP, bscratch + 1024 * b);
                brows = bscratch;
                bstep = 1024;
            } else {
                brows = wt + 32;
                bstep = V::GROUP;
            }
            for (int64_t i = i0; i < i1; ++i) {
                const uint8_t* ai = x.a + i * nb * 1024;
                const float* di = x.d + 16 * i * nb;
                const float* si = x.s + 16 * i * nb;
                __m512 acc[16];
                amx_unrolled<16>([&](auto r) __attribute__((always_inline)) { acc[r] = _mm512_setzero_ps(); });
                for (int64_t b = 0; b < nb; b += 2) {
                    amx_issue<V, 0>(ai + 1024 * b, brows + bstep * b);
                    if (b > 0) amx_drain<V, 1>(wt + (b - 1) * V::GROUP, di + b - 1, si + b - 1, nb, sums[1], acc);
                    if (b + 1 < nb) amx_issue<V, 1>(ai + 1024 * (b + 1), brows + bstep * (b + 1));
                    amx_drain<V, 0>(wt + b * V::GROUP, di + b, si + b, nb, sums[0], acc);
                }
                if (nb % 2 == 0) amx_drain<V, 1>(wt + (nb - 1) * V::GROUP, di + nb - 1, si + nb - 1, nb, sums[1], acc);
                const int64_t rows = m - 16 * i < 16 ? m - 16 * i : 16;
                amx_unrolled<16>([&](auto r) __attribute__((always_inline)) {
                    if (r < rows) _mm512_storeu_ps(y + (16 * i + r) * ldy + 16 * t, acc[r]);
                });
            }
        });
    }
}

// The same inside a region whose threads hold the int16 quants (the one-call step): each thread copies them into
// tile form for itself (a few microseconds at 64 rows), then takes weight tiles
template <class V, class Share>
inline void amx_tiles(const uint8_t* w, int64_t n, int64_t k, const int16_t* xq, const float* xd, const float* xs,
                      int64_t m, float* y, int64_t ldy, Share& share) {
    thread_local AmxActivations x;
    x.rows(xq, xd, xs, m, k, V::HAS_MIN);
    amx_tiles<V>(w, n, k, x, y, ldy, share);
}

#pragma GCC pop_options

}  // namespace llmserve

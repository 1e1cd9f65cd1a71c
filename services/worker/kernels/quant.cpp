// GGUF Q4_1 and Q8_0 weights times fp32 activation rows, one matmul a call: y[m, n] = x[m, k] · W[n, k]ᵀ
// (blocks.h describes the layout and the int16 activations). Built twice (kernels/__init__.py), AVX-512 VNNI and
// AVX2, over the same layout and with the same bits.
#include <vector>

#include <omp.h>

#include "blocks.h"

namespace {

using namespace llmserve;

// whether a product of n outputs, m rows and k inputs is worth an OpenMP region (n / 4 × rows × blocks: the
// threshold as it was measured, in units of the former 4-row tiles)
inline bool threaded(int64_t n, int64_t m, int64_t k) { return n / 4 * m * (k / QK) >= 4096; }

// int16 activations quantized here, on the calling thread (576-1536 values a row), then the integer tiles; on the
// AMX tiles (from amx_min_rows rows) the rows are quantized and put in tile form by the region's threads first
template <class F>
void matmul_i16(const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy) {
    thread_local Quants x16;
    x16.reserve(m, k);
#ifdef LLMSERVE_AVX512_VNNI
    if (amx_rows(m)) {
        thread_local AmxActivations tiles;
        tiles.reserve(m, k, Vertical<F>::type::HAS_MIN);
        Quants* q = &x16;
        AmxActivations* t = &tiles;
        const int64_t nb = k / QK;
        thread_local Phases phases_;
        Phases& phases = phases_;
        phases.reset(1 + matmul_phases(m));
#pragma omp parallel
        {
            PhaseShare share(phases, omp_get_num_threads());
            share.halves(t->padded, [&](int64_t r) {
                if (r < m) {
                    q->row(x + r * ldx, r, k);
                    t->row(r, q->q.data() + r * k, q->d.data() + r * nb, q->s.data() + r * nb);
                } else {
                    t->row(r, nullptr, nullptr, nullptr);
                }
            });
            share.wait();
            amx_tiles<typename Vertical<F>::type>(w, n, k, *t, y, ldy, share);
            share.leave(omp_get_thread_num() == 0);
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

}  // namespace

extern "C" {

// 1: the CPU this runs on has what this build uses (AVX2, FMA, F16C; and AVX-512 F/BW/VL/VNNI for the avx512 one)
int llmserve_quant_cpu_ok() {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#ifdef LLMSERVE_AVX512_VNNI
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return avx2;
#endif
}

// From how many activation rows the int16 products run on the AMX tiles (0: never; the same bits either way);
// returns 1 where this CPU and process can use them (the avx512 build), else 0
int llmserve_quant_amx(int64_t min_rows) {
#ifdef LLMSERVE_AVX512_VNNI
    amx_min_rows = min_rows;
    return amx_usable() ? 1 : 0;
#else
    (void)min_rows;
    return 0;
#endif
}

// rows a tile of the layout holds (quant_linear.repack): 16 in both builds
int64_t llmserve_quant_tile_rows() { return TILE; }

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

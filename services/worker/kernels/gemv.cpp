// One row times a bfloat16 weight matrix, AVX-512 BF16: y[N] = W[N, K] · x[K], fp32 sums rounded once.
//
// At batch 1 a decode step is a stream of weight bytes: oneDNN's matmul of one row reads its prepacked
// weights at ~36 GB/s here; this reads the plain row-major weights at ~59 GB/s. 16 weight rows at a
// time, each a run of vdpbf16ps over K, folded into 16 outputs (simd.h); the row tiles are spread over
// torch's OpenMP threads.
#include "simd.h"

#include <immintrin.h>
#include <cstdint>

#include <omp.h>

using namespace llmserve;

extern "C" {

// 1 if this kernel handles an [n, k] weight
int llmserve_gemv_supports(int64_t n, int64_t k) { return n % 16 == 0 && k % 32 == 0 && n > 0 && k > 0; }

// w: [n, k] row-major; x: [k]; y: [n]
void llmserve_gemv(const bf16* w, const bf16* x, bf16* y, int64_t n, int64_t k) {
    const int64_t kv = k / 32;
#pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < n; r0 += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        const bf16* base = w + r0 * k;
        for (int64_t j = 0; j < kv; ++j) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + j * 32);
            for (int i = 0; i < 16; ++i)
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(base + i * k + j * 32), xv);
        }
        store16(y + r0, fold16(acc));
    }
}

}

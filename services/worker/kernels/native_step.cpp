// A whole decode step of the native path in one call: every layer of a Llama-family model over its GGUF blocks,
// for a step whose rows are all decode rows (one query each, a speculative draft's queries included).
//
// Called op by op from Python, a one-row step is 121 matmuls and ~150 glue calls, each with its own tensor
// allocations, ctypes call and OpenMP region: ~2.3 ms of the matmuls' 9.7 ms and most of the rest of the step
// went there (docs/performance.md). Here one OpenMP region runs the step, in phases:
//   per layer: quantize → qkv tiles → rotary + KV write → attention parts → merge → quantize → o tiles →
//   add + norm + quantize → gate/up tiles → silu · up + quantize → down tiles → add + the next norm.
// The phases hand out their work and end as share.h's PhaseShare does: a phase is done when its work is, so a
// thread the kernel preempts for the services holds up the other only for what it has claimed, and OpenMP's
// barriers are not used (the served worker runs libgomp passive, OMP_WAIT_POLICY=PASSIVE in
// services/worker/__main__.py, where each of the step's ~330 barriers would be a futex sleep and wake-up: a
// one-row step 9.7-12 ms against 7.6-8.1 ms spinning; spinning instead, GOMP_SPINCOUNT, makes two processes
// sharing the cores 2-12x slower). A waiting thread spins briefly, then yields its core until the phase is done.
// Each phase is the same arithmetic, row for row, as the one-op-a-call functions (blocks.h, native_glue.h), so
// a row's result is bit for bit what those give (a test checks it): activations in int16 per 32-block, the
// weights' tiles as quant.cpp's *_i16, the decode attention's parts as paged_decode's.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "blocks.h"
#include "native_glue.h"

extern "C" {

// One matrix: repacked blocks (quant_linear.py), n output rows padded to whole tiles of blocks.h's TILE rows (also
// the row stride of its output), k inputs, type 0 = Q4_1, 1 = Q8_0
struct NativeMatrix {
    const uint8_t* w;
    int64_t n, k, type;
};

struct NativeLayer {
    NativeMatrix qkv, o, gate_up, down;   // qkv: [q heads | k heads | v heads]; gate_up: [gate | up]
    const float* input_norm;
    const float* post_norm;
    void* k_cache;                        // [slots, kv_heads, head_dim], fp32, fp16, or fp16 and q8 values (kv_type; native_glue.h)
    void* v_cache;
};

struct NativeModel {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, kv_type;   // 0 fp32, 1 fp16, 2 fp16 keys, q8 values
    float eps, scale;
    const float* final_norm;
    const NativeLayer* layer;
};

}

namespace {

using namespace llmserve;

// y [rows, M.n] = the quantized rows · Wᵀ, every thread of the region taking tiles, then waiting for them all
inline void matmul(const NativeMatrix& M, const Quants& x, int64_t rows, float* y, PhaseShare& share) {
    if (M.type == 0)
        i16_tiles<Q4_1>(M.w, M.n, M.k, x.q.data(), x.d.data(), x.s.data(), rows, y, M.n, share);
    else
        i16_tiles<Q8_0>(M.w, M.n, M.k, x.q.data(), x.d.data(), x.s.data(), rows, y, M.n, share);
    share.wait();
}

template <class TK, class TV>
void decode_step(const NativeModel& m, int64_t rows, float* h, const float* cos, const float* sin,
                 const int64_t* slots, const int64_t* tables, int64_t width, const int64_t* lens, float* out) {
    const int64_t hidden = m.hidden, d = m.head_dim, inter = m.intermediate, group = m.heads / m.kv_heads;
    const NativeLayer* layers = m.layer;
    const int64_t qkv_n = layers[0].qkv.n, gu_n = layers[0].gate_up.n;
    // scratch kept between steps (on the calling thread: the region's threads use it through these names, bound
    // here, not their own thread_local copies)
    thread_local std::vector<float> normed, qkv, attn, delta, gu, act;
    thread_local Quants quants_;
    thread_local DecodePlan plan_;
    Quants& quants = quants_;
    DecodePlan& plan = plan_;
    normed.resize(rows * hidden);
    qkv.resize(rows * qkv_n);
    attn.resize(rows * m.heads * d);
    delta.resize(rows * hidden);
    gu.resize(rows * gu_n);
    act.resize(rows * inter);
    quants.reserve(rows, std::max({hidden, inter, m.heads * d}));
    // the same contexts in every layer
    plan.build(rows, lens, m.block_size, m.kv_heads, group, d, tables, width, omp_get_max_threads());
    float *nrm = normed.data(), *qkvp = qkv.data(), *att = attn.data(), *dl = delta.data(), *gup = gu.data(),
          *ac = act.data();
    // the phases: the first norm, then per layer four matmuls (each as many as i16_tiles runs) and seven loops
    thread_local Phases phases_;
    Phases& phases = phases_;
    phases.reset(1 + m.layers * (7 + 4 * matmul_phases(rows)));
#pragma omp parallel
    {
        std::vector<float> scores(plan.scratch);
        PhaseShare share(phases, omp_get_num_threads());
        share.halves(rows, [&](int64_t r) {
            add_rms_norm_row(h + r * hidden, nullptr, layers[0].input_norm, nrm + r * hidden, hidden, m.eps);
            quants.row(nrm + r * hidden, r, hidden);
        });
        share.wait();
        for (int64_t l = 0; l < m.layers; ++l) {
            const NativeLayer& L = layers[l];
            TK* k_cache = (TK*)L.k_cache;
            TV* v_cache = (TV*)L.v_cache;
            matmul(L.qkv, quants, rows, qkvp, share);
            share.halves(rows, [&](int64_t r) {
                rope_store_row(qkvp + r * qkv_n, m.heads, m.kv_heads, d, cos + r * d, sin + r * d, slots[r], k_cache,
                               v_cache);
            });
            share.wait();
            decode_parts(plan, qkvp, qkv_n, (const TK*)k_cache, (const TV*)v_cache, m.kv_heads, d, group, tables, width,
                         lens, m.block_size, m.scale, scores.data(), share);
            share.wait();
            decode_merge(plan, rows, m.kv_heads, d, group, att, m.heads * d, share);
            share.wait();
            share.halves(rows, [&](int64_t r) { quants.row(att + r * m.heads * d, r, m.heads * d); });
            share.wait();
            matmul(L.o, quants, rows, dl, share);
            share.halves(rows, [&](int64_t r) {
                add_rms_norm_row(h + r * hidden, dl + r * L.o.n, L.post_norm, nrm + r * hidden, hidden, m.eps);
                quants.row(nrm + r * hidden, r, hidden);
            });
            share.wait();
            matmul(L.gate_up, quants, rows, gup, share);
            share.halves(rows, [&](int64_t r) {
                silu_mul_row(gup + r * gu_n, gup + r * gu_n + inter, ac + r * inter, inter);
                quants.row(ac + r * inter, r, inter);
            });
            share.wait();
            matmul(L.down, quants, rows, dl, share);
            const bool last = l + 1 == m.layers;
            const float* next_norm = last ? m.final_norm : layers[l + 1].input_norm;
            share.halves(rows, [&](int64_t r) {
                float* o = last ? out + r * hidden : nrm + r * hidden;
                add_rms_norm_row(h + r * hidden, dl + r * L.down.n, next_norm, o, hidden, m.eps);
                if (!last) quants.row(o, r, hidden);
            });
            share.wait();
        }
    }
}

}  // namespace

extern "C" {

// 0 when ``m`` is a model decode_step runs: every layer's matrices shaped alike and as the glue expects (q, k, v
// of head_dim; o and down back to hidden, no padding; gate and up of intermediate each), head_dim a multiple of
// 16 up to 256, at most 64 query heads a KV head, hidden and intermediate multiples of 32 (one int16 block);
// else 1
int llmserve_native_step_supports(const NativeModel* m) {
    const int64_t d = m->head_dim, qkv = (m->heads + 2 * m->kv_heads) * d;
    if (m->layers < 1 || m->kv_heads < 1 || m->heads % m->kv_heads || m->heads / m->kv_heads > 64 || d % 16 ||
        d > 256 || m->hidden % QK || m->intermediate % QK || (m->heads * d) % QK)
        return 1;
#ifdef __AVX512F__
    if (m->kv_type < 0 || m->kv_type > 2) return 1;
#else
    if (m->kv_type < 0 || m->kv_type > 1) return 1;   // q8 in the avx512 build only
#endif
    for (int64_t l = 0; l < m->layers; ++l) {
        const NativeLayer& L = m->layer[l];
        const NativeMatrix* all[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
        for (const NativeMatrix* M : all)
            if (!M->w || M->type < 0 || M->type > 1 || M->n % TILE) return 1;
        if (L.qkv.k != m->hidden || L.qkv.n != qkv + (-qkv & (TILE - 1)) || L.qkv.n != m->layer[0].qkv.n) return 1;
        if (L.o.k != m->heads * d || L.o.n != m->hidden) return 1;
        if (L.gate_up.k != m->hidden || L.gate_up.n != 2 * m->intermediate) return 1;
        if (L.down.k != m->intermediate || L.down.n != m->hidden) return 1;
        if (!L.input_norm || !L.post_norm || !L.k_cache || !L.v_cache) return 1;
    }
    return m->final_norm ? 0 : 1;
}

// One decode step: rows decode rows, row r at the position whose cos/sin are row r of cos, sin [rows, head_dim],
// its key and value written to slot slots[r], attending to the first lens[r] positions of block table r (tables
// [rows, width]). h [rows, hidden] (contiguous): the embeddings in, the residual stream out; out [rows, hidden]:
// the hidden states after the final norm. The caller has checked the model with llmserve_native_step_supports.
void llmserve_native_step(const NativeModel* m, int64_t rows, float* h, const float* cos, const float* sin,
                          const int64_t* slots, const int64_t* tables, int64_t width, const int64_t* lens, float* out) {
    if (m->kv_type == 1)
        decode_step<uint16_t, uint16_t>(*m, rows, h, cos, sin, slots, tables, width, lens, out);
#ifdef __AVX512F__
    else if (m->kv_type == 2)
        decode_step<uint16_t, int8_t>(*m, rows, h, cos, sin, slots, tables, width, lens, out);
#endif
    else
        decode_step<float, float>(*m, rows, h, cos, sin, slots, tables, width, lens, out);
}

}

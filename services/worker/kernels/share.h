// How the threads of a parallel region share a loop's iterations.
//
// OmpShare: OpenMP's work-sharing, what the op-by-op kernels' regions run (quant.cpp, native_ops.cpp).
//
// PhaseShare: the one-call decode step (native_step.cpp). Its ~330 phases a step each hand out their iterations
// by claims on a counter of their own, and a phase is done when all of its iterations are, counted, not when
// every thread has arrived. A thread the kernel preempts (served, the engine, router and client share the two
// cores with the step) holds up the others only for the iterations it has claimed: the others go on with the rest
// of the phase and the phases after it, and it catches up through phases with nothing left to claim. At a
// barrier that waits for every thread, each preemption of either thread stalled the other for its whole length.
// In process, with two processes taking ~40% of one core in 0.25-0.75 ms bursts, a one-row step took 9.8-10.0 ms
// with barriers and 8.0-8.5 ms with these claims (alone 5-6 ms either way); served, one stream's ITL fell 9%
// (docs/performance.md). Which thread runs an iteration changes no bits: every iteration writes its own outputs.
#pragma once

#include <immintrin.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace llmserve {

struct OmpShare {
    // runs of iterations shrinking as they go (the first 1/threads of the loop, the last 8): long contiguous runs
    // of weight tiles are what the hardware prefetchers stream best
    template <class Body>
    void guided(int64_t n, Body body) {
#pragma omp for schedule(guided, 8) nowait
        for (int64_t i = 0; i < n; ++i) body(i);
    }
    template <class Body>
    void each(int64_t n, Body body) {   // one at a time
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t i = 0; i < n; ++i) body(i);
    }
    template <class Body>
    void halves(int64_t n, Body body) {   // one contiguous share a thread
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < n; ++i) body(i);
    }
};

// One phase's counters: the next iteration to claim, the iterations done, and how many it has. Every thread stores
// the size as it starts the phase, though each knows it: the store takes the line for the claim that follows
// (sizes kept on each thread instead measured 2% slower with competitors, 8.43 against 8.23 ms a step, 8 runs each)
struct alignas(64) Phase {
    std::atomic<int64_t> next{0}, done{0}, total{0};
};

// The phases of one region, reset by the calling thread before it (the region's start orders the writes)
struct Phases {
    std::unique_ptr<Phase[]> at;
    int64_t size = 0;
    alignas(64) std::atomic<int> leaving{0};   // threads other than the master done with the region (leave())
    void reset(int64_t n) {
        leaving.store(0, std::memory_order_relaxed);
        if (n > size) {
            at.reset(new Phase[n]);
            size = n;
        }
        for (int64_t i = 0; i < n; ++i) {
            at[i].next.store(0, std::memory_order_relaxed);
            at[i].done.store(0, std::memory_order_relaxed);
        }
    }
};

// A thread's view of the region's phases: each loop it runs is the next phase, in the same order on every thread.
// The loops do not wait; wait() waits until every phase this thread has run so far is done.
class PhaseShare {
  public:
    PhaseShare(Phases& phases, int threads)
        : phases_(&phases), at_(phases.at.get()), size_(phases.size), threads_(threads) {}

    template <class Body>
    void guided(int64_t n, Body body) { claim(n, 8, threads_, body); }
    template <class Body>
    void each(int64_t n, Body body) { claim(n, 1, n, body); }
    template <class Body>
    void halves(int64_t n, Body body) { claim(n, 1, threads_, body); }

    void wait() {
        for (; waited_ < next_; ++waited_) {
            const Phase& f = at_[waited_];
            const int64_t n = f.total.load(std::memory_order_relaxed);   // stored by this thread
            spin_until([&] { return f.done.load(std::memory_order_acquire) >= n; });
        }
    }

    // The region's end, in place of a last wait(): the master goes last, once every other thread has left, so all
    // the region's work is done when it returns, and it never sleeps at OpenMP's join (under libgomp passive a futex
    // sleep and wake-up, tens of microseconds, in each of an op-by-op step's hundreds of regions); the others go on
    // to the join (and their sleep until the next region) as soon as their own claims are done
    void leave(bool master) {
        if (!master) {
            phases_->leaving.fetch_add(1, std::memory_order_release);
            return;
        }
        spin_until([&] { return phases_->leaving.load(std::memory_order_acquire) >= threads_ - 1; });
    }

  private:
    // a few hundred cycles of spinning (a phase's last iterations usually end within that), then the core goes to
    // whatever else is runnable between looks
    template <class Done>
    static void spin_until(Done done) {
        for (int i = 0; !done(); ++i) {
            if (i < 64) _mm_pause();
            else sched_yield();
        }
    }

    // runs of ceil(left / div) iterations, at least `least`, claimed until none are left
    template <class Body>
    void claim(int64_t n, int64_t least, int64_t div, Body& body) {
        if (next_ >= size_) std::abort();   // more phases than the caller reset: a bug, not an input
        Phase& f = at_[next_++];
        f.total.store(n, std::memory_order_relaxed);
        int64_t mine = 0, at = f.next.load(std::memory_order_relaxed);
        while (at < n) {
            int64_t run = (n - at + div - 1) / div;
            run = run < least ? least : run;
            run = run < n - at ? run : n - at;
            if (!f.next.compare_exchange_weak(at, at + run, std::memory_order_relaxed)) continue;   // `at` reloaded
            for (int64_t i = at; i < at + run; ++i) body(i);
            mine += run;
            at = f.next.load(std::memory_order_relaxed);
        }
        if (mine) f.done.fetch_add(mine, std::memory_order_release);
    }

    Phases* phases_;
    Phase* at_;
    int64_t size_, next_ = 0, waited_ = 0;
    int64_t threads_;
};

}  // namespace llmserve

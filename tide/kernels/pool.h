// A parallel loop that never waits for a thread the OS has taken away (tide.kernels' own threads).
//
// Why: the kernels used at::parallel_for, i.e. OpenMP with a static split. On a 2-core machine the
// engine's two threads share the cores with the worker's gRPC threads, the gateway, the client and
// idle services. Each time the OS lends one of those a core, one engine thread stops, and with a
// static split the other finishes its half and then waits at the barrier until the first one gets
// its core back: a step paid the others' CPU time about one-and-a-half times over (an external
// 1.5 ms of busy CPU every 12 ms added 1.5-2.3 ms to a 12 ms decode step; measured, see
// docs/results/engine-step).
//
// Here a job is cut into `n` chunks that the calling thread and the helpers take one at a time
// (an atomic counter), so a thread that is away simply takes fewer. A chunk a helper took but has
// not finished when everything else is done is run again by the caller after a short wait (a
// helper that is away for longer than a few chunk-times has been preempted): a chunk computes
// its outputs from inputs nobody changes while the job lives, with one fixed instruction
// sequence, so running it twice writes the same bits to the same place and the two writers race
// only between equal values. The job holds the tensors its chunks read and write (`keep`), so a
// helper that comes back late still writes into memory that is allocated: the job is freed when
// the last thread leaves it, not when the caller returns.
//
// The pool serves only while `set_threads(n > 0)` is in effect: an engine's decode and verification
// (tide.kernels.own_threads, which also keeps torch's own ops on one thread so that no OpenMP
// helper spins beside the pool's). Everything else, prompts included (torch's attention runs on
// OpenMP there), keeps at::parallel_for. One caller at a time: a second thread that calls while a
// job runs takes its chunks inline. Helpers
// spin for SPIN_US after a job (the next layer's job comes within microseconds), then sleep; the
// caller never waits for a sleeping helper to wake.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace tide_pool {

using Clock = std::chrono::steady_clock;

struct Job {
  std::function<void(int64_t)> run;  // computes chunk c; captures only values (pointers into `keep`)
  int64_t n = 0;
  std::vector<at::Tensor> keep;  // alive as long as any thread is inside the job
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  std::unique_ptr<std::atomic<uint8_t>[]> state;  // per chunk: 0 open, 1 taken, 2 done
};

class Pool {
 public:
  static constexpr int64_t SPIN_US = 300;       // helpers spin this long for the next job, then sleep
  static constexpr int64_t MIN_STEAL_US = 20;   // a taken chunk is redone after max(this, 4 chunk-times)

  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may sleep in it at process exit
    return *pool;
  }

  // Runs job->run(c) for c in [0, n) on this thread and the helpers; returns when all are done.
  void run(const std::shared_ptr<Job>& job) {
    const int want = threads_.load(std::memory_order_relaxed) - 1;
    bool expected = false;
    if (!enabled_.load(std::memory_order_relaxed) || want < 0) {  // OpenMP's static split
      at::parallel_for(0, job->n, 1, [&](int64_t a, int64_t b) {
        for (int64_t c = a; c < b; ++c) job->run(c);
      });
      return;
    }
    if (want < 1 || job->n < 2 || !busy_.compare_exchange_strong(expected, true)) {
      for (int64_t c = 0; c < job->n; ++c) job->run(c);
      return;
    }
    ensure_helpers(want);
    job->state.reset(new std::atomic<uint8_t>[job->n]);
    for (int64_t c = 0; c < job->n; ++c) job->state[c].store(0, std::memory_order_relaxed);
    {
      std::lock_guard<Spin> js(job_lock_);
      job_ = job;
      seq_.fetch_add(1, std::memory_order_seq_cst);
    }
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      // A helper counts itself sleeping and checks the sequence number under mu_, then waits: taking
      // mu_ here orders this notify after that check or before it (no wake-up lost).
      { std::lock_guard<std::mutex> lk(mu_); }
      cv_.notify_all();
    }
    const auto t0 = Clock::now();
    const int64_t mine = work(*job, /*helper=*/false);
    finish(*job, mine, Clock::now() - t0);
    {
      std::lock_guard<Spin> js(job_lock_);
      job_.reset();  // helpers still inside hold their own reference
    }
    busy_.store(false, std::memory_order_release);
  }

  // Off: the chunks go to at::parallel_for instead (OpenMP, a static split), as before this pool.
  void set_enabled(bool on) { enabled_.store(on); }
  // Threads a job runs on, the caller included; 0: none, jobs go to OpenMP (at::parallel_for).
  void set_threads(int n) { threads_.store(n); }
  bool enabled() const { return enabled_.load(); }
  // Tests only: helpers sleep this long inside every chunk they take (a stand-in for a preemption,
  // which no test can cause on demand), so that the caller has to redo their chunks.
  void set_helper_delay_us(int64_t us) { helper_delay_us_.store(us); }
  int64_t chunks_redone() const { return redone_.load(); }

 private:
  Pool() = default;

  // Take and run chunks until none is left; returns how many this thread ran.
  int64_t work(Job& job, bool helper) {
    int64_t ran = 0;
    for (;;) {
      const int64_t c = job.next.fetch_add(1, std::memory_order_relaxed);
      if (c >= job.n) break;
      uint8_t open = 0;  // the caller may have redone it already (this thread was away since the fetch)
      if (!job.state[c].compare_exchange_strong(open, 1, std::memory_order_acq_rel)) continue;
      if (helper) {
        const int64_t delay = helper_delay_us_.load(std::memory_order_relaxed);
        if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      }
      job.run(c);
      complete(job, c);
      ++ran;
    }
    return ran;
  }

  // Mark chunk c done (from open or taken); the first to do so counts it.
  static void complete(Job& job, int64_t c) {
    uint8_t s = job.state[c].load(std::memory_order_acquire);
    while (s != 2) {
      if (job.state[c].compare_exchange_weak(s, 2, std::memory_order_acq_rel)) {
        job.finished.fetch_add(1, std::memory_order_release);
        return;
      }
    }
  }

  // The caller's wait for chunks still in a helper's hands; redoes those held too long.
  void finish(Job& job, int64_t mine, Clock::duration spent) {
    const auto per_chunk = mine > 0 ? spent / mine : Clock::duration::zero();
    const auto patience = std::max<Clock::duration>(std::chrono::microseconds(MIN_STEAL_US), 4 * per_chunk);
    const auto since = Clock::now();
    int spins = 0;
    while (job.finished.load(std::memory_order_acquire) < job.n) {
      _mm_pause();
      if (++spins % 64 || Clock::now() - since < patience) continue;
      // Every chunk was fetched (this thread ran out of them): one not done is in a helper's hands,
      // taken (1), or fetched and not yet marked (0) if the helper was stopped in between.
      for (int64_t c = 0; c < job.n; ++c) {
        if (job.state[c].load(std::memory_order_acquire) == 2) continue;
        job.run(c);  // same inputs, same instructions: the same bits the helper will write
        complete(job, c);
        redone_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  void ensure_helpers(int want) {
    while (static_cast<int>(helpers_) < want) {
      std::thread([this] { helper_loop(); }).detach();
      ++helpers_;
    }
  }

  void helper_loop() {
    uint64_t seen = 0;  // a helper started for a job joins that job
    for (;;) {
      auto last = Clock::now();
      int spins = 0;
      while (seq_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++spins % 256) continue;
        if (Clock::now() - last > std::chrono::microseconds(SPIN_US)) {
          std::unique_lock<std::mutex> lk(mu_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lk, [&] { return seq_.load(std::memory_order_seq_cst) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_acq_rel);
          break;
        }
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<Spin> js(job_lock_);  // a few instructions: no syscall against the caller
        job = job_;
        seen = seq_.load(std::memory_order_acquire);
      }
      if (job) work(*job, /*helper=*/true);
    }
  }

  // A lock for a few instructions (copying job_): spins instead of sleeping in the kernel.
  struct Spin {
    std::atomic_flag flag = ATOMIC_FLAG_INIT;
    void lock() {
      while (flag.test_and_set(std::memory_order_acquire)) _mm_pause();
    }
    void unlock() { flag.clear(std::memory_order_release); }
  };

  std::mutex mu_;  // for the helpers' sleep (cv_)
  std::condition_variable cv_;
  Spin job_lock_;
  std::shared_ptr<Job> job_;  // guarded by job_lock_
  std::atomic<uint64_t> seq_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> busy_{false};
  std::atomic<bool> enabled_{true};
  std::atomic<int> threads_{0};
  std::atomic<int64_t> helper_delay_us_{0};
  std::atomic<int64_t> redone_{0};
  size_t helpers_ = 0;  // only the thread holding busy_ starts helpers
};

// parallel(n, fn, keep): fn(c) for every chunk c in [0, n), on the pool (see above). `fn` must
// capture by value and be idempotent; `keep` are the tensors it reads and writes.
template <typename F>
void parallel(int64_t n, F fn, std::vector<at::Tensor> keep) {
  if (n <= 0) return;
  auto job = std::make_shared<Job>();
  job->run = std::move(fn);
  job->n = n;
  job->keep = std::move(keep);
  Pool::get().run(job);
}

}  // namespace tide_pool

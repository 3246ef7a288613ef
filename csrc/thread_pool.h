// A small persistent pool for the Adam driver: run body(0..nchunks-1) once each over up to
// n threads, the calling thread included. Header-only; included by dispatch.cpp alone.
//
// [Note: late workers]
// On a shared machine a thread that has just been woken (or created) may wait milliseconds
// for a CPU. So the caller never waits for a worker that has not started: it claims chunks
// itself, and when none are left it waits only for the workers that joined the job (those
// are running and finish their current chunk). A job is open from publish until the caller
// closes it under the lock, after the last joined worker left; a worker joins only an open
// job, under the same lock, so no worker touches a job's body after run() returned. A worker
// that wakes too late finds the job closed and sleeps again. Workers are created on first
// need, kept for the life of the process (the pool is never destroyed, so exit never waits
// on them), and a thread that cannot be created just means fewer helpers.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <system_error>
#include <thread>
#include <vector>

namespace oz {

class ChunkPool {
 public:
  // The process-wide pool. A child created by fork() has none of the parent's workers and
  // perhaps a mutex some worker held at the fork, so it starts a fresh pool (the parent's
  // copy is abandoned, never touched again).
  static ChunkPool& get() {
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { current().store(new ChunkPool()); });
      return true;
    }();
    (void)registered;
    ChunkPool* pool = current().load();
    if (pool == nullptr) {
      ChunkPool* fresh = new ChunkPool();  // never destroyed: see [Note: late workers]
      if (!current().compare_exchange_strong(pool, fresh)) delete fresh;
      else pool = fresh;
    }
    return *pool;
  }

  // Runs body(c) for every c in [0, nchunks) exactly once, on the calling thread and up to
  // n - 1 pool workers. One job at a time: concurrent callers queue on run_mu_.
  void run(int n, int64_t nchunks, const std::function<void(int64_t)>& body) {
    if (nchunks <= 0) return;
    std::lock_guard<std::mutex> run_guard(run_mu_);
    const int helpers = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(n, nchunks) - 1));
    if (helpers > 0) {
      grow(helpers);
      std::lock_guard<std::mutex> lock(mu_);
      body_ = &body;
      nchunks_ = nchunks;
      next_.store(0);
      max_joined_ = helpers;
      joined_ = 0;
      active_ = 0;
      open_ = true;
      ++generation_;
      wake_.notify_all();
    }
    claim(helpers > 0 ? next_ : local_next(), nchunks, body);
    if (helpers > 0) {
      std::unique_lock<std::mutex> lock(mu_);
      left_.wait(lock, [&] { return active_ == 0; });
      open_ = false;
      body_ = nullptr;
    }
  }

 private:
  ChunkPool() = default;

  static std::atomic<ChunkPool*>& current() {
    static std::atomic<ChunkPool*> pool{nullptr};
    return pool;
  }

  static void claim(std::atomic<int64_t>& next, int64_t nchunks,
                    const std::function<void(int64_t)>& body) {
    for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1)) body(c);
  }

  std::atomic<int64_t>& local_next() {
    local_.store(0);
    return local_;
  }

  // Starts workers until there are `helpers` (called with run_mu_ held).
  void grow(int helpers) {
    while (static_cast<int>(workers_.size()) < helpers) {
      try {
        workers_.emplace_back([this] { work(); });
      } catch (const std::system_error&) {
        return;  // fewer helpers; the caller still runs every chunk itself if need be
      }
    }
  }

  void work() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return open_ && generation_ != seen; });
      seen = generation_;
      if (joined_ >= max_joined_) continue;
      ++joined_;
      ++active_;
      const std::function<void(int64_t)>* body = body_;
      const int64_t nchunks = nchunks_;
      lock.unlock();
      claim(next_, nchunks, *body);
      lock.lock();
      if (--active_ == 0) left_.notify_one();
    }
  }

  std::mutex run_mu_;                 // one job at a time
  std::mutex mu_;                     // guards everything below except the atomics
  std::condition_variable wake_;      // workers: a job was published
  std::condition_variable left_;      // caller: a joined worker left
  std::vector<std::thread> workers_;  // only grown, under run_mu_
  const std::function<void(int64_t)>* body_ = nullptr;
  int64_t nchunks_ = 0;
  std::atomic<int64_t> next_{0};      // next chunk to claim in the open job
  std::atomic<int64_t> local_{0};     // the same when the caller works alone
  int max_joined_ = 0;
  int joined_ = 0;
  int active_ = 0;
  bool open_ = false;
  uint64_t generation_ = 0;
};

}  // namespace oz

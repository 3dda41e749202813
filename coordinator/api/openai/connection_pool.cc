#include "coordinator/api/openai/connection_pool.h"

#include <utility>

namespace shardserve::openai {
namespace {

thread_local bool t_overflow = false;

}  // namespace

ConnectionPool::ConnectionPool(int threads, int overflow_threads) : threads_(threads) {
  workers_.reserve(static_cast<size_t>(threads + overflow_threads));
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Serve(false); });
  for (int i = 0; i < overflow_threads; ++i) workers_.emplace_back([this] { Serve(true); });
}

ConnectionPool::~ConnectionPool() { shutdown(); }

bool ConnectionPool::OnOverflowThread() { return t_overflow; }

bool ConnectionPool::Crowded() {
  absl::MutexLock lock(&mu_);
  return overflowing_ > 0;
}

void ConnectionPool::enqueue(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  if (assigned_ < threads_) {
    ++assigned_;
    jobs_.push_back(std::move(fn));
  } else {
    ++overflowing_;
    overflow_jobs_.push_back(std::move(fn));
  }
}

void ConnectionPool::shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void ConnectionPool::Serve(bool overflow) {
  t_overflow = overflow;
  std::deque<std::function<void()>>* const queue = overflow ? &overflow_jobs_ : &jobs_;
  for (;;) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, queue]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return !queue->empty() || shutdown_; };
      mu_.Await(absl::Condition(&ready));  // mu_ is held whenever the condition is evaluated
      if (queue->empty()) return;  // shut down, nothing left
      fn = std::move(queue->front());
      queue->pop_front();
    }
    fn();
    absl::MutexLock lock(&mu_);
    --(overflow ? overflowing_ : assigned_);
  }
}

}  // namespace shardserve::openai

// The threads that serve the HTTP API's connections: cpp-httplib's task queue (Server::new_task_queue).
//
// httplib hands each accepted connection to its task queue; a connection then holds one thread from
// its first request until it closes or stays idle past the keep-alive timeout (5 s, or less: see
// Crowded), and a streaming or waiting completion holds it throughout. httplib's own ThreadPool
// queues the connections that find every thread taken, without bound and unseen: such a client
// waits, with no answer, for another client to leave. This pool serves at most `threads`
// connections at once; one that arrives when all are taken goes to one of `overflow_threads` extra
// threads, on which OnOverflowThread() is true, so that the connection is hurried (a short deadline
// for its request, one request: security/http_connection.h) and the handlers answer it at once:
// /health as always, a completion 503 with "Connection: close" (HttpServer).
//
// Ownership: owns its threads; httplib owns the pool (from new_task_queue until the server stops).
// Threading: enqueue and shutdown from httplib's listening thread; OnOverflowThread and Crowded
// from any thread.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_CONNECTION_POOL_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_CONNECTION_POOL_H_

#include <httplib.h>

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardserve::openai {

class ConnectionPool : public httplib::TaskQueue {
 public:
  // threads >= 1, overflow_threads >= 1; all started now.
  ConnectionPool(int threads, int overflow_threads);
  ~ConnectionPool() override;
  ConnectionPool(const ConnectionPool&) = delete;
  ConnectionPool& operator=(const ConnectionPool&) = delete;

  // A connection: to a serving thread while fewer than `threads` connections are served or
  // waiting for one, else to the overflow threads.
  void enqueue(std::function<void()> fn) override;
  // Runs what is queued, then joins every thread. Idempotent.
  void shutdown() override;

  // True on an overflow thread: the connection it serves found every serving thread taken.
  static bool OnOverflowThread();
  // True while a connection is queued for or served by an overflow thread: connections want more
  // threads than there are, and idle keep-alive connections should give theirs back.
  bool Crowded();

 private:
  void Serve(bool overflow);

  absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> overflow_jobs_ ABSL_GUARDED_BY(mu_);
  int assigned_ ABSL_GUARDED_BY(mu_) = 0;  // connections queued for or served by the serving threads
  int overflowing_ ABSL_GUARDED_BY(mu_) = 0;  // connections queued for or served by the overflow threads
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;

  // Constant after construction (joined by shutdown).
  const int threads_;
  std::vector<std::thread> workers_;
};

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_CONNECTION_POOL_H_

// What both services share to expose Prometheus metrics: the latency buckets and the HTTP server
// answering GET /metrics. docs/metrics.md lists the metrics.
//
// The metrics themselves are prometheus-cpp's (registry, counters, gauges, histograms, and its
// TextSerializer for the exposition format). The HTTP endpoint is our own small server rather than
// prometheus-cpp's civetweb Exposer: civetweb starts its threads with a fixed 100 KiB stack, and
// in a process that loads cuBLAS 13 (libcublasLt's static TLS is larger than that) glibc refuses
// to create them (pthread_create: EINVAL), so the worker of a CUDA build could not serve metrics.
#ifndef SHARDSERVE_TELEMETRY_METRICS_HTTP_H_
#define SHARDSERVE_TELEMETRY_METRICS_HTTP_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/status/statusor.h"

namespace shardserve {

// Latency buckets: 1 ms x 2^k, k = 0..16 (1 ms .. 65.5 s): step times of a small CPU model and of
// a GPU decode both fall in the low buckets, a long prefill or a stuck collective in the high ones.
prometheus::Histogram::BucketBoundaries LatencyBuckets();

// Serves GET /metrics (text exposition format 0.0.4) from one registry on one thread; any other
// path is 404. One connection at a time, each bounded by a 2 s receive timeout, which is plenty
// for a Prometheus scraper. Destroying it stops the thread and closes the socket.
// Thread-safety: construction and destruction from one thread; the registry is read from the
// server thread (prometheus-cpp's registry and metrics are thread-safe).
class MetricsServer {
 public:
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

 private:
  friend absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string&,
                                                                     const std::shared_ptr<prometheus::Registry>&,
                                                                     std::string*);
  MetricsServer(int fd, std::shared_ptr<prometheus::Registry> registry);
  void Loop();

  // Constant after construction.
  const int fd_;
  const std::shared_ptr<prometheus::Registry> registry_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Starts a MetricsServer for `registry` on `listen` (host:port; port 0 picks a free one) and sets
// *address to host:port with the port it got. Unavailable, naming the address and the reason,
// when it cannot listen.
absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string& listen,
                                                            const std::shared_ptr<prometheus::Registry>& registry,
                                                            std::string* address);

}  // namespace shardserve

#endif  // SHARDSERVE_TELEMETRY_METRICS_HTTP_H_

// What both services share to expose Prometheus metrics: the latency buckets and the HTTP server
// answering GET /metrics. docs/metrics.md lists the metrics.
//
// The metrics themselves are prometheus-cpp's (registry, counters, gauges, histograms, and its
// TextSerializer for the exposition format). The HTTP endpoint is cpp-httplib's server, the one the
// OpenAI HTTP API uses (security/https.h), rather than prometheus-cpp's civetweb Exposer: civetweb
// starts its threads with a fixed 100 KiB stack, and in a process that loads cuBLAS 13
// (libcublasLt's static TLS is larger than that) glibc refuses to create them (pthread_create:
// EINVAL), so a CUDA worker could not serve metrics. (Debian's Exposer does take
// civetweb options, and its civetweb 1.15 has SSL, dlopen()ing "libssl.so" at run time; but it
// reads one PEM file holding both certificate and key once, at start: no rotation.)
#ifndef SHARDSERVE_TELEMETRY_METRICS_HTTP_H_
#define SHARDSERVE_TELEMETRY_METRICS_HTTP_H_

#include <memory>
#include <string>
#include <thread>

#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/status/statusor.h"
#include "security/tls.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace shardserve {

// Latency buckets: 1 ms x 2^k, k = 0..16 (1 ms .. 65.5 s): step times of a small CPU model and of
// a GPU decode both fall in the low buckets, a long prefill or a stuck collective in the high ones.
prometheus::Histogram::BucketBoundaries LatencyBuckets();

// How many connections /metrics serves at once, and how long an idle or slow one may hold its
// thread: idle connections beyond the first kMetricsThreads wait in a queue, kMetricsTimeout each
// at most, so a hundred idle ones delay a scrape by about 100 / 8 x 2 s, not for ever.
inline constexpr int kMetricsThreads = 8;
inline constexpr int kMetricsTimeoutSeconds = 2;

// Serves GET /metrics (text exposition format 0.0.4) from one registry, to which it adds
// shardserve_build_info{version}; any other path is 404.
// HTTPS when given a certificate (re-read when its files change: security/https.h), plain HTTP
// otherwise. Destroying it stops accepting, waits for the scrapes under way and joins the threads.
// Thread-safety: construction and destruction from one thread; the registry is read from the
// server's threads (prometheus-cpp's registry and metrics are thread-safe).
class MetricsServer {
 public:
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // host:port with the port it got.
  const std::string& address() const { return address_; }
  // "http://host:port/metrics" or "https://...": what a log line or a scraper needs.
  std::string url() const;
  bool https() const { return https_; }

 private:
  friend absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string&, const TlsFiles&,
                                                                     const std::shared_ptr<prometheus::Registry>&);
  MetricsServer() = default;

  // Constant after ServeMetrics returns.
  std::string address_;
  bool https_ = false;
  std::unique_ptr<httplib::Server> http_;
  std::thread listener_;
};

// Starts a MetricsServer for `registry` on `listen` (host:port; port 0 picks a free one), over HTTPS
// when `tls` has a certificate (its CA is not used: scrapers are not asked for certificates).
// Unavailable naming the address when it cannot listen; InvalidArgument naming the file when the
// certificate cannot be used.
absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string& listen, const TlsFiles& tls,
                                                            const std::shared_ptr<prometheus::Registry>& registry);

}  // namespace shardserve

#endif  // SHARDSERVE_TELEMETRY_METRICS_HTTP_H_

#include "telemetry/metrics_http.h"

#include <httplib.h>

#include <utility>

#include <prometheus/gauge.h>
#include <prometheus/text_serializer.h>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/version.h"
#include "security/https.h"

namespace shardserve {

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (int k = 0; k <= 16; ++k) b.push_back(0.001 * static_cast<double>(1 << k));
  return b;
}

MetricsServer::~MetricsServer() {
  if (!listener_.joinable()) return;
  http_->stop();
  listener_.join();
}

std::string MetricsServer::url() const { return absl::StrCat(https_ ? "https://" : "http://", address_, "/metrics"); }

absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string& listen, const TlsFiles& tls,
                                                            const std::shared_ptr<prometheus::Registry>& registry) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", listen, "' is not HOST:PORT"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty()) host = "0.0.0.0";

  // Which release the process runs, as Prometheus exporters say it: a gauge of 1 labelled with it.
  prometheus::BuildGauge()
      .Name("shardserve_build_info")
      .Help("shardserve's version, as its label (always 1)")
      .Register(*registry)
      .Add({{"version", kVersion}})
      .Set(1);

  std::unique_ptr<MetricsServer> s(new MetricsServer());
  ConnectionPolicy policy;
  policy.head_deadline = policy.body_deadline = policy.idle_timeout = policy.io_timeout =
      absl::Seconds(kMetricsTimeoutSeconds);
  absl::StatusOr<std::unique_ptr<httplib::Server>> http = MakeHttpServer(tls, policy);
  if (!http.ok()) return http.status();
  s->http_ = *std::move(http);
  s->https_ = tls.has_identity();
  s->http_->new_task_queue = [] { return new httplib::ThreadPool(kMetricsThreads); };
  s->http_->Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    const prometheus::TextSerializer serializer;
    res.set_content(serializer.Serialize(registry->Collect()), "text/plain; version=0.0.4; charset=utf-8");
  });
  s->http_->set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.status == 404) res.set_content("only GET /metrics is served here\n", "text/plain");
    // A head httplib could not read closes the connection (security/https.cc): say so.
    if (res.status == 400 || res.status == 414) res.set_header("Connection", "close");
  });
  const int bound = port == 0 ? s->http_->bind_to_any_port(host) : (s->http_->bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, " (in use, or not this host's)"));
  }
  s->address_ = absl::StrCat(listen.substr(0, colon), ":", bound);
  MetricsServer* raw = s.get();
  s->listener_ = std::thread([raw] { raw->http_->listen_after_bind(); });
  return s;
}

}  // namespace shardserve

// What a gRPC port speaks, TLS or plaintext HTTP/2, found by dialling it: for the message of a
// client whose channel does not connect, so that a TLS mismatch (a plaintext worker dialling a TLS
// coordinator, or a TLS worker a plaintext one) is named as such rather than left as "cannot
// reach". gRPC's channel only says that the connection failed.
//
// The TLS probe is OpenSSL's client handshake with no verification (it checks that the port speaks
// TLS, never whom to trust); the plaintext probe sends HTTP/2's connection preface and an empty
// SETTINGS frame and looks for a SETTINGS frame in reply. Each dials once, bounded by `timeout`.
//
// Thread-safety: reentrant.
#ifndef SHARDSERVE_SECURITY_TRANSPORT_PROBE_H_
#define SHARDSERVE_SECURITY_TRANSPORT_PROBE_H_

#include <string>

#include "absl/time/time.h"

namespace shardserve {

enum class PortSpeaks {
  kUnknown,    // no answer either probe understood (nothing listening, another protocol, a timeout)
  kTls,        // a TLS server: it answered a client hello with its certificate
  kPlaintext,  // HTTP/2 without TLS: it answered the preface with SETTINGS
};

// `host_port`: "127.0.0.1:50051", "[::1]:50051", "coordinator.example:50051" (a gRPC target with a
// scheme, "dns:///...", is kUnknown).
PortSpeaks ProbePort(const std::string& host_port, absl::Duration timeout);

}  // namespace shardserve

#endif  // SHARDSERVE_SECURITY_TRANSPORT_PROBE_H_

// For the targets whose input is a stream of protobuf messages (coordinator_message,
// worker_message): each message varint-length-delimited, as protobuf's SerializeDelimitedTo
// writes them; the seed writer every such target has (SHARDSERVE_FUZZ_WRITE_SEEDS=DIR); and the
// verbose switch that prints each verdict (SHARDSERVE_FUZZ_VERBOSE). Header-only; not thread-safe
// (libFuzzer runs one input at a time).
#ifndef SHARDSERVE_FUZZ_MESSAGE_STREAM_H_
#define SHARDSERVE_FUZZ_MESSAGE_STREAM_H_

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "fuzz/seeds.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/delimited_message_util.h"

namespace shardserve_fuzz {

// Set by Initialize from SHARDSERVE_FUZZ_VERBOSE.
inline bool& Verbose() {
  static bool verbose = false;
  return verbose;
}

// With SHARDSERVE_FUZZ_VERBOSE set, "what: status" on stderr.
inline void Say(const char* what, const absl::Status& s) {
  if (Verbose()) std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
}

// For LLVMFuzzerInitialize: quiets protobuf's log (parsing logs each refusal of a non-UTF-8
// string), reads SHARDSERVE_FUZZ_VERBOSE, and with SHARDSERVE_FUZZ_WRITE_SEEDS=DIR calls
// write_seeds(DIR) and exits (WriteSeedsIfAsked).
inline void Initialize(void (*write_seeds)(const std::string& dir)) {
  google::protobuf::SetLogHandler(nullptr);
  Verbose() = std::getenv("SHARDSERVE_FUZZ_VERBOSE") != nullptr;
  WriteSeedsIfAsked(write_seeds);
}

// The next delimited message of `in` into `m` (cleared first: the parser merges); false at the
// end or on bytes that do not parse.
inline bool Next(google::protobuf::io::CodedInputStream* in, google::protobuf::MessageLite* m) {
  m->Clear();
  bool clean_eof = false;
  return google::protobuf::util::ParseDelimitedFromCodedStream(m, in, &clean_eof);
}

// `m` varint-length-delimited.
inline std::string Delimited(const google::protobuf::MessageLite& m) {
  std::string s;
  {
    google::protobuf::io::StringOutputStream raw(&s);
    google::protobuf::io::CodedOutputStream out(&raw);
    google::protobuf::util::SerializeDelimitedToCodedStream(m, &out);
  }
  return s;
}

// Writes `bytes` to DIR/NAME; aborts when it cannot.
inline void WriteFile(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out << bytes;
  if (!out.good()) {
    std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
    std::abort();
  }
}

}  // namespace shardserve_fuzz

#endif  // SHARDSERVE_FUZZ_MESSAGE_STREAM_H_

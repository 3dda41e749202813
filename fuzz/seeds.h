// The seed writer of the targets that make their own corpus: SHARDSERVE_FUZZ_WRITE_SEEDS=DIR TARGET
// writes its seeds into DIR and exits. Header-only.
#ifndef SHARDSERVE_FUZZ_SEEDS_H_
#define SHARDSERVE_FUZZ_SEEDS_H_

#include <cstdlib>
#include <string>

namespace shardserve_fuzz {

// For LLVMFuzzerInitialize: with SHARDSERVE_FUZZ_WRITE_SEEDS=DIR, calls write_seeds(DIR) and exits.
inline void WriteSeedsIfAsked(void (*write_seeds)(const std::string& dir)) {
  if (const char* dir = std::getenv("SHARDSERVE_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
}

}  // namespace shardserve_fuzz

#endif  // SHARDSERVE_FUZZ_SEEDS_H_

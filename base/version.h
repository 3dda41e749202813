// shardserve's version: what `shardserve --version`, the HTTP API's GET /version and the
// shardserve_build_info metric say. The one place it is written: the top-level CMakeLists.txt's
// project() reads it from here.
#ifndef SHARDSERVE_BASE_VERSION_H_
#define SHARDSERVE_BASE_VERSION_H_

namespace shardserve {

inline constexpr char kVersion[] = "0.1.0";

}  // namespace shardserve

#endif  // SHARDSERVE_BASE_VERSION_H_

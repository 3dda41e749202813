// What says that a file changed, for the files security/ re-reads (API keys, certificates): its
// device, inode, size and modification time. A rename over it (the safe way to replace a file)
// changes the inode; an edit in place changes the size or the time.
//
// Thread-safety: a value type; Of() is reentrant.
#ifndef SHARDSERVE_SECURITY_FILE_ID_H_
#define SHARDSERVE_SECURITY_FILE_ID_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <string>

namespace shardserve {

struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
  off_t size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileId&) const = default;

  // The file's id now; all zero when it cannot be stat()ed (missing, unreadable directory).
  static FileId Of(const std::string& path) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) return FileId{};
    return FileId{st.st_dev, st.st_ino, st.st_size, int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec};
  }
};

}  // namespace shardserve

#endif  // SHARDSERVE_SECURITY_FILE_ID_H_

// Whether the client of an HTTP request handled by cpp-httplib is still connected, for a handler
// that blocks while it waits (a non-streaming completion): httplib 0.11 (Debian bookworm's) gives a
// handler neither its socket nor a way to ask whether the client went away (later versions have
// Request::is_connection_closed), and it notices a closed connection only when it writes.
//
// PeerWatch::Find looks the connection's socket up among this process's descriptors
// (/proc/self/fd) by the request's four addresses (local and remote address and port): one socket
// has them while the handler runs, since httplib closes the connection only after the handler
// returns. Closed() then polls that socket without blocking: the client closed or shut down its
// side (POLLRDHUP: a FIN arrived, also when unread bytes precede it, e.g. a TLS close_notify), or
// reset it (POLLHUP/POLLERR). A client that half-closes its side on purpose and still waits for the
// answer (rare; curl and the openai clients do not) counts as gone.
//
// Ownership: borrows the descriptor, which httplib owns and closes after the handler returns; use
// a PeerWatch only inside the handler that found it. Threading: Find is reentrant; a PeerWatch is
// used by one thread.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_PEER_WATCH_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_PEER_WATCH_H_

#include <optional>
#include <string>

namespace shardserve::openai {

class PeerWatch {
 public:
  // The socket whose local end is local_addr:local_port and whose peer is remote_addr:remote_port
  // (numeric addresses as httplib writes them), or nullopt when none is (then nothing is watched).
  static std::optional<PeerWatch> Find(const std::string& local_addr, int local_port, const std::string& remote_addr,
                                       int remote_port);
  // True once the peer has closed, shut down its sending side or reset the connection.
  bool Closed() const;
  int fd() const { return fd_; }

 private:
  explicit PeerWatch(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_PEER_WATCH_H_

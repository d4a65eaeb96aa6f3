// The gate of a mailbox's same-host lane (control/lane.h; docs/security.md, "Same-host lanes"):
// a thread of its own that listens, takes each connection through its handshake — the peer's
// uid, the challenge, the hello — and hands the receiving thread only lanes whose sender proved
// who it is. Everything before that is bounded: at most Limits::max_pending connections wait for
// their hello, each at most Limits::hello_deadline, reading at most kMaxHelloBytes; a first frame
// announced longer is refused from its length field. Every connection it refuses or closes is
// counted (refused()) and logged once, at most 10 lines per 10 s.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/log_throttle.h"
#include "control/lane.h"
#include "refit/status.h"

namespace refit::lane {

// The public key `sender` registered (32 bytes), or an error saying why there is none to check
// a hello against ("registered no key", a lookup refused for its cost).
using KeyLookup = std::function<Result<std::array<unsigned char, 32>>(const std::string& sender)>;

struct GateOptions {
  std::string who;            // names the mailbox in log lines: "mailbox 'engine/0'"
  std::string receiver;       // its id: the hellos must be addressed to it
  std::string host_identity;  // published with the address (ControlSettings::host_identity)
  Limits limits;
  // With a run secret: the senders' registered keys, which the hellos must prove. Empty: any
  // connection of this process's user that names a sender is accepted.
  KeyLookup keys;
  // The rate limit of its log lines: the mailbox's, shared with its other parts (it must outlive
  // the gate). nullptr: one of the gate's own.
  log::Throttle* throttle = nullptr;
};

// A lane whose sender is proved: its socket and the seal of its frames.
struct Accepted {
  Fd fd;
  std::string from;
  FrameSeal seal;
  FrameSeal answers;  // of frames written back to the sender (FrameSeal::answers)
};

class Gate {
 public:
  static Result<std::unique_ptr<Gate>> open(GateOptions options);
  virtual ~Gate() = default;
  // The value published under "lane/<id>".
  virtual const std::string& address() const = 0;
  // Readable while take() has lanes to hand over (the receiving thread polls it).
  virtual int ready_fd() const = 0;
  virtual std::vector<Accepted> take() = 0;
  // Connections refused or closed before their hello was accepted.
  virtual std::int64_t refused() const = 0;
  // The most connections it held waiting for their hello at one time.
  virtual int pending_high_water() const = 0;
};

// An epoll set (level triggered, each entry's data.fd its descriptor) holding the gate's
// ready_fd: the receiving thread adds the lanes it takes and waits on the set. `who` names the
// receiver in errors.
Result<Fd> ready_set(const Gate& gate, const std::string& who);

}  // namespace refit::lane

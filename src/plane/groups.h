// Forms the collective groups of a refit on the backend that matches the data plane: Gloo for
// host memory, NCCL for CUDA memory.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "plane/data_plane.h"

namespace refit {

struct GroupOptions {
  std::string name;  // "trainer", "update": namespaces the group's keys in the store
  int rank = 0;
  int size = 1;
  std::string host = "127.0.0.1";
  std::chrono::milliseconds timeout{60000};
  // NCCL: checked while a collective is waited for (Gloo notices a dead peer's closed sockets).
  std::function<Status()> liveness;
  // A group used only point to point: the members this rank exchanges bytes with (GlooOptions::
  // peers; NCCL connects point-to-point pairs on first use anyway). On Gloo such a group connects
  // each pair on its first use (GlooOptions::connect_on_first_use): a pair that always moves by
  // peer access never opens a connection. nullopt: every member, connected when formed.
  std::optional<std::vector<int>> peers;
};

Result<std::unique_ptr<Communicator>> make_group(Store& store, const GroupOptions& options,
                                                 DataPlane& plane);

}  // namespace refit

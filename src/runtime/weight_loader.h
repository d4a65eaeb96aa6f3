// The engine's load_weights hook (Engine::on_load_weights): every parameter of a refit handed to
// the engine by name, in layout order, in batches — whole tensors only, a decoder layer never
// split across two calls, a batch at most refit.buffer_size_bytes unless one layer is larger.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "refit/session.h"
#include "runtime/slots.h"

namespace refit {

class WeightLoader {
 public:
  using Hook = std::function<Status(const std::vector<ParamView>& batch)>;
  void set_hook(Hook hook) { hook_ = std::move(hook); }
  bool active() const { return static_cast<bool>(hook_); }
  // Hands every parameter of `params` to the hook (memory of CUDA device `device`, or the host
  // with -1) in batches of at most `limit` bytes; `what` and `step` name the call in errors and
  // logs ("the refit", "after the rollback").
  Status load(const Registry& params, int device, std::int64_t limit, const std::string& who,
              const char* what, int step) const;

 private:
  Hook hook_;
};

}  // namespace refit

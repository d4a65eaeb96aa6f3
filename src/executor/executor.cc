#include "executor/executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

#include "transport/transport.h"

namespace refit {

RefitProbe& RefitProbe::none() {
  static RefitProbe nothing;
  return nothing;
}

std::string engine_process(const std::string& mailbox_id, int tp_size) {
  int g = -1;
  if (std::sscanf(mailbox_id.c_str(), "engine/%d", &g) != 1 || g < 0 || tp_size < 1)
    return mailbox_id;
  return fmt::format("engine {} tp rank {}", g / tp_size, g % tp_size);
}

Status send_each(Mailbox& mailbox, const std::vector<std::string>& ids, MessageType type,
                 const std::string& payload) {
  for (const std::string& id : ids) REFIT_RETURN_IF_ERROR(mailbox.send(id, type, payload));
  return Status::Ok();
}

Status expect_from_each(Mailbox& mailbox, const std::vector<std::string>& from, MessageType type,
                        const std::vector<std::string>& arrived, std::chrono::milliseconds timeout,
                        const std::string& who, const char* what,
                        const std::function<Status(const Message&)>& check) {
  std::vector<bool> seen(from.size(), false);
  std::size_t got = 0;
  auto mark = [&](const std::string& sender) -> Status {
    const auto it = std::find(from.begin(), from.end(), sender);
    if (it == from.end() || seen[static_cast<std::size_t>(it - from.begin())])
      return Status::Corruption(
          fmt::format("{}: unexpected {} from {}", who, message_type_name(type), sender));
    seen[static_cast<std::size_t>(it - from.begin())] = true;
    ++got;
    return Status::Ok();
  };
  for (const std::string& sender : arrived) REFIT_RETURN_IF_ERROR(mark(sender));
  while (got < from.size()) {
    REFIT_ASSIGN_OR_RETURN(Message m, expect_message(mailbox, type, timeout, what));
    REFIT_RETURN_IF_ERROR(mark(m.from));
    if (check) REFIT_RETURN_IF_ERROR(check(m));
  }
  return Status::Ok();
}

}  // namespace refit

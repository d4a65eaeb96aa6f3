#include "executor/executor.h"

#include <fmt/format.h>

#include <algorithm>

#include "transport/transport.h"

namespace refit {

RefitProbe& RefitProbe::none() {
  static RefitProbe nothing;
  return nothing;
}

Status send_each(Mailbox& mailbox, const std::vector<std::string>& ids, MessageType type,
                 const std::string& payload) {
  for (const std::string& id : ids) REFIT_RETURN_IF_ERROR(mailbox.send(id, type, payload));
  return Status::Ok();
}

Status expect_from_each(Mailbox& mailbox, const std::vector<std::string>& from, MessageType type,
                        const std::string& first_from, std::chrono::milliseconds timeout,
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
  if (!first_from.empty()) REFIT_RETURN_IF_ERROR(mark(first_from));
  while (got < from.size()) {
    REFIT_ASSIGN_OR_RETURN(Message m, expect_message(mailbox, type, timeout, what));
    REFIT_RETURN_IF_ERROR(mark(m.from));
    if (check) REFIT_RETURN_IF_ERROR(check(m));
  }
  return Status::Ok();
}

}  // namespace refit

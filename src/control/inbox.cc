#include "control/inbox.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "refit/rank.h"

namespace refit {
namespace {

bool listed(std::initializer_list<MessageType> types, MessageType t) {
  return std::find(types.begin(), types.end(), t) != types.end();
}

}  // namespace

Status send_to_each(Mailbox& mailbox, const std::vector<std::string>& to, MessageType type,
                    const std::string& payload) {
  for (const std::string& id : to) REFIT_RETURN_IF_ERROR(mailbox.send(id, type, payload));
  return Status::Ok();
}

Result<Message> expect_message(Mailbox& mailbox, MessageType type,
                               std::chrono::milliseconds timeout, const std::string& waiting_for) {
  auto msg = mailbox.receive(timeout);
  if (!msg.ok())
    return msg.status().with_context(fmt::format("{} waiting for {}", mailbox.id(), waiting_for));
  if (msg->type == type) return msg;
  return Status::Internal(fmt::format("{} waiting for {}: got {} from {}", mailbox.id(),
                                      waiting_for, message_type_name(msg->type), msg->from)).with_kind(FailureKind::kProtocol);
}

bool Inbox::take_kept(MessageType type, const std::string& sender, Message& out) {
  const auto it = std::find_if(kept_.begin(), kept_.end(), [&](const Message& m) {
    return m.type == type && (sender.empty() || m.from == sender);
  });
  if (it == kept_.end()) return false;
  out = std::move(*it);
  kept_.erase(it);
  return true;
}

Result<Message> Inbox::next(std::initializer_list<MessageType> types,
                            std::chrono::milliseconds timeout, std::string_view what,
                            std::initializer_list<MessageType> later) {
  Message m;
  for (MessageType t : types)
    if (take_kept(t, "", m)) return m;
  while (true) {
    Result<Message> r = mailbox_.receive(timeout);
    if (!r.ok())
      return r.status().with_context(fmt::format("{} waiting for {}", mailbox_.id(), what));
    if (listed(types, r->type)) return r;
    if (!listed(later, r->type))
      return Status::Internal(fmt::format("{} waiting for {}: unexpected {} from {}",
                                          mailbox_.id(), what, message_type_name(r->type),
                                          r->from)).with_kind(FailureKind::kProtocol);
    kept_.push_back(std::move(r).value());
  }
}

Result<std::vector<Message>> Inbox::collect(MessageType type, const std::vector<std::string>& from,
                                            std::chrono::milliseconds timeout,
                                            std::string_view what,
                                            std::initializer_list<MessageType> later,
                                            const std::function<Status(const Message&)>& check) {
  std::vector<Message> got(from.size());
  std::vector<bool> seen(from.size(), false);
  std::size_t count = 0;
  auto place = [&](Message m) -> Status {
    const auto it = std::find(from.begin(), from.end(), m.from);
    const auto i = static_cast<std::size_t>(it - from.begin());
    if (it == from.end() || seen[i])
      return Status::Internal(fmt::format("{} waiting for {}: unexpected {} from {}{}",
                                          mailbox_.id(), what, message_type_name(m.type), m.from,
                                          it == from.end() ? "" : " (a second one)")).with_kind(FailureKind::kProtocol);
    if (check) REFIT_RETURN_IF_ERROR(check(m));
    seen[i] = true;
    got[i] = std::move(m);
    ++count;
    return Status::Ok();
  };
  for (std::size_t i = 0; i < from.size(); ++i) {
    Message m;
    if (take_kept(type, from[i], m)) REFIT_RETURN_IF_ERROR(place(std::move(m)));
  }
  while (count < from.size()) {
    Result<Message> r = mailbox_.receive(timeout);
    if (!r.ok()) {
      std::string missing;
      int named = 0;
      for (std::size_t i = 0; i < from.size(); ++i)
        if (!seen[i] && named++ < 4) {
          const std::optional<RankId> id =
              tp_size_ > 0 ? RankId::from_mailbox(from[i], tp_size_) : std::nullopt;
          missing += (missing.empty() ? "" : ", ") + (id ? id->name() : from[i]);
        }
      if (from.size() - count > 4) missing += ", ...";
      return r.status().with_context(fmt::format("{} waiting for {} from {} ({} of {} arrived)",
                                                 mailbox_.id(), what, missing, count,
                                                 from.size()));
    }
    if (r->type == type) {
      REFIT_RETURN_IF_ERROR(place(std::move(r).value()));
    } else if (listed(later, r->type)) {
      kept_.push_back(std::move(r).value());
    } else {
      return Status::Internal(fmt::format("{} waiting for {}: unexpected {} from {}",
                                          mailbox_.id(), what, message_type_name(r->type),
                                          r->from)).with_kind(FailureKind::kProtocol);
    }
  }
  return got;
}

Status Inbox::expect_none_kept(std::string_view when) const {
  if (kept_.empty()) return Status::Ok();
  return Status::Internal(fmt::format("{} {}: {} message(s) arrived for a phase that never came, "
                                      "the first {} from {}",
                                      mailbox_.id(), when, kept_.size(),
                                      message_type_name(kept_.front().type),
                                      kept_.front().from)).with_kind(FailureKind::kProtocol);
}

}  // namespace refit

#include "control/inbox.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "control/messages.h"
#include "refit/rank.h"

namespace refit {
namespace {

bool listed(std::initializer_list<MessageType> types, MessageType t) {
  return std::find(types.begin(), types.end(), t) != types.end();
}

// What is left of a wait that ends at `deadline` (0 once it passed: whatever is queued is still
// read, nothing more is waited for).
std::chrono::milliseconds left_until(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return std::max(left, std::chrono::milliseconds(0));
}

}  // namespace

Status send_to_each(Mailbox& mailbox, const std::vector<std::string>& to, MessageType type,
                    const std::string& payload) {
  for (const std::string& id : to) REFIT_RETURN_IF_ERROR(mailbox.send(id, type, payload));
  return Status::Ok();
}

Status send_relayed(Mailbox& mailbox, const std::string& to, const std::vector<Message>& answers) {
  // Each payload travels as a JSON string: escaping at most doubles a JSON payload (no raw
  // control characters), so answers counted at face value up to half the bound fit in one.
  RelayedMessage batch;
  std::size_t bytes = 0;
  for (const Message& m : answers) {
    const std::size_t size = m.from.size() + m.payload.size() + 16;
    if (!batch.answers.empty() &&
        bytes + size > static_cast<std::size_t>(kMaxMailboxMessageBytes / 2)) {
      REFIT_RETURN_IF_ERROR(mailbox.send(to, MessageType::kRelayed, encode(batch)));
      batch.answers.clear();
      bytes = 0;
    }
    batch.answers.push_back(RelayedAnswer{.from = m.from, .type = m.type, .payload = m.payload});
    bytes += size;
  }
  if (batch.answers.empty()) return Status::Ok();
  return mailbox.send(to, MessageType::kRelayed, encode(batch));
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

void Inbox::accept_relayed(const std::map<std::string, std::vector<std::string>>& groups) {
  relays_.clear();
  for (const auto& [relay, members] : groups)
    relays_[relay] = std::set<std::string>(members.begin(), members.end());
}

Result<Message> Inbox::receive(std::chrono::steady_clock::time_point deadline,
                               std::chrono::milliseconds timeout) {
  while (relayed_.empty()) {
    Result<Message> r = mailbox_.receive(left_until(deadline));
    // The mailbox names what was left of the wait; the wait was `timeout`.
    if (!r.ok() && r.status().code() == StatusCode::kTimeout &&
        r.status().message().starts_with(fmt::format("mailbox '{}': no message within",
                                                     mailbox_.id())))
      return Status::Timeout(
          fmt::format("mailbox '{}': no message within {} ms", mailbox_.id(), timeout.count()));
    if (!r.ok() || r->type != MessageType::kRelayed) return r;
    const auto group = relays_.find(r->from);
    if (group == relays_.end())
      return Status::Internal(fmt::format("{}: relayed answers from {}, which relays for no rank "
                                          "of this one",
                                          mailbox_.id(), r->from))
          .with_kind(FailureKind::kProtocol);
    REFIT_ASSIGN_OR_RETURN(RelayedMessage batch, decode_relayed(r->payload, r->from));
    for (RelayedAnswer& a : batch.answers) {
      if (group->second.count(a.from) == 0 || a.type == MessageType::kRelayed)
        return Status::Internal(fmt::format("{}: {} relayed {} of {}, which is not of its group",
                                            mailbox_.id(), r->from, message_type_name(a.type),
                                            a.from))
            .with_kind(FailureKind::kProtocol);
      relayed_.push_back(Message{.type = a.type,
                                 .from = std::move(a.from),
                                 .payload = std::move(a.payload),
                                 .epoch = r->epoch});
    }
  }
  Message m = std::move(relayed_.front());
  relayed_.pop_front();
  return m;
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
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    Result<Message> r = receive(deadline, timeout);
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
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (count < from.size()) {
    Result<Message> r = receive(deadline, timeout);
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
  // A relayed message's answers not yet read count too: none was asked for.
  const std::deque<Message>& left = kept_.empty() ? relayed_ : kept_;
  if (left.empty()) return Status::Ok();
  return Status::Internal(fmt::format("{} {}: {} message(s) arrived for a phase that never came, "
                                      "the first {} from {}",
                                      mailbox_.id(), when, kept_.size() + relayed_.size(),
                                      message_type_name(left.front().type),
                                      left.front().from)).with_kind(FailureKind::kProtocol);
}

}  // namespace refit

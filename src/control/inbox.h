// What a rank waits for on its mailbox, phase by phase (docs/protocol.md).
//
// The refit protocol's state machines (runtime/trainer_protocol.h, runtime/engine_protocol.h)
// wait for one kind of message from a known set of peers at a time. Peers do not move in lock
// step: one may already be in the next phase while another is still in this one (an engine rank's
// verdict can overtake another engine rank's commit acknowledgement). An Inbox keeps such a
// message, of a type the caller names as a later phase's, until that phase asks for it; any other
// message is a protocol violation naming its type and sender. Driven by one thread.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "control/mailbox.h"
#include "refit/status.h"

namespace refit {

// The next message on `mailbox`, which must be of `type`; any other is a protocol violation
// naming both (kInternal).
Result<Message> expect_message(Mailbox& mailbox, MessageType type,
                               std::chrono::milliseconds timeout, const std::string& waiting_for);

// Sends `payload` as `type` to every id in `to`.
Status send_to_each(Mailbox& mailbox, const std::vector<std::string>& to, MessageType type,
                    const std::string& payload);

// A relay's answers of one phase (`answers`: its own and its group's, each with its sender) to
// `to`, as relayed messages (control/messages.h RelayedMessage) whose answers add up to at most
// half the mailbox's message bound (escaped, they may double): one message unless the answers are
// large. A single answer of more than half the bound may not fit; the send then fails naming its
// size (the largest answers are tens of kilobytes).
Status send_relayed(Mailbox& mailbox, const std::string& to, const std::vector<Message>& answers);

class Inbox {
 public:
  // `tp_size` (generation.tp_size) lets errors name the senders that did not answer as ranks
  // ("engine 1 tp rank 0"); 0 names them by mailbox id.
  explicit Inbox(Mailbox& mailbox, int tp_size = 0) : mailbox_(mailbox), tp_size_(tp_size) {}
  Inbox(const Inbox&) = delete;
  Inbox& operator=(const Inbox&) = delete;

  // The next message of one of `types`, from anyone (a kept one first). Messages of the `later`
  // types are kept for their phase. The whole wait is bounded by `timeout`, however many
  // messages of other phases arrive meanwhile.
  Result<Message> next(std::initializer_list<MessageType> types, std::chrono::milliseconds timeout,
                       std::string_view what, std::initializer_list<MessageType> later = {});

  // One message of `type` from each of `from` (mailbox ids), in any order; returned in the order
  // of `from`. `check` sees each as it arrives; a second one from the same sender, or one from
  // anyone else, is a protocol violation. Messages of the `later` types are kept. The whole wait
  // is bounded by `timeout`, not each gap between two messages.
  Result<std::vector<Message>> collect(MessageType type, const std::vector<std::string>& from,
                                       std::chrono::milliseconds timeout, std::string_view what,
                                       std::initializer_list<MessageType> later = {},
                                       const std::function<Status(const Message&)>& check = {});

  // Relays (docs/protocol.md, "Relays"): `groups` maps each relay's mailbox id to the ids it
  // answers for, its own included. Each answer of a relayed message from one of them is read as
  // if its own sender had sent it (in the relay's refit epoch); a relayed message from anyone
  // else, or with an answer of a rank outside the relay's group, is a protocol violation naming
  // the relay.
  void accept_relayed(const std::map<std::string, std::vector<std::string>>& groups);

  // How many messages are kept for a later phase.
  std::size_t kept() const { return kept_.size(); }
  // A phase that is over must have taken what was kept for it, and every answer of a relayed
  // message: kInternal naming the first left.
  Status expect_none_kept(std::string_view when) const;
  // Drops what is kept (a refit that failed: its messages mean nothing now).
  void clear() {
    kept_.clear();
    relayed_.clear();
  }

 private:
  // A kept message of `type` (from `sender`, when not empty), removed from the kept ones.
  bool take_kept(MessageType type, const std::string& sender, Message& out);
  // The next message off the mailbox before `deadline`, relayed answers handed on one by one;
  // kTimeout names the wait's whole `timeout`.
  Result<Message> receive(std::chrono::steady_clock::time_point deadline,
                          std::chrono::milliseconds timeout);

  Mailbox& mailbox_;
  const int tp_size_;
  std::deque<Message> kept_;
  std::map<std::string, std::set<std::string>> relays_;  // accept_relayed
  std::deque<Message> relayed_;  // answers of a relayed message not yet read
};

}  // namespace refit

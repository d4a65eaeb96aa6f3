#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "transport/transport.h"

namespace refit {

std::string encode_bucket_message(int slot, const BucketHeader& h) {
  nlohmann::json j = {{"slot", slot}, {"step", h.step}, {"bucket", h.bucket}, {"bytes", h.bytes}};
  if (!h.meta.empty()) j["meta"] = h.meta;
  return j.dump();
}

Status decode_bucket_message(const std::string& payload, int& slot, BucketHeader& h) {
  auto j = nlohmann::json::parse(payload, nullptr, false);
  if (j.is_discarded() || !j.contains("slot") || !j.contains("bytes"))
    return Status::Corruption("control plane: malformed bucket message: " + payload.substr(0, 200));
  slot = j["slot"].get<int>();
  h.step = j.value("step", 0);
  h.bucket = j.value("bucket", 0);
  h.bytes = j["bytes"].get<std::size_t>();
  h.meta = j.value("meta", std::string());
  return Status::Ok();
}

Result<Message> expect_message(Mailbox& mailbox, MessageType type,
                               std::chrono::milliseconds timeout, const std::string& waiting_for) {
  auto msg = mailbox.receive(timeout);
  if (!msg.ok())
    return msg.status().with_context(fmt::format("{} waiting for {}", mailbox.id(), waiting_for));
  if (msg->type == type) return msg;
  return Status::Internal(fmt::format("{} waiting for {}: got {} from {}", mailbox.id(),
                                      waiting_for, message_type_name(msg->type), msg->from));
}

}  // namespace refit

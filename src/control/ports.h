// Ports for the store: which ones an outgoing connection of this host may take, and a free one
// that none can.
//
// A connect() takes its source port from the host's ephemeral range
// (net.ipv4.ip_local_port_range). A store port from that range can be taken between the moment
// it is chosen and the moment the store binds it: by any outgoing connection of the host, and by a
// rank that dials the store before it listens, whose connection then reaches itself. A port below
// the range is taken only by a server binding it.
#pragma once

#include "refit/status.h"

namespace refit {

struct PortRange {
  int low = 0;
  int high = 0;
  bool contains(int port) const { return port >= low && port <= high; }
};

// This host's ephemeral range, from /proc/sys/net/ipv4/ip_local_port_range; Linux's default
// (32768-60999) when that file cannot be read.
PortRange ephemeral_ports();

// A TCP port that nothing on this host binds now, below the ephemeral range and outside
// 29400-29599 (torchrun's and refit's defaults), chosen at random among those. Only when no such
// port is free, one the system chooses (from the ephemeral range). IOError when not even that.
Result<int> pick_free_port();

}  // namespace refit

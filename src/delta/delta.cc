// The parts of the delta component no plane runs: the kept copy's layout, stream bounds, checks
// of a route list, and the size and time prediction of `refit.delta: auto`.
#include "delta/delta.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "delta/format.h"

namespace refit {

namespace df = delta_format;

std::string describe_route(const DeltaOptions& options, std::uint32_t tag) {
  if (options.describe) return options.describe(tag);
  return fmt::format("route {}", tag);
}

std::int64_t assign_kept_offsets(std::vector<DeltaRoute>& routes) {
  std::int64_t at = 0;
  for (DeltaRoute& r : routes) {
    r.kept = at;
    at += r.elements() * static_cast<std::int64_t>(dtype_size(r.wire_dtype));
    at = (at + 15) / 16 * 16;
  }
  return at;
}

std::size_t delta_stream_capacity(const std::vector<DeltaRoute>& routes) {
  std::uint64_t bytes = df::kHeaderBytes + sizeof(df::RouteEntry) * routes.size();
  for (const DeltaRoute& r : routes)
    bytes += df::align8(static_cast<std::uint64_t>(r.elements()) * dtype_size(r.wire_dtype));
  return static_cast<std::size_t>(bytes);
}

std::int64_t delta_full_bytes(const std::vector<DeltaRoute>& routes) {
  std::int64_t bytes = 0;
  for (const DeltaRoute& r : routes)
    bytes += r.elements() * static_cast<std::int64_t>(dtype_size(r.wire_dtype));
  return bytes;
}

Status check_delta_routes(const std::vector<DeltaRoute>& routes, const DeltaOptions& options) {
  if (options.chunk_log2 < df::kMinChunkLog2 || options.chunk_log2 > df::kMaxChunkLog2)
    return Status::InvalidArgument(fmt::format("delta: chunk_log2 {} is outside {}..{}",
                                               options.chunk_log2, df::kMinChunkLog2,
                                               df::kMaxChunkLog2));
  // Above 1 a chunk could code longer than its raw bytes, past delta_stream_capacity.
  if (!(options.dense_ratio > 0 && options.dense_ratio <= 1))
    return Status::InvalidArgument(
        fmt::format("delta: dense_ratio {} must be in (0, 1]", options.dense_ratio));
  for (const DeltaRoute& r : routes) {
    const Block2D& b = r.block;
    auto bad = [&](const std::string& what) {
      return Status::InvalidArgument(
          fmt::format("delta: {}: {}", describe_route(options, r.tag), what));
    };
    if (b.rows < 0 || b.cols < 0 || b.src_offset < 0 || b.dst_offset < 0 || b.src_stride < 0 ||
        b.dst_stride < 0 || r.key_stride < 0 || r.kept < 0)
      return bad(
          fmt::format("negative shape, offset or stride (rows {}, cols {})", b.rows, b.cols));
    if (r.kept % 16 != 0) return bad(fmt::format("kept offset {} is not 16-byte aligned", r.kept));
    if (b.numel() >= (std::int64_t{1} << 32))
      return bad(fmt::format("{} elements; a route holds fewer than 2^32", b.numel()));
    const std::size_t esize = dtype_size(r.wire_dtype);
    if (esize != 1 && esize != 2 && esize != 4)
      return bad(
          fmt::format("wire dtype {} has {} bytes per element", dtype_name(r.wire_dtype), esize));
  }
  return Status::Ok();
}

std::int64_t predict_delta_bytes(std::int64_t elements, int esize, std::int64_t routes,
                                 double density, double exceptions, int chunk_log2) {
  density = std::clamp(density, 0.0, 1.0);
  exceptions = std::clamp(exceptions, 0.0, 1.0);
  const double raw = static_cast<double>(elements) * esize;
  double bytes = static_cast<double>(df::kHeaderBytes) +
                 static_cast<double>(routes) * (sizeof(df::RouteEntry) + 4.0);
  if (elements <= 0 || density == 0) return static_cast<std::int64_t>(bytes);
  const auto chunk =
      static_cast<std::uint32_t>(std::min<std::int64_t>(std::int64_t{1} << chunk_log2, elements));
  const auto n = static_cast<std::uint32_t>(std::max(1.0, std::round(density * chunk)));
  const auto m = static_cast<std::uint32_t>(std::round(exceptions * n));
  // Exceptions of a few steps: 4 bits of |d| - 2 each (docs/delta.md, "Size").
  const df::ChunkFields f = df::chunk_fields(std::min(n, chunk), std::min(m, n), 4, chunk);
  const double chunk_raw = static_cast<double>(chunk) * esize;
  const double per_chunk =
      std::min(chunk_raw, std::ceil(static_cast<double>(f.bits) / 32.0) * 4.0) +
      sizeof(df::ChunkEntry);
  const double payload = static_cast<double>(elements) / chunk * per_chunk;
  bytes += std::min(payload, raw);
  return static_cast<std::int64_t>(bytes);
}

DeltaChoice choose_delta(std::int64_t elements, int esize, std::int64_t routes, double density,
                         double link_bytes_per_s, double encode_elems_per_s,
                         double apply_elems_per_s, double exceptions, int chunk_log2) {
  DeltaChoice c;
  c.full_bytes = elements * esize;
  c.delta_bytes = predict_delta_bytes(elements, esize, routes, density, exceptions, chunk_log2);
  const double link =
      link_bytes_per_s > 0 ? link_bytes_per_s : std::numeric_limits<double>::infinity();
  c.full_seconds = static_cast<double>(c.full_bytes) / link;
  c.delta_seconds = static_cast<double>(c.delta_bytes) / link;
  if (encode_elems_per_s > 0) c.delta_seconds += static_cast<double>(elements) / encode_elems_per_s;
  if (apply_elems_per_s > 0)
    c.delta_seconds +=
        std::clamp(density, 0.0, 1.0) * static_cast<double>(elements) / apply_elems_per_s;
  c.use_delta = c.delta_seconds < c.full_seconds;
  return c;
}

double break_even_density(std::int64_t elements, int esize, std::int64_t routes,
                          double link_bytes_per_s, double encode_elems_per_s,
                          double apply_elems_per_s, double exceptions, int chunk_log2) {
  auto wins = [&](double p) {
    return choose_delta(elements, esize, routes, p, link_bytes_per_s, encode_elems_per_s,
                        apply_elems_per_s, exceptions, chunk_log2)
        .use_delta;
  };
  if (wins(1.0)) return 1.0;
  if (!wins(0.0)) return 0.0;
  double lo = 0, hi = 1;
  for (int i = 0; i < 40; ++i) {
    const double mid = (lo + hi) / 2;
    (wins(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace refit

// Files refit maps read-only (safetensors checkpoints) can change under it. Reading a page of a
// mapped file that was truncated since raises SIGBUS, which would kill the process without a
// word. A registered mapping turns that into a one-line error naming the file, and exit code 1:
// "refit: error: FILE changed while refit was reading it …". The other ranks then stop as for any
// rank that exits (runtime/failure.h).
#pragma once

#include <cstddef>
#include <string>

namespace refit {

// Registers [base, base + bytes) as a mapping of `path`. Returns a slot for
// unregister_mapped_file, or -1 when every slot is taken (the mapping is then unguarded).
int register_mapped_file(const void* base, std::size_t bytes, const std::string& path);
void unregister_mapped_file(int slot);

}  // namespace refit

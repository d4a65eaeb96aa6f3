// POSIX shared-memory segments (plane/shared_memory.h): created exclusively with mode 0600 under
// names no other process can guess, and refused when the segment is smaller than asked.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <set>
#include <string>

#include "plane/shared_memory.h"

namespace refit {
namespace {

TEST(SharedMemory, NamesAreUnguessableAndSegmentsPrivateAndExclusive) {
  std::set<std::string> seen;
  for (int i = 0; i < 64; ++i) {
    const std::string s = unguessable_suffix();
    EXPECT_EQ(s.size(), 16u);
    EXPECT_EQ(s.find_first_not_of("0123456789abcdef"), std::string::npos) << s;
    seen.insert(s);
  }
  EXPECT_EQ(seen.size(), 64u);

  const std::string name = "/refit-test-" + unguessable_suffix();
  auto a = SharedMemory::create(name, 4096);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  struct stat st {};
  ASSERT_EQ(stat(("/dev/shm" + name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // A second creator of the same name fails: nobody can slip in a segment of their own.
  auto b = SharedMemory::create(name, 4096);
  EXPECT_FALSE(b.ok());
  // Mapping more than the segment holds is refused (no SIGBUS later).
  auto big = SharedMemory::open(name, 8192);
  EXPECT_FALSE(big.ok());
  auto fits = SharedMemory::open(name, 4096);
  EXPECT_TRUE(fits.ok()) << fits.status().to_string();
}

// A segment another user could have made, or one others may write (mode 0644 here), is never
// mapped: a rank writes only into memory whose creator it verified.
TEST(SharedMemory, SegmentsOthersCanWriteAreRefused) {
  const std::string name = "/refit-test-" + unguessable_suffix();
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  ASSERT_EQ(fchmod(fd, 0644), 0);
  close(fd);
  auto open = SharedMemory::open(name, 4096);
  shm_unlink(name.c_str());
  ASSERT_FALSE(open.ok());
  EXPECT_NE(open.status().message().find("with mode 644; refit maps only segments its own user "
                                         "created with mode 600"),
            std::string::npos)
      << open.status().to_string();
}

}  // namespace
}  // namespace refit

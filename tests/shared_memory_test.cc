// POSIX shared-memory segments (plane/shared_memory.h): created exclusively with mode 0600 under
// names no other process can guess, and refused when the segment is smaller than asked.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
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

// A /dev/shm too small for a segment (a container's default is 64 MB): create() fails naming the
// segment, its size and /dev/shm, instead of a later write dying of SIGBUS. The child runs in a
// mount namespace of its own with a 1 MiB tmpfs on /dev/shm (root only; skipped otherwise).
TEST(SharedMemory, ASegmentTheFileSystemCannotHoldIsAnErrorNamingDevShm) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root for a mount namespace";
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::string said = "skip: no mount namespace";
    if (::unshare(CLONE_NEWNS) == 0 &&
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 &&
        ::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=1m") == 0) {
      auto s = SharedMemory::create("/refit-test-" + unguessable_suffix(), std::size_t{8} << 20);
      said = s.ok() ? "created" : s.status().to_string();
    }
    (void)!::write(fds[1], said.data(), said.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string said;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) said.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status) << ": " << said;
  if (said.rfind("skip:", 0) == 0) GTEST_SKIP() << said;
  EXPECT_NE(said.find("(8388608 bytes): cannot fault its pages in"), std::string::npos) << said;
  EXPECT_NE(said.find("/dev/shm is full or too small"), std::string::npos) << said;
}

}  // namespace
}  // namespace refit

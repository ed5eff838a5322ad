// Tests of nvme/: round trips through every backend (io_uring, thread pool;
// direct and buffered) from several threads, faults injected below the
// engine, the io_uring and O_DIRECT fallbacks, CRC-32C against known values,
// and the swap store (permissions, cleanup, checksums, truncation, errors).
#include <errno.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <atomic>
#include <cstdlib>
#include <new>

#include "nvme/bench.h"
#include "nvme/buffer.h"
#include "nvme/crc32c.h"
#include "nvme/engine.h"
#include "nvme/swap_store.h"
#include "test_util.h"
#include "util/errors.h"
#include "util/fs.h"


// Every allocation of this test binary is counted while g_count_allocations
// is set (SwapTest.NoAllocationOnceWarm: Note [No allocation per request]
// in nvme/engine.cc).
namespace {
std::atomic<bool> g_count_allocations{false};
std::atomic<int64_t> g_allocations{0};
void* counted_alloc(std::size_t n, std::size_t align) {
  if (g_count_allocations.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(n == 0 ? 1 : n);
  } else if (::posix_memalign(&p, align, n == 0 ? align : n) != 0) {
    p = nullptr;
  }
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n, 0); }
void* operator new[](std::size_t n) { return counted_alloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_alloc(n, std::size_t(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_alloc(n, std::size_t(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace strata::nvme {
namespace {

using strata::testing::TempDir;

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * 1024;

void fill_random(std::byte* p, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = std::byte(rng() & 0xFF);
}

File open_rw(const std::string& path, DirectIo direct) {
  return File::open(path,
                    OpenOptions{.write = true, .create = true, .mode = 0600, .direct = direct});
}

// Expects `fn` to throw IoError with errno `err` and a message containing `text`.
template <typename Fn>
void expect_io_error(Fn&& fn, int err, const std::string& text) {
  try {
    fn();
    ADD_FAILURE() << "no IoError (expected errno " << err << ", \"" << text << "\")";
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), err) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// ---- round trips ----------------------------------------------------------------

struct Mode {
  BackendKind backend;
  DirectIo direct;
};

class RoundTrip : public ::testing::TestWithParam<Mode> {};

// Four threads each own a 4 MiB slice of one file and write, then read back,
// random ranges of it (random sizes, offsets and buffer addresses: aligned
// for direct I/O, arbitrary for buffered), comparing byte for byte. Small
// blocks and two rings exercise splitting and spreading.
TEST_P(RoundTrip, RandomRangesFromSeveralThreads) {
  const Mode mode = GetParam();
  TempDir dir;
  EngineOptions options;
  options.backend = mode.backend;
  options.block_size_bytes = 64 * kKiB;
  options.queue_depth = 8;
  options.rings = 2;
  IoEngine engine(options);
  EXPECT_STREQ(engine.backend_name(),
               mode.backend == BackendKind::kThreadPool ? "threads" : "io_uring");
  File f = open_rw(dir.file("data"), mode.direct);
  const bool direct = f.direct();
  EXPECT_EQ(direct, mode.direct != DirectIo::kOff);
  f.preallocate(16 * kMiB);
  const FileId id = engine.attach(std::move(f));

  constexpr int kThreads = 4;
  constexpr int64_t kSlice = 4 * kMiB;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(uint64_t(t) * 7919 + 1);
      PinnedBuffer src(kSlice + 8 * kKiB, BufferOptions{.lock = false, .huge_pages = false});
      PinnedBuffer dst(kSlice + 8 * kKiB, BufferOptions{.lock = false, .huge_pages = false});
      for (int iter = 0; iter < 12; ++iter) {
        const int64_t unit = direct ? kDirectAlignmentBytes : 1;
        const int64_t bytes =
            std::max<int64_t>(unit, int64_t(rng() % uint64_t(kSlice / 2)) / unit * unit);
        const int64_t offset = int64_t(rng() % uint64_t(kSlice - bytes + 1)) / unit * unit;
        const int64_t shift = direct ? 0 : int64_t(rng() % 4096);
        std::byte* out = src.data() + shift;
        std::byte* in = dst.data() + (direct ? 0 : int64_t(rng() % 4096));
        fill_random(out, bytes, rng());
        std::memset(in, 0xEE, size_t(bytes));
        const int64_t file_offset = t * kSlice + offset;
        engine.write(id, file_offset, bytes, out);
        engine.read(id, file_offset, bytes, in);
        if (std::memcmp(in, out, size_t(bytes)) != 0) {
          failures[size_t(t)] = "mismatch at offset " + std::to_string(file_offset) + ", " +
                                std::to_string(bytes) + " bytes";
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& f : failures) EXPECT_EQ(f, "");
  const EngineStats s = engine.stats();
  EXPECT_GT(s.read_ops, 4 * 12);  // split into many 64 KiB pieces
  EXPECT_EQ(s.read_bytes, s.write_bytes);
}

INSTANTIATE_TEST_SUITE_P(Backends, RoundTrip,
                         ::testing::Values(Mode{BackendKind::kIoUring, DirectIo::kRequire},
                                           Mode{BackendKind::kIoUring, DirectIo::kOff},
                                           Mode{BackendKind::kThreadPool, DirectIo::kRequire},
                                           Mode{BackendKind::kThreadPool, DirectIo::kOff}),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return std::string(info.param.backend == BackendKind::kIoUring
                                                  ? "IoUring"
                                                  : "Threads") +
                                  (info.param.direct == DirectIo::kOff ? "Buffered" : "Direct");
                         });

// A fixture with an engine over one 8 MiB file and two buffers in a registered pool.
class EngineTest : public ::testing::Test {
 protected:
  void start(EngineOptions options, DirectIo direct = DirectIo::kAuto) {
    options.fixed_buffers = {{pool_.region().data(), pool_.region().bytes()}};
    engine_ = std::make_unique<IoEngine>(options);
    File f = open_rw(dir_.file("data"), direct);
    f.preallocate(kFileBytes);
    file_ = engine_->attach(std::move(f));
    src_ = pool_.acquire();
    dst_ = pool_.acquire();
    fill_random(src_.data(), kFileBytes, 42);
  }
  void TearDown() override {
    src_.reset();
    dst_.reset();
    engine_.reset();
  }
  bool read_matches() { return std::memcmp(src_.data(), dst_.data(), size_t(kFileBytes)) == 0; }

  static constexpr int64_t kFileBytes = 8 * kMiB;
  TempDir dir_;
  BufferPool pool_{kFileBytes, 2};
  std::unique_ptr<IoEngine> engine_;
  FileId file_;
  BufferPool::Lease src_, dst_;
};

TEST_F(EngineTest, RegisteredBuffersAndBatchingModes) {
  for (const bool single_submit : {false, true}) {
    for (const bool overlap : {true, false}) {
      EngineOptions o;
      o.block_size_bytes = 256 * kKiB;
      o.queue_depth = 4;
      o.single_submit = single_submit;
      o.overlap_events = overlap;
      start(o);
      engine_->write(file_, 0, kFileBytes, src_.data());
      std::memset(dst_.data(), 0, size_t(kFileBytes));
      engine_->read(file_, 0, kFileBytes, dst_.data());
      EXPECT_TRUE(read_matches()) << single_submit << overlap;
      const EngineStats s = engine_->stats();
      EXPECT_EQ(s.read_ops, 32);
      if (std::string(engine_->backend_name()) == "io_uring" && geteuid() == 0) {
        EXPECT_EQ(s.fixed_buffer_ops, 64);  // root: no RLIMIT_MEMLOCK on registration
      }
      if (single_submit) {
        EXPECT_GE(s.submits, 64);
      }
      TearDown();
    }
  }
}

// Note [Registered buffers]: a buffer registered after the engine started is
// used registered by every ring until its registration ends; entries are
// reused, so registering and releasing more buffers than the table holds
// keeps working.
TEST_F(EngineTest, BuffersRegisteredWhileRunningAreUsedRegisteredUntilReleased) {
  EngineOptions o;
  o.block_size_bytes = 256 * kKiB;
  o.rings = 2;
  start(o);
  if (std::string(engine_->backend_name()) != "io_uring" || geteuid() != 0) {
    GTEST_SKIP() << "needs io_uring and root (RLIMIT_MEMLOCK limits registration otherwise)";
  }
  engine_->write(file_, 0, kFileBytes, src_.data());  // from the options' registered pool
  const int64_t from_pool = engine_->stats().fixed_buffer_ops;
  EXPECT_EQ(from_pool, 32);
  PinnedBuffer late(kFileBytes);
  for (int round = 0; round < kBufferTableSlots + 10; ++round) {
    BufferRegistration r = engine_->register_buffer(late.data(), kFileBytes);
    ASSERT_TRUE(r.registered()) << "round " << round;
    if (round == 0) {
      std::memset(late.data(), 0, size_t(kFileBytes));
      const EngineStats before = engine_->stats();
      engine_->read(file_, 0, kFileBytes, late.data());
      EXPECT_EQ(std::memcmp(late.data(), src_.data(), size_t(kFileBytes)), 0);
      EXPECT_EQ(engine_->stats().fixed_buffer_ops - before.fixed_buffer_ops, 32);
    }
  }
  // Released: the same buffer's I/O is no longer registered.
  const EngineStats before = engine_->stats();
  engine_->read(file_, 0, kFileBytes, late.data());
  EXPECT_EQ(engine_->stats().fixed_buffer_ops, before.fixed_buffer_ops);
  EXPECT_EQ(engine_->stats().read_ops - before.read_ops, 32);
}

TEST_F(EngineTest, ManyRequestsInOneHandleAndDrainAtShutdown) {
  EngineOptions o;
  o.block_size_bytes = 128 * kKiB;
  o.rings = 3;
  start(o);
  std::vector<IoRequest> writes;
  for (int64_t off = 0; off < kFileBytes; off += 512 * kKiB) {
    writes.push_back({IoOp::kWrite, file_, off, 512 * kKiB, src_.data() + off});
  }
  engine_->submit(writes).wait();
  // Reads submitted and never waited for: the engine's destructor executes
  // and drains them; the handles are done afterwards.
  std::vector<IoHandle> handles;
  for (int64_t off = 0; off < kFileBytes; off += kMiB) {
    handles.push_back(engine_->submit({IoOp::kRead, file_, off, kMiB, dst_.data() + off}));
  }
  engine_.reset();
  for (auto& h : handles) {
    EXPECT_TRUE(h.done());
    h.wait();
  }
  EXPECT_TRUE(read_matches());
}

TEST_F(EngineTest, MisalignedDirectIoIsRejected) {
  start(EngineOptions{}, DirectIo::kRequire);
  EXPECT_THROW(engine_->read(file_, 512, 4096, dst_.data()), InternalError);
  EXPECT_THROW(engine_->read(file_, 0, 1000, dst_.data()), InternalError);
  EXPECT_THROW(engine_->read(file_, 0, 4096, dst_.data() + 8), InternalError);
  engine_->read(file_, 0, 0, dst_.data());  // zero bytes: nothing to do
}

TEST_F(EngineTest, ReadPastEndOfFileFails) {
  start(EngineOptions{});
  expect_io_error([&] { engine_->read(file_, kFileBytes - 4096, 8192, dst_.data()); }, 0,
                  "read past the end of the file");
  expect_io_error([&] { engine_->read(file_, kFileBytes, 4096, dst_.data()); }, 0,
                  "read past the end of the file");
}

TEST(EngineOptionsTest, OutOfRangeOptionsAreConfigErrors) {
  EngineOptions o;
  o.block_size_bytes = 1000;
  EXPECT_THROW(IoEngine{o}, ConfigError);
  o = EngineOptions{};
  o.queue_depth = 0;
  EXPECT_THROW(IoEngine{o}, ConfigError);
  o = EngineOptions{};
  o.rings = 0;
  EXPECT_THROW(IoEngine{o}, ConfigError);
}

TEST(EngineFilesTest, AttachLimitAndDetach) {
  TempDir dir;
  EngineOptions o;
  o.max_files = 2;
  IoEngine engine(o);
  const FileId a = engine.attach(open_rw(dir.file("a"), DirectIo::kAuto));
  engine.attach(open_rw(dir.file("b"), DirectIo::kAuto));
  expect_io_error([&] { engine.attach(open_rw(dir.file("c"), DirectIo::kAuto)); }, EMFILE,
                  "cannot attach more than 2 files");
  File back = engine.detach(a);
  EXPECT_TRUE(back.valid());
  EXPECT_EQ(back.path(), dir.file("a"));
  engine.attach(open_rw(dir.file("c"), DirectIo::kAuto));  // the slot is free again
}

// ---- fault injection --------------------------------------------------------------

struct FaultCase {
  FaultKind kind;
  BackendKind backend;
};

class FaultTest : public EngineTest, public ::testing::WithParamInterface<FaultCase> {
 protected:
  // Starts an engine whose `first_op`-th operation (of `only`) gets the fault,
  // `count` times in a row.
  std::shared_ptr<FaultPlan> start_faulty(int64_t first_op, int64_t count, IoOp only) {
    auto plan = std::make_shared<FaultPlan>();
    plan->kind = GetParam().kind;
    plan->first_op = first_op;
    plan->count = count;
    plan->only_op = int(only);
    EngineOptions o;
    o.backend = GetParam().backend;
    o.block_size_bytes = 512 * kKiB;
    o.queue_depth = 4;
    o.rings = 2;
    o.faults = plan;
    start(o);
    return plan;
  }
};

// The 5th read fails once. EAGAIN, EINTR and short reads are retried and the
// bytes are right; EIO and ENOSPC fail the request with the right errno, path
// and offset of the failed piece, and never report success.
TEST_P(FaultTest, OneFaultyRead) {
  const FaultKind kind = GetParam().kind;
  auto plan = start_faulty(5, 1, IoOp::kRead);
  engine_->write(file_, 0, kFileBytes, src_.data());
  std::memset(dst_.data(), 0, size_t(kFileBytes));
  IoHandle h = engine_->submit({IoOp::kRead, file_, 0, kFileBytes, dst_.data()});
  if (kind == FaultKind::kEio || kind == FaultKind::kEnospc) {
    const int err = kind == FaultKind::kEio ? EIO : ENOSPC;
    try {
      h.wait();
      ADD_FAILURE() << "a failed read reported success";
    } catch (const IoError& e) {
      EXPECT_EQ(e.err(), err);
      EXPECT_EQ(e.path(), dir_.file("data"));
      EXPECT_GE(e.offset(), 0);
      EXPECT_EQ(e.offset() % (512 * kKiB), 0);
      EXPECT_NE(std::string(e.what()).find("read failed"), std::string::npos) << e.what();
    }
    EXPECT_THROW(h.wait(), IoError);  // and again
  } else {
    h.wait();
    EXPECT_TRUE(read_matches());
    const EngineStats s = engine_->stats();
    if (kind == FaultKind::kShort) {
      EXPECT_EQ(s.short_transfers, 1);
    } else {
      EXPECT_EQ(s.retries, 1);
    }
  }
  EXPECT_EQ(plan->injected.load(), 1);
}

// A write fault: errors surface from the write; retried faults leave the
// file exactly as written.
TEST_P(FaultTest, OneFaultyWrite) {
  const FaultKind kind = GetParam().kind;
  start_faulty(3, 1, IoOp::kWrite);
  IoHandle h = engine_->submit({IoOp::kWrite, file_, 0, kFileBytes, src_.data()});
  if (kind == FaultKind::kEio || kind == FaultKind::kEnospc) {
    expect_io_error([&] { h.wait(); }, kind == FaultKind::kEio ? EIO : ENOSPC, "write failed");
    return;
  }
  h.wait();
  engine_->read(file_, 0, kFileBytes, dst_.data());
  EXPECT_TRUE(read_matches());
}

INSTANTIATE_TEST_SUITE_P(Kinds, FaultTest,
                         ::testing::Values(FaultCase{FaultKind::kEio, BackendKind::kIoUring},
                                           FaultCase{FaultKind::kEnospc, BackendKind::kIoUring},
                                           FaultCase{FaultKind::kShort, BackendKind::kIoUring},
                                           FaultCase{FaultKind::kEagain, BackendKind::kIoUring},
                                           FaultCase{FaultKind::kEintr, BackendKind::kIoUring},
                                           FaultCase{FaultKind::kEio, BackendKind::kThreadPool},
                                           FaultCase{FaultKind::kShort, BackendKind::kThreadPool},
                                           FaultCase{FaultKind::kEagain, BackendKind::kThreadPool}),
                         [](const ::testing::TestParamInfo<FaultCase>& info) {
                           return std::string(fault_kind_name(info.param.kind)) +
                                  (info.param.backend == BackendKind::kIoUring ? "IoUring"
                                                                               : "Threads");
                         });

// EAGAIN forever: retried a bounded number of times, then an error.
TEST_F(EngineTest, PersistentEagainGivesUp) {
  auto plan = std::make_shared<FaultPlan>();
  plan->kind = FaultKind::kEagain;
  plan->first_op = 2;
  plan->count = -1;
  EngineOptions o;
  o.block_size_bytes = kMiB;
  o.faults = plan;
  start(o);
  expect_io_error([&] { engine_->write(file_, 0, 2 * kMiB, src_.data()); }, EAGAIN, "retries");
}

// Every operation short: the whole transfer still completes, piece by piece.
TEST_F(EngineTest, EveryTransferShort) {
  auto plan = std::make_shared<FaultPlan>();
  plan->kind = FaultKind::kShort;
  plan->count = -1;
  EngineOptions o;
  o.block_size_bytes = 256 * kKiB;
  o.faults = plan;
  start(o);
  engine_->write(file_, 0, kFileBytes, src_.data());
  engine_->read(file_, 0, kFileBytes, dst_.data());
  EXPECT_TRUE(read_matches());
  EXPECT_GT(engine_->stats().short_transfers, 64);
}

// ---- fallbacks ----------------------------------------------------------------------

// Installs a seccomp filter on the calling thread (and the threads it starts)
// that fails io_uring_setup with EPERM, as container runtimes do.
void forbid_io_uring_on_this_thread() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  ASSERT_EQ(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
  ASSERT_EQ(syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog), 0) << std::strerror(errno);
}

TEST(FallbackTest, ThreadPoolWhereIoUringIsForbidden) {
  TempDir dir;
  std::thread([&] {
    forbid_io_uring_on_this_thread();
    IoEngine engine(EngineOptions{});  // kAuto
    EXPECT_STREQ(engine.backend_name(), "threads");
    const FileId id = engine.attach(open_rw(dir.file("f"), DirectIo::kAuto));
    PinnedBuffer a(kMiB), b(kMiB);
    fill_random(a.data(), kMiB, 7);
    engine.write(id, 0, kMiB, a.data());
    engine.read(id, 0, kMiB, b.data());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), kMiB), 0);
    EngineOptions forced;
    forced.backend = BackendKind::kIoUring;
    expect_io_error([&] { IoEngine e(forced); }, EPERM, "cannot create a ring");
  }).join();
}

TEST(FallbackTest, BufferedWhereODirectIsRefused) {
  TempDir dir;
  testing::set_refuse_direct_open(true);
  File f = open_rw(dir.file("f"), DirectIo::kAuto);
  EXPECT_FALSE(f.direct());
  expect_io_error([&] { open_rw(dir.file("g"), DirectIo::kRequire); }, EINVAL, "direct I/O");
  EXPECT_FALSE(path_exists(dir.file("g"))) << "a file that could not be opened was left behind";
  testing::set_refuse_direct_open(false);
  // Buffered I/O through the engine, with the page cache dropped in between.
  IoEngine engine(EngineOptions{});
  const FileId id = engine.attach(std::move(f));
  std::vector<char> a(100000), b(100000);
  fill_random(reinterpret_cast<std::byte*>(a.data()), int64_t(a.size()), 3);
  engine.write(id, 123, int64_t(a.size()), a.data());
  engine.file(id).drop_cache();
  engine.read(id, 123, int64_t(b.size()), b.data());
  EXPECT_EQ(a, b);
}

TEST(FallbackTest, TmpfsRoundTrip) {
  if (!is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  char tmpl[] = "/dev/shm/strata-nvme-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  {
    IoEngine engine(EngineOptions{});
    File f = open_rw(std::string(tmpl) + "/f", DirectIo::kAuto);  // direct or not, per kernel
    const FileId id = engine.attach(std::move(f));
    PinnedBuffer a(kMiB), b(kMiB);
    fill_random(a.data(), kMiB, 9);
    engine.write(id, 4096, kMiB, a.data());
    engine.read(id, 4096, kMiB, b.data());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), kMiB), 0);
  }
  ::unlink((std::string(tmpl) + "/f").c_str());
  ::rmdir(tmpl);
}

// ---- buffers -----------------------------------------------------------------------

TEST(BufferTest, AlignmentAndPool) {
  PinnedBuffer huge(3 * kMiB);
  EXPECT_EQ(uintptr_t(huge.data()) % uintptr_t(kHugePageBytes), 0u);
  EXPECT_EQ(huge.bytes(), 3 * kMiB);
  PinnedBuffer small(5000, BufferOptions{.lock = false, .huge_pages = false});
  EXPECT_EQ(uintptr_t(small.data()) % 4096, 0u);
  EXPECT_FALSE(small.locked());
  PinnedBuffer moved = std::move(huge);
  EXPECT_EQ(huge.data(), nullptr);

  BufferPool pool(64 * kKiB, 2);
  auto a = pool.acquire();
  auto b = pool.acquire();
  EXPECT_NE(a.data(), b.data());
  EXPECT_FALSE(pool.try_acquire().has_value());
  std::thread releaser([&] { a.reset(); });
  auto c = pool.acquire();  // blocks until the releaser returns a slot
  releaser.join();
  EXPECT_EQ(c.bytes(), 64 * kKiB);
  EXPECT_EQ(uintptr_t(c.data()) % 4096, 0u);
}

// ---- bench-io ------------------------------------------------------------------------

TEST(BenchTest, WritesThenReadsTheWholeFileAndCleansUp) {
  TempDir dir;
  for (const DirectIo direct : {DirectIo::kRequire, DirectIo::kOff}) {
    BenchOptions bo;
    bo.dir = dir.path();
    bo.bytes = 8 * kMiB;
    bo.max_buffer_bytes = 2 * kMiB;  // requests reuse the buffer
    bo.direct = direct;
    std::string path;
    {
      IoBench bench(bo);
      path = bench.path();
      EngineOptions eo;
      eo.block_size_bytes = 256 * kKiB;
      eo.queue_depth = 4;
      eo.rings = 2;
      for (const IoOp op : {IoOp::kWrite, IoOp::kRead}) {
        int64_t last = 0;
        const BenchResult r = bench.run(op, eo, [&](int64_t done, int64_t total) {
          EXPECT_GT(done, last);
          EXPECT_EQ(total, 8 * kMiB);
          last = done;
        });
        EXPECT_EQ(last, 8 * kMiB);
        EXPECT_EQ(r.op, op);
        EXPECT_EQ(r.bytes, 8 * kMiB);
        EXPECT_GT(r.seconds, 0);
        EXPECT_GT(r.gbps(), 0);
        EXPECT_EQ(r.direct, direct == DirectIo::kRequire);
        EXPECT_EQ(r.rings, 2);
      }
      // Read back while a second file is written: both passes' bytes, and
      // the first file still reads whole afterwards.
      IoBench second(bo);
      ASSERT_NE(second.path(), path) << "both at once must read one file while writing another";
      const BenchResult both = run_both(bench, second, eo);
      EXPECT_EQ(both.bytes, 16 * kMiB);
      EXPECT_GT(both.seconds, 0);
      // Note [Nameless bench files]: unlinked at creation, read and written
      // through their descriptors, so nothing can be left behind.
      EXPECT_FALSE(path_exists(second.path()));
      EXPECT_EQ(bench.run(IoOp::kRead, eo).bytes, 8 * kMiB);
      EXPECT_FALSE(path_exists(path));
      EXPECT_TRUE(list_dir(dir.path()).empty()) << "a temporary bench file has a name";
    }
    EXPECT_FALSE(path_exists(path)) << "temporary file left behind";
  }
  BenchOptions missing;
  missing.dir = dir.file("nope");
  missing.bytes = kMiB;
  EXPECT_THROW(IoBench{missing}, InputError);
}

// ---- crc32c -------------------------------------------------------------------------

TEST(Crc32cTest, KnownValues) {
  const char* digits = "123456789";
  EXPECT_EQ(crc32c_software(digits, 9), 0xE3069283u);
  EXPECT_EQ(crc32c(digits, 9), 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xFF);
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  std::vector<unsigned char> inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[size_t(i)] = uint8_t(i);
    dec[size_t(i)] = uint8_t(31 - i);
  }
  EXPECT_EQ(crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c(dec.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

TEST(Crc32cTest, HardwareMatchesSoftwareAndContinues) {
  std::vector<std::byte> data(300000);
  fill_random(data.data(), int64_t(data.size()), 11);
  std::mt19937 rng(5);
  for (int i = 0; i < 200; ++i) {
    const size_t start = rng() % 64;
    const size_t len = i < 100 ? size_t(i) * 37 : rng() % (data.size() - 64);
    const uint32_t sw = crc32c_software(data.data() + start, len);
    if (crc32c_hardware_available()) {
      ASSERT_EQ(crc32c_hardware(data.data() + start, len), sw) << start << " " << len;
    }
    const size_t cut = len / 3;
    const uint32_t a = crc32c(data.data() + start, cut);
    ASSERT_EQ(crc32c(data.data() + start + cut, len - cut, a), sw);
    ASSERT_EQ(crc32c_combine(a, crc32c(data.data() + start + cut, len - cut), len - cut), sw);
  }
  // Per-block CRCs, with a short last block.
  for (size_t bytes : {size_t(4096), size_t(3 * 4096), size_t(7 * 4096 + 100), size_t(100), size_t(5 * 4096 - 8)}) {
    std::vector<uint32_t> out((bytes + 4095) / 4096);
    crc32c_blocks(data.data() + 5, bytes, 4096, out.data());
    for (size_t k = 0; k < out.size(); ++k) {
      const size_t len = std::min<size_t>(4096, bytes - k * 4096);
      EXPECT_EQ(out[k], crc32c_software(data.data() + 5 + k * 4096, len)) << bytes << " block " << k;
    }
  }
}

// Every way of hashing blocks this CPU has (Note [Folding CRC] in nvme/crc32c.cc):
// block sizes the folds take (multiples of 128 bytes) and ones they leave to
// the crc32 chains, unaligned starts, short last blocks, against the table.
TEST(Crc32cTest, EveryBlockImplementationMatchesTheTable) {
  std::vector<std::byte> data(200000);
  fill_random(data.data(), int64_t(data.size()), 23);
  int ran = 0;
  for (BlockCrc impl : {BlockCrc::kFold512, BlockCrc::kFold256, BlockCrc::kThreeChains, BlockCrc::kSoftware}) {
    if (!block_crc_available(impl)) continue;
    ++ran;
    for (size_t block : {size_t(4096), size_t(128), size_t(256), size_t(384), size_t(4160), size_t(100)}) {
      for (size_t start : {size_t(0), size_t(1), size_t(61)}) {
        for (size_t blocks : {size_t(1), size_t(5)}) {
          for (size_t tail : {size_t(0), size_t(37)}) {
            const size_t bytes = blocks * block + tail;
            std::vector<uint32_t> out(blocks + (tail != 0), 0);
            crc32c_blocks_with(impl, data.data() + start, bytes, block, out.data());
            for (size_t k = 0; k < out.size(); ++k) {
              const size_t len = std::min(block, bytes - k * block);
              ASSERT_EQ(out[k], crc32c_software(data.data() + start + k * block, len))
                  << block_crc_name(impl) << " block " << block << " start " << start << " #" << k;
            }
          }
        }
      }
    }
    // A block of zeros and one of ones: the initial ~0 must be folded in.
    std::vector<std::byte> flat(4096, std::byte{0});
    uint32_t z = 0;
    crc32c_blocks_with(impl, flat.data(), flat.size(), 4096, &z);
    EXPECT_EQ(z, crc32c_software(flat.data(), flat.size())) << block_crc_name(impl);
    std::fill(flat.begin(), flat.end(), std::byte{0xFF});
    crc32c_blocks_with(impl, flat.data(), flat.size(), 4096, &z);
    EXPECT_EQ(z, crc32c_software(flat.data(), flat.size())) << block_crc_name(impl);
  }
  EXPECT_GE(ran, 1);
  if (!block_crc_available(BlockCrc::kFold512) || !block_crc_available(BlockCrc::kFold256)) {
    std::printf("[ note     ] this CPU lacks %s: not checked here\n",
                block_crc_available(BlockCrc::kFold256) ? "fold512" : "VPCLMULQDQ (fold512, fold256)");
  }
  // The swap store's 4 KiB blocks take a table-driven combine of their own.
  for (size_t len : {size_t(4096), size_t(4095), size_t(4097), size_t(8192)}) {
    for (size_t start : {size_t(0), size_t(3), size_t(4096)}) {
      const uint32_t sw = crc32c_software(data.data() + start, len);
      EXPECT_EQ(crc32c(data.data() + start, len), sw) << start << " " << len;
      if (crc32c_hardware_available()) {
        EXPECT_EQ(crc32c_hardware(data.data() + start, len), sw);
      }
    }
  }
}

// ---- swap store -----------------------------------------------------------------------

mode_t mode_of(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

class SwapTest : public ::testing::Test {
 protected:
  SwapTest() {
    EngineOptions o;
    o.block_size_bytes = 256 * kKiB;
    o.rings = 2;
    o.fixed_buffers = {{buf_.data(), buf_.bytes()}};
    engine_ = std::make_unique<IoEngine>(o);
  }
  SwapOptions options(int dirs, int64_t capacity = 24 * kMiB) {
    SwapOptions s;
    for (int i = 0; i < dirs; ++i) {
      const std::string d = root_.file("drive" + std::to_string(i));
      ::mkdir(d.c_str(), 0755);
      s.dirs.push_back(d);
    }
    s.capacity_bytes = capacity;
    s.stripe_bytes = kMiB;
    s.block_bytes = 256 * kKiB;
    return s;
  }

  TempDir root_;
  PinnedBuffer buf_{16 * kMiB};
  std::unique_ptr<IoEngine> engine_;
};

// Note [No allocation per request] (nvme/engine.cc): once the engine and the
// store have run a while, a step's swapping allocates nothing: writes with
// their checksums and reads with their verification, over three directories
// (several pieces a request) and two rings, through io_uring and the thread
// pool alike.
TEST_F(SwapTest, NoAllocationOnceWarm) {
  for (const BackendKind kind : {BackendKind::kAuto, BackendKind::kThreadPool}) {
    EngineOptions eo;
    eo.block_size_bytes = 256 * kKiB;
    eo.rings = 2;
    eo.queue_depth = 4;
    eo.backend = kind;
    eo.fixed_buffers = {{buf_.data(), buf_.bytes()}};
    IoEngine engine(eo);
    SwapStore store(engine, options(3));
    const RegionId a = store.add_region("a", 3 * kMiB), b = store.add_region("b", 2 * kMiB + 4096);
    std::byte* src = buf_.data();
    std::byte* dst = buf_.data() + 8 * kMiB;
    fill_random(src, 4 * kMiB, 7);
    auto step = [&] {
      SwapHandle wa = store.write(a, 0, 3 * kMiB, src);
      SwapHandle wb = store.write(b, 0, 2 * kMiB + 4096, src + 3 * kMiB / 2);
      wa.wait();
      wb.wait();
      SwapHandle ra = store.read(a, kMiB / 2, 2 * kMiB, dst);
      SwapHandle rb = store.read(b, 0, 2 * kMiB + 4096, dst + 4 * kMiB);
      ra.wait();
      rb.wait();
    };
    for (int i = 0; i < 8; ++i) step();  // warm: pools and lists reach their size
    g_allocations = 0;
    g_count_allocations = true;
    for (int i = 0; i < 32; ++i) step();
    g_count_allocations = false;
    EXPECT_EQ(g_allocations.load(), 0) << "allocations in 32 warm steps, backend " << int(kind);
    ASSERT_EQ(std::memcmp(dst, src + kMiB / 2, size_t(2 * kMiB)), 0);
    ASSERT_EQ(std::memcmp(dst + 4 * kMiB, src + 3 * kMiB / 2, size_t(2 * kMiB + 4096)), 0);
  }
}

TEST_F(SwapTest, RegionsRoundTripStripedOverThreeDirectories) {
  SwapStore store(*engine_, options(3));
  EXPECT_EQ(store.capacity_bytes(), 24 * kMiB);
  // Sizes that are not multiples of a block or of 4 KiB.
  const int64_t sizes[] = {5 * kMiB + 12345, 256 * kKiB, 3 * kMiB, 100};
  std::vector<RegionId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(store.add_region("r" + std::to_string(i), sizes[i]));
  EXPECT_EQ(store.find("r2").index, ids[2].index);
  EXPECT_FALSE(store.find("nope").valid());
  std::byte* src = buf_.data();
  std::byte* dst = buf_.data() + 8 * kMiB;
  std::vector<SwapHandle> writes;
  for (int i = 0; i < 4; ++i) {
    fill_random(src + i * 2 * kMiB, std::min<int64_t>(sizes[i], 2 * kMiB), 100 + uint64_t(i));
  }
  // Write each region from its own 2 MiB of `src` (regions larger than that
  // are written in block-sized pieces that reuse it).
  for (int i = 0; i < 4; ++i) {
    const int64_t n = sizes[i];
    for (int64_t off = 0; off < n; off += 2 * kMiB) {
      const int64_t len = std::min(2 * kMiB, n - off);
      store.write(ids[size_t(i)], off, len, src + i * 2 * kMiB).wait();
    }
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t n = sizes[i];
    for (int64_t off = 0; off < n; off += 2 * kMiB) {
      const int64_t len = std::min(2 * kMiB, n - off);
      std::memset(dst, 0, size_t(2 * kMiB));
      SwapHandle h = store.read(ids[size_t(i)], off, len, dst);
      h.wait();
      ASSERT_EQ(std::memcmp(dst, src + i * 2 * kMiB, size_t(len)), 0)
          << "region " << i << " at " << off;
    }
  }
  // Every directory received stripes.
  for (const std::string& p : store.file_paths()) {
    struct stat st;
    ASSERT_EQ(::stat(p.c_str(), &st), 0);
    EXPECT_EQ(st.st_size, 8 * kMiB);
  }
}

TEST_F(SwapTest, PermissionsPreallocationAndCleanup) {
  const SwapOptions o = options(2);
  std::vector<std::string> dirs, files;
  {
    SwapStore store(*engine_, o);
    dirs = store.store_dirs();
    files = store.file_paths();
    ASSERT_EQ(dirs.size(), 2u);
    for (const auto& d : dirs) EXPECT_EQ(mode_of(d), 0700u) << d;
    for (const auto& f : files) {
      EXPECT_EQ(mode_of(f), 0600u) << f;
      struct stat st;
      ASSERT_EQ(::stat(f.c_str(), &st), 0);
      EXPECT_GE(int64_t(st.st_blocks) * 512, 12 * kMiB) << "not preallocated: " << f;
    }
  }
  for (const auto& f : files) EXPECT_FALSE(path_exists(f)) << f;
  for (const auto& d : dirs) EXPECT_FALSE(path_exists(d)) << d;
  for (const auto& d : o.dirs) EXPECT_TRUE(is_directory(d)) << d;  // the user's directories stay
}

TEST_F(SwapTest, FlippedByteIsCaughtOnTheNextRead) {
  SwapStore store(*engine_, options(1));
  const RegionId id = store.add_region("moments", 2 * kMiB);
  fill_random(buf_.data(), 2 * kMiB, 1);
  store.write(id, buf_.data()).wait();
  store.read(id, buf_.data() + 4 * kMiB).wait();  // intact
  // Flip one byte in the second block of the file, behind the store's back.
  const std::string path = store.file_paths().front();
  ASSERT_TRUE(strata::testing::flip_bytes(path, std::vector<off_t>{256 * kKiB + 777}, 0x10));
  SwapHandle corrupt = store.read(id, buf_.data() + 4 * kMiB);
  try {
    corrupt.wait();
    ADD_FAILURE() << "a corrupt block was returned";
  } catch (const IoError& e) {
    EXPECT_EQ(e.path(), path);
    EXPECT_EQ(e.offset(), 256 * kKiB);
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'moments'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(corrupt.wait(), IoError) << "a second wait() reported success";
  // Blocks before the flipped one still read and verify.
  store.read(id, 0, 256 * kKiB, buf_.data() + 4 * kMiB).wait();
}

// Note [Parallel checksums]: runs the chunks on three threads, the last
// range first, and counts the calls.
class ReversedThreads final : public ParallelFor {
 public:
  void run(int64_t n, Body body, void* context) const override {
    ++calls;
    std::vector<std::thread> threads;
    for (int t = 2; t >= 0; --t) {
      threads.emplace_back([=] { body(context, n * t / 3, n * (t + 1) / 3); });
      if (t == 2) threads.back().join(), threads.pop_back();  // the last range ends before the others start
    }
    for (std::thread& t : threads) t.join();
  }
  mutable int calls = 0;
};

TEST_F(SwapTest, ParallelChecksumsAgreeWithOneThreadAndReportTheLowestBadBlock) {
  SwapOptions o = options(1);
  o.block_bytes = 4096;  // 48 blocks a chunk: a dozen chunks
  SwapStore store(*engine_, o);
  const int64_t n = 2 * kMiB + 1000;  // a short last block
  const RegionId id = store.add_region("exp_avg", n);
  std::byte* src = buf_.data();
  std::byte* dst = buf_.data() + 4 * kMiB;
  fill_random(src, n, 7);
  ReversedThreads threads;
  // Checksummed on the threads, verified on one; then the other way round.
  store.write(id, 0, n, src, &threads).wait();
  EXPECT_EQ(threads.calls, 1);
  store.read(id, 0, n, dst).wait();
  ASSERT_EQ(std::memcmp(dst, src, size_t(n)), 0);
  store.write(id, 0, n, src).wait();
  std::memset(dst, 0, size_t(n));
  store.read(id, 0, n, dst, &threads).wait();
  EXPECT_EQ(threads.calls, 2);
  ASSERT_EQ(std::memcmp(dst, src, size_t(n)), 0);
  // Two flipped blocks, in the first and the last range: the first is named.
  const std::string path = store.file_paths().front();
  ASSERT_TRUE(strata::testing::flip_bytes(path, std::vector<off_t>{100 * 4096 + 5, 500 * 4096 + 9}, 0x01));
  try {
    store.read(id, 0, n, dst, &threads).wait();
    ADD_FAILURE() << "corrupt blocks were returned";
  } catch (const IoError& e) {
    EXPECT_EQ(e.path(), path);
    EXPECT_EQ(e.offset(), 100 * 4096) << e.what();
    EXPECT_NE(std::string(e.what()).find("'exp_avg' at region offset 409600"), std::string::npos) << e.what();
  }
  EXPECT_EQ(threads.calls, 3);
}

TEST_F(SwapTest, TruncatedFileIsCaught) {
  SwapStore store(*engine_, options(1, 4 * kMiB));
  const RegionId id = store.add_region("params", 4 * kMiB);
  fill_random(buf_.data(), 4 * kMiB, 2);
  store.write(id, buf_.data()).wait();
  ASSERT_EQ(::truncate(store.file_paths().front().c_str(), 3 * kMiB), 0);
  expect_io_error([&] { store.read(id, buf_.data() + 4 * kMiB).wait(); }, 0,
                  "read past the end of the file");
}

TEST_F(SwapTest, KeptStoreReopensAndCatchesTruncation) {
  SwapOptions o = options(2, 8 * kMiB);
  o.keep_files = true;
  std::string index;
  fill_random(buf_.data(), 3 * kMiB, 3);
  {
    SwapStore store(*engine_, o);
    const RegionId id = store.add_region("master", 3 * kMiB);
    store.write(id, buf_.data()).wait();
    index = store.index_path();
  }
  ASSERT_TRUE(path_exists(index));
  EXPECT_EQ(mode_of(index), 0600u);
  std::vector<std::string> files;
  {
    auto store = SwapStore::reopen(*engine_, index);
    files = store->file_paths();
    const RegionId id = store->find("master");
    ASSERT_TRUE(id.valid());
    EXPECT_EQ(store->region_bytes(id), 3 * kMiB);
    store->read(id, buf_.data() + 8 * kMiB).wait();
    EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 8 * kMiB, size_t(3 * kMiB)), 0);
  }
  ASSERT_EQ(::truncate(files[1].c_str(), kMiB), 0);
  expect_io_error([&] { SwapStore::reopen(*engine_, index); }, 0, "swap file is truncated");
  // A corrupt index is refused.
  {
    const int fd = ::open(index.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    unsigned char b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, 20), 1);
    b ^= 0x01;
    ASSERT_EQ(::pwrite(fd, &b, 1, 20), 1);
    ::close(fd);
  }
  EXPECT_THROW(SwapStore::reopen(*engine_, index), InputError);
  for (const auto& f : files) ::unlink(f.c_str());
  ::unlink(index.c_str());
  for (const auto& f : files) ::rmdir(parent_dir(f).c_str());
}

TEST_F(SwapTest, ErrorsBeforeAnyIo) {
  // A directory that does not exist.
  SwapOptions o = options(1);
  o.dirs = {root_.file("missing")};
  expect_io_error([&] { SwapStore s(*engine_, o); }, ENOENT, "swap directory");
  // More space than the file system has: nothing is created.
  o = options(1, int64_t(1) << 60);
  expect_io_error([&] { SwapStore s(*engine_, o); }, ENOSPC, "not enough free space");
  EXPECT_EQ(::rmdir(o.dirs[0].c_str()), 0) << "something was left in " << o.dirs[0];
  // Capacity exhausted by regions; a read of what was never written.
  SwapStore store(*engine_, options(1, 2 * kMiB));
  const RegionId a = store.add_region("a", kMiB + 1);
  expect_io_error([&] { store.add_region("b", kMiB); }, ENOSPC, "swap store full");
  expect_io_error([&] { store.read(a, buf_.data()); }, ENODATA, "never written");
  // Misuse is a bug: unaligned buffers and partial blocks.
  EXPECT_THROW(store.write(a, 0, kMiB, buf_.data() + 16), InternalError);
  EXPECT_THROW(store.write(a, 1000, kMiB, buf_.data()), InternalError);
}

TEST_F(SwapTest, UnwritableDirectory) {
  const SwapOptions o = options(1);
  ASSERT_EQ(::chmod(root_.path().c_str(), 0755), 0);  // traversable by the unprivileged user
  ASSERT_EQ(::chmod(o.dirs[0].c_str(), 0555), 0);
  std::string message;
  int err = 0;
  // Root ignores permission bits: drop to an unprivileged user on one thread
  // only (the raw system call, unlike setresuid(3), affects just the caller).
  std::thread([&] {
    if (geteuid() == 0 && syscall(SYS_setresuid, 65534, 65534, 0) != 0) return;
    try {
      SwapStore s(*engine_, o);
    } catch (const IoError& e) {
      message = e.what();
      err = e.err();
    }
  }).join();
  ::chmod(o.dirs[0].c_str(), 0755);
  EXPECT_EQ(err, EACCES) << message;
  EXPECT_NE(message.find("not writable"), std::string::npos) << message;
}

TEST_F(SwapTest, FailedWriteIsNeverReadBack) {
  auto plan = std::make_shared<FaultPlan>();
  plan->kind = FaultKind::kEio;
  plan->first_op = 2;
  plan->only_op = int(IoOp::kWrite);
  EngineOptions eo;
  eo.block_size_bytes = 256 * kKiB;
  eo.faults = plan;
  IoEngine engine(eo);
  SwapOptions o = options(1);
  o.checksums = false;  // even without checksums
  SwapStore store(engine, o);
  const RegionId id = store.add_region("g", kMiB);
  expect_io_error([&] { store.write(id, buf_.data()).wait(); }, EIO, "write failed");
  expect_io_error([&] { store.read(id, buf_.data()).wait(); }, ENODATA, "never written");
  // Written again successfully, it reads back.
  fill_random(buf_.data(), kMiB, 4);
  store.write(id, buf_.data()).wait();
  store.read(id, buf_.data() + 2 * kMiB).wait();
  EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 2 * kMiB, size_t(kMiB)), 0);
}

TEST_F(SwapTest, EnospcOnWriteIsReported) {
  auto plan = std::make_shared<FaultPlan>();
  plan->kind = FaultKind::kEnospc;
  plan->only_op = int(IoOp::kWrite);
  EngineOptions eo;
  eo.faults = plan;
  IoEngine engine(eo);
  SwapStore store(engine, options(1));
  const RegionId id = store.add_region("x", kMiB);
  expect_io_error([&] { store.write(id, buf_.data()).wait(); }, ENOSPC, "write failed");
}

}  // namespace
}  // namespace strata::nvme

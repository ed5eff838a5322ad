// Checkpoints in one process (the Trainer API): a save and a load continue
// training bit for bit, across placements; corrupted, truncated, missing or
// foreign checkpoints are refused naming the file; a failing save (ENOSPC)
// leaves the state and the previous checkpoint as they were; pruning keeps
// the newest. Process kills, ranks and resharding: checkpoint_cli_test.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "data/dataset.h"
#include "engine/trainer.h"
#include "model/model.h"
#include "nvme/fault_backend.h"
#include "deferred_device.h"
#include "test_util.h"
#include "training_session.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {
namespace {

using testing::TempDir;

nlohmann::json base_config(const std::string& data) {
  return {
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_accumulation_steps", 2},
      {"gradient_clipping", 0.5},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.1}}}}},
      {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 5}, {"warmup_max_lr", 3e-3}}}}},
      {"zero_optimization", {{"sub_group_size", 20000}}},
      {"model", {{"dim", 64}, {"n_layers", 2}, {"n_heads", 4}, {"n_kv_heads", 2}, {"ffn_hidden", 96},
                 {"seq_len", 32}}},
      {"data", {{"path", data}, {"val_fraction", 0.0}}},
      // The optimizer on its own thread also with state on NVMe (which "auto"
      // runs inline on the CPU device): saves must ride on it.
      {"run", {{"steps", 10}, {"seed", 11}, {"overlap_optimizer", true}}},
  };
}

using Session = testing::TrainingSession;

void expect_equal_state(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << ": tensor " << i;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = dir_.write("text.txt", testing::sample_text(20000));
    swap_ = dir_.file("swap");
    mkdir(swap_.c_str(), 0700);
  }
  std::string nvme_optimizer() const {
    return "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}";
  }
  // 6 steps straight against 3 + save + (a new trainer, `resume_overrides`) load + 3.
  // `deferred`: each trainer computes on its own test device whose memory host
  // code may not touch (tests/deferred_device.h), as a GPU's HBM.
  void expect_resume_is_exact(const std::vector<std::string>& overrides,
                              const std::vector<std::string>& resume_overrides, const std::string& what,
                              bool deferred = false) {
    testing::DeferredDevice d1, d2, d3;
    Session straight(base_config(data_), overrides, nullptr, deferred ? &d1 : nullptr);
    const std::vector<double> ref = straight.train(6);
    const std::vector<at::Tensor> ref_state = straight.state();
    const std::string ck = dir_.file("ck-" + std::to_string(++cases_));
    {
      Session first(base_config(data_), overrides, nullptr, deferred ? &d2 : nullptr);
      first.train(3);
      first.save(ck);
    }
    Session second(base_config(data_), resume_overrides, nullptr, deferred ? &d3 : nullptr);
    second.load(ck);
    EXPECT_EQ(second.trainer().steps_done(), 3);
    const std::vector<double> rest = second.train(3);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(rest[size_t(i)], ref[size_t(3 + i)]) << what << ": step " << 4 + i;
    expect_equal_state(second.state(), ref_state, what);
  }
  TempDir dir_;
  std::string data_, swap_;
  int cases_ = 0;
};

TEST_F(CheckpointTest, ResumeIsBitExactFp32) { expect_resume_is_exact({}, {}, "fp32"); }

TEST_F(CheckpointTest, ResumeIsBitExactBf16WithBf16Moments) {
  const std::vector<std::string> o = {"bf16={\"enabled\":true}", "run.optimizer_state_dtype=\"bf16\""};
  expect_resume_is_exact(o, o, "bf16, bf16 moments");
}

TEST_F(CheckpointTest, ResumeIsBitExactWithTheOptimizerOnNvme) {
  expect_resume_is_exact({nvme_optimizer()}, {nvme_optimizer()}, "optimizer on nvme");
  expect_resume_is_exact({nvme_optimizer(), "bf16={\"enabled\":true}"},
                         {nvme_optimizer(), "bf16={\"enabled\":true}"}, "bf16, optimizer on nvme");
}

// Device-resident state (HBM on a GPU: host code reaches it only through the
// device's copies) goes into the checkpoint and comes back, with fp16's loss
// scaler: from 2^16, doubling after every clean step, the scale overflows
// after the checkpoint (step 4 is skipped), so the resumed run continues
// exactly only if the scale and its counters came back.
TEST_F(CheckpointTest, ResumeOnADeviceHostCodeMayNotTouchIsBitExactWithFp16) {
  const std::string fp16 =
      "fp16={\"enabled\":true,\"initial_scale_power\":16,\"loss_scale_window\":1,\"hysteresis\":1}";
  expect_resume_is_exact({fp16}, {fp16}, "fp16, all on the device", /*deferred=*/true);
  const std::string split = "placement={\"param16\":{\"device\":0.5,\"host\":0.5},\"grad\":{\"device\":0.5,\"host\":0.5},"
                            "\"optimizer\":{\"device\":0.5,\"nvme\":0.5},\"nvme_path\":\"" + swap_ + "\"}";
  expect_resume_is_exact({fp16, split}, {fp16, split}, "fp16, split device/host/nvme", /*deferred=*/true);
}

TEST_F(CheckpointTest, ResumeWithOnlyThePlacementChangedIsBitExact) {
  expect_resume_is_exact({}, {nvme_optimizer()}, "device -> nvme");
  expect_resume_is_exact({nvme_optimizer()}, {"placement={\"param16\":{\"host\":1},\"master\":{\"host\":1}}"},
                         "nvme -> host");
}

// A save riding on training, slowed so that the next three steps overtake
// it: their optimizer passes must wait per piece, so the checkpoint holds
// exactly the state of the step it began after, and training is unchanged
// (with the state in RAM, written in place, and with the optimizer on NVMe).
TEST_F(CheckpointTest, SaveWhileTrainingHoldsTheStateOfItsStep) {
  for (const bool nvme : {false, true}) {
    const std::vector<std::string> overrides = nvme ? std::vector<std::string>{nvme_optimizer()}
                                                    : std::vector<std::string>{};
    const std::string what = nvme ? "optimizer on NVMe" : "state in RAM";
    Session straight(base_config(data_), overrides);
    straight.train(3);
    const std::vector<at::Tensor> at3 = straight.state();
    const std::vector<double> ref = straight.train(3);
    const std::string ck = dir_.file("ck-riding-" + std::to_string(nvme));
    Session s(base_config(data_), overrides);
    s.train(3);
    s.begin_save(ck, /*delay_ms=*/40);
    std::vector<double> rest;
    double waited = 0.0;  // the optimizer's waits for the save (StepResult::checkpoint_wait_s)
    for (int k = 0; k < 3; ++k) {
      const StepResult r = s.step();
      rest.push_back(r.loss);
      waited += r.checkpoint_wait_s;
    }
    const auto done = s.trainer().poll_checkpoint(true);
    ASSERT_TRUE(done.has_value());
    waited += s.step().checkpoint_wait_s;  // the last of those steps' optimizer ran after its result
    EXPECT_GT(waited, 0.0) << what << ": the save was not overtaken";
    EXPECT_EQ(done->step, 3);
    EXPECT_EQ(done->snapshot_bytes, 0) << what << ": no snapshot pool";
    EXPECT_EQ(rest, ref) << what;
    Session loaded(base_config(data_), overrides);
    loaded.load(ck);
    expect_equal_state(loaded.state(), at3, what);
  }
}

// The same with a snapshot pool (Note [Save snapshots]): the optimizer passes
// that overtake the save copy what they overwrite into the pool and the save
// writes it from there. With room for the whole save, ranges come from the
// pool; with room for about one range, some do and the rest are waited for;
// either way the checkpoint holds exactly the state of its step. With the
// state in RAM, the optimizer on NVMe (never copied: waited for), and on a
// device host code may not touch with state on all three tiers (the device's
// copies come D2H).
TEST_F(CheckpointTest, SaveWhileTrainingWithSnapshotsHoldsTheStateOfItsStep) {
  const std::string split = "placement={\"param16\":{\"device\":0.5,\"host\":0.5},\"grad\":{\"device\":0.5,"
                            "\"host\":0.5},\"optimizer\":{\"device\":0.5,\"nvme\":0.5},\"nvme_path\":\"" + swap_ + "\"}";
  struct Case {
    std::string what;
    std::vector<std::string> overrides;
    bool deferred;
    bool nvme_only;  // the saved state: nothing to copy
  };
  const std::vector<Case> cases = {{"state in RAM", {}, false, false},
                                   {"optimizer on NVMe", {nvme_optimizer()}, false, true},
                                   {"device, host and NVMe", {split}, true, false}};
  int n = 0;
  for (const Case& c : cases) {
    for (const double gb : {1.0, 0.00015}) {
      const std::string what = c.what + (gb >= 1 ? ", room for the whole save" : ", room for about a range");
      const std::string ck = dir_.file("ck-snapshots-" + std::to_string(++n));
      std::vector<std::string> overrides = c.overrides;
      overrides.push_back("run.checkpoint={\"dir\":\"" + ck + "\",\"every\":100}");
      overrides.push_back("run.checkpoint.snapshot_gb=" + std::to_string(gb));
      testing::DeferredDevice d1, d2, d3;
      // Losses and each step's bytes per link: a save's copies are not the step's traffic (the
      // step's bound is computed from it).
      double waited = 0.0;  // the optimizer's waits for the save (StepResult::checkpoint_wait_s)
      auto steps = [&](Session& session, std::vector<double>& losses, std::vector<LinkBytes>& links) {
        for (int k = 0; k < 3; ++k) {
          const StepResult r = session.step();
          losses.push_back(r.loss);
          links.push_back(r.links);
          waited += r.checkpoint_wait_s;
        }
      };
      Session straight(base_config(data_), overrides, nullptr, c.deferred ? &d1 : nullptr);
      straight.train(3);
      const std::vector<at::Tensor> at3 = straight.state();
      std::vector<double> ref, rest;
      std::vector<LinkBytes> ref_links, rest_links;
      steps(straight, ref, ref_links);
      Session s(base_config(data_), overrides, nullptr, c.deferred ? &d2 : nullptr);
      s.train(3);
      s.begin_save(ck, /*delay_ms=*/60);
      waited = 0.0;  // (the straight run's are 0)
      steps(s, rest, rest_links);
      for (size_t k = 0; k < 3; ++k) {
        EXPECT_EQ(rest_links[k].h2d, ref_links[k].h2d) << what << ": step " << k + 4;
        EXPECT_EQ(rest_links[k].d2h, ref_links[k].d2h) << what << ": step " << k + 4;
        EXPECT_EQ(rest_links[k].nvme_read, ref_links[k].nvme_read) << what << ": step " << k + 4;
        EXPECT_EQ(rest_links[k].nvme_write, ref_links[k].nvme_write) << what << ": step " << k + 4;
      }
      const auto done = s.trainer().poll_checkpoint(true);
      ASSERT_TRUE(done.has_value());
      waited += s.step().checkpoint_wait_s;  // the last of those steps' optimizer ran after its result
      EXPECT_EQ(done->step, 3);
      if (c.nvme_only) {
        EXPECT_EQ(done->snapshot_bytes, 0) << what;
        EXPECT_GT(waited, 0.0) << what << ": the save was not overtaken";
      } else {
        EXPECT_GT(done->snapshot_bytes, 0) << what;
      }
      if (gb < 1) {
        EXPECT_LE(done->snapshot_bytes, 151552) << what;  // 150,000 bytes in whole pages
        EXPECT_LT(done->snapshot_bytes, done->bytes) << what;
      }
      EXPECT_EQ(rest, ref) << what;
      Session loaded(base_config(data_), c.overrides, nullptr, c.deferred ? &d3 : nullptr);
      loaded.load(ck);
      expect_equal_state(loaded.state(), at3, what);
    }
  }
}

TEST_F(CheckpointTest, SavedDirectoryHasTheDocumentedShape) {
  Session s(base_config(data_), {});
  s.train(2);
  const std::string ck = dir_.file("ck");
  const std::string saved = s.save(ck);
  EXPECT_EQ(saved, ck + "/step-00000002");
  EXPECT_EQ(file_contents(ck + "/latest"), "step-00000002\n");
  EXPECT_EQ(list_dir(saved), (std::vector<std::string>{"manifest.json", "rank-00000.bin"}));
  // Private, like swap files.
  struct stat st;
  ASSERT_EQ(stat(saved.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat((saved + "/rank-00000.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // The manifest read independently: every saved category covers every
  // parameter once, and each range's bytes match its CRCs.
  const nlohmann::json m = nlohmann::json::parse(file_contents(saved + "/manifest.json"));
  EXPECT_EQ(m["format"], "strata-checkpoint");
  EXPECT_EQ(m["step"], 2);
  const int64_t n = m["parameters"];
  EXPECT_EQ(n, s.trainer().layout().parameter_count());
  const std::string bin = file_contents(saved + "/rank-00000.bin");
  std::map<std::string, int64_t> covered;
  for (const auto& r : m["ranges"]) {
    const int64_t bytes = int64_t(r["numel"]) * (m["dtypes"][r["category"].get<std::string>()] == "fp32" ? 4 : 2);
    const int64_t off = r["offset"];
    ASSERT_LE(off + bytes, int64_t(bin.size()));
    EXPECT_EQ(off % 4096, 0);
    covered[r["category"]] += int64_t(r["numel"]);
    ASSERT_EQ(r["crc32c"].size(), size_t((bytes + (1 << 20) - 1) >> 20));
  }
  EXPECT_EQ(covered, (std::map<std::string, int64_t>{{"master", n}, {"exp_avg", n}, {"exp_avg_sq", n}}));
  // The saved master weights are the trainer's, unpadded, at their global index.
  const at::Tensor master0 = s.trainer().master_block(0);
  for (const auto& r : m["ranges"]) {
    if (r["category"] != "master" || r["start"] != 0) continue;
    const float* saved_w = reinterpret_cast<const float*>(bin.data() + int64_t(r["offset"]));
    const int64_t k = std::min(r["numel"].get<int64_t>(), master0.numel());
    EXPECT_EQ(std::memcmp(saved_w, master0.data_ptr<float>(), size_t(k * 4)), 0);
  }
}

TEST_F(CheckpointTest, PruningKeepsTheNewestAndRemovesCrashedSaves) {
  Session s(base_config(data_), {});
  const std::string ck = dir_.file("ck");
  make_dirs(ck + "/step-00000001.tmp", 0700);  // a crashed save's leftover
  for (int i = 0; i < 4; ++i) {
    s.train(1);
    s.save(ck, nullptr, /*keep=*/2);
  }
  wait_for_checkpoint_pruning();
  EXPECT_EQ(list_dir(ck), (std::vector<std::string>{"latest", "step-00000003", "step-00000004"}));
  EXPECT_EQ(resolve_checkpoint(ck), ck + "/step-00000004");
}

TEST_F(CheckpointTest, EnospcDuringASaveLeavesStateAndThePreviousCheckpoint) {
  Session straight(base_config(data_), {nvme_optimizer()});
  const std::vector<double> ref = straight.train(4);

  Session s(base_config(data_), {nvme_optimizer()});
  s.train(2);
  const std::string ck = dir_.file("ck");
  s.save(ck);
  auto faults = std::make_shared<nvme::FaultPlan>();
  faults->kind = nvme::FaultKind::kEnospc;
  faults->only_op = int(nvme::IoOp::kWrite);
  faults->first_op = 2;
  try {
    s.save(ck, faults);
    FAIL() << "expected the save to fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(ck + "/step-00000002.tmp/rank-00000.bin"), std::string::npos) << e.what();
  }
  EXPECT_EQ(faults->injected.load(), 1);
  // Nothing half-written is left, latest still names the complete one.
  EXPECT_EQ(list_dir(ck), (std::vector<std::string>{"latest", "step-00000002"}));
  // Training goes on from an untouched state.
  const std::vector<double> rest = s.train(2);
  EXPECT_EQ(rest[0], ref[2]);
  EXPECT_EQ(rest[1], ref[3]);
  // And the previous checkpoint loads and resumes exactly.
  Session again(base_config(data_), {});
  again.load(ck);
  const std::vector<double> resumed = again.train(2);
  EXPECT_EQ(resumed[0], ref[2]);
  EXPECT_EQ(resumed[1], ref[3]);
}

// Each damage is refused before any step, naming the file.
class DamagedCheckpointTest : public CheckpointTest {
 protected:
  void SetUp() override {
    CheckpointTest::SetUp();
    Session s(base_config(data_), {});
    s.train(1);
    ck_ = s.save(dir_.file("ck"));
  }
  // Loading `ck_` into a fresh trainer fails with a message containing every one of `parts`.
  void expect_refused(const std::vector<std::string>& parts, const std::vector<std::string>& overrides = {}) {
    try {
      Session s(base_config(data_), overrides);
      s.load(ck_);
      FAIL() << "expected the load to fail";
    } catch (const InputError& e) {
      for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
  void edit_manifest(const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json m = nlohmann::json::parse(file_contents(ck_ + "/manifest.json"));
    edit(m);
    std::ofstream(ck_ + "/manifest.json") << m.dump();
  }
  std::string ck_;
};

TEST_F(DamagedCheckpointTest, CorruptedByteFailsItsChecksum) {
  const std::string bin = ck_ + "/rank-00000.bin";
  std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(5000);
  char c = 0;
  f.read(&c, 1);
  f.seekp(5000);
  c = char(c ^ 0x10);
  f.write(&c, 1);
  f.close();
  expect_refused({bin, "checksum mismatch in bytes 0..", "corrupted"});
}

TEST_F(DamagedCheckpointTest, TruncatedFileIsRefused) {
  const std::string bin = ck_ + "/rank-00000.bin";
  ASSERT_EQ(truncate(bin.c_str(), 4096), 0);
  expect_refused({bin, "truncated: 4096 bytes"});
}

TEST_F(DamagedCheckpointTest, MissingFileIsRefused) {
  remove_file(ck_ + "/rank-00000.bin");
  expect_refused({ck_ + "/rank-00000.bin", "missing"});
}

TEST_F(DamagedCheckpointTest, MissingOrGarbledManifestIsRefused) {
  std::ofstream(ck_ + "/manifest.json") << "{\"format\": \"strata-checkpoint\", \"version\": 1, ";
  expect_refused({ck_ + "/manifest.json", "not valid JSON"});
  remove_file(ck_ + "/manifest.json");
  try {
    resolve_checkpoint(ck_);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("no checkpoint to resume from"), std::string::npos) << e.what();
  }
}

TEST_F(DamagedCheckpointTest, PathEscapingTheDirectoryIsRefused) {
  edit_manifest([](nlohmann::json& m) {
    const std::string f = m["ranges"][0]["file"];
    m["files"]["../" + f] = m["files"][f];
    m["ranges"][0]["file"] = "../" + f;
  });
  expect_refused({ck_ + "/manifest.json", "'../rank-00000.bin' is not a plain file name"});
}

TEST_F(DamagedCheckpointTest, MissingRangeIsRefused) {
  edit_manifest([](nlohmann::json& m) { m["ranges"].erase(1); });
  expect_refused({ck_ + "/manifest.json", "manifest ranges", "missing"});
}

TEST_F(DamagedCheckpointTest, AnotherModelShapeIsRefused) {
  expect_refused({ck_ + "/manifest.json", "another model shape"}, {"model.ffn_hidden=128"});
}

// Note [Save snapshots] at the API level, made deterministic by a fill that
// holds range 3 (the save has begun it, not written it): a caller that must
// overwrite range 3 first copies the later ranges the save has not begun
// (4 and 5), while it still waits for 3; those homes may then change, and
// the file still holds every range as it was. With room for one range, the
// copy stops there and range 5 is waited for; likewise when range 5 is one
// snapshot_ok refuses (on NVMe).
TEST(CheckpointIoTest, SnapshotsLetTheOverwriterGoAheadOfTheSave) {
  for (const auto& [pool_ranges, refuse5] : {std::pair<int, bool>{6, false}, {1, false}, {6, true}}) {
    SCOPED_TRACE("pool of " + std::to_string(pool_ranges) + " range(s)" + (refuse5 ? ", range 5 refused" : ""));
    TempDir dir;
    constexpr int64_t kN = 4096;  // elements a range (fp32: 16 KiB)
    const std::map<Category, int> eb = {{Category::kMaster, 4}, {Category::kExpAvg, 4}, {Category::kExpAvgSq, 4}};
    std::vector<ShardRange> ranges;
    for (Category c : kSavedCategories) {
      for (int64_t half = 0; half < 2; ++half) {
        ShardRange r;
        r.category = c;
        r.start = half * kN;
        r.numel = kN;
        r.shard_offset = int64_t(ranges.size()) * kN;
        r.shard_numel = kN;
        ranges.push_back(r);
      }
    }
    HostBuffer home(size_t(6 * kN * 4), "test homes");
    float* h = home.as<float>();
    for (int64_t k = 0; k < 6 * kN; ++k) h[k] = float(k) * 0.5f;
    const std::vector<float> original(h, h + 6 * kN);
    HostBuffer pool(size_t(pool_ranges * kN * 4), "test snapshot pool");

    std::mutex mu;
    std::condition_variable cv;
    bool in_fill3 = false, release3 = false;
    std::vector<size_t> copied;
    RangeSource source;
    source.fill = [&](size_t i, int64_t at, int64_t numel, std::byte* buf) {
      if (i == 3) {
        std::unique_lock<std::mutex> lock(mu);
        in_fill3 = true;
        cv.notify_all();
        cv.wait(lock, [&] { return release3; });
      }
      std::memcpy(buf, h + ranges[i].shard_offset + at, size_t(numel * 4));
    };
    source.snapshot_ok = [&](size_t i) { return !(refuse5 && i == 5); };
    source.snapshot = [&](size_t i, std::byte* dst) {
      std::memcpy(dst, h + ranges[i].shard_offset, size_t(kN * 4));
      std::lock_guard<std::mutex> lock(mu);
      copied.push_back(i);
      cv.notify_all();
    };
    Manifest header;
    header.step = 1;
    header.parameters = 2 * kN;
    header.tensors = {{"w", {2 * kN}, 0}};
    header.elem_bytes = eb;
    CheckpointOptions opt;
    opt.dir = dir.file("ck");
    std::unique_ptr<Communicator> comm = make_local_communicator();
    CheckpointSave save(opt, *comm, header, ranges, source, {}, SnapshotPool{pool.as<std::byte>(), int64_t(pool.bytes())});
    // Whatever fails below, the save's thread is let go (else the test hangs instead of failing):
    // `release` goes before the future, which waits for the save.
    std::future<double> w3;
    struct Release {
      std::function<void()> f;
      ~Release() { f(); }
    } release{[&] {
      {
        std::lock_guard<std::mutex> lock(mu);
        release3 = true;
      }
      cv.notify_all();
    }};
    {
      std::unique_lock<std::mutex> lock(mu);
      ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return in_fill3; }));
    }
    auto overwrite = [&](size_t i) { std::fill(h + ranges[i].shard_offset, h + ranges[i].shard_offset + kN, -1.0f); };
    w3 = std::async(std::launch::async, [&] { return save.make_writable(3, 4); });
    const std::vector<size_t> ahead =
        pool_ranges >= 2 && !refuse5 ? std::vector<size_t>{4, 5} : std::vector<size_t>{4};
    {
      std::unique_lock<std::mutex> lock(mu);
      ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return copied.size() >= ahead.size(); }));
      EXPECT_EQ(copied, ahead);
    }
    // Still waiting for range 3, which the save holds.
    EXPECT_EQ(w3.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
    for (size_t i : ahead) overwrite(i);
    release.f();
    w3.get();
    for (size_t i = 0; i <= 3; ++i) overwrite(i);  // written
    save.make_writable(4, 6);  // taken, or (5, with a pool of one) waited for
    overwrite(4);
    overwrite(5);
    const std::string ck = save.finish();
    EXPECT_EQ(save.snapshot_bytes(), int64_t(ahead.size()) * kN * 4);
    EXPECT_EQ(copied, ahead);
    CheckpointReader reader(ck, opt.engine);
    std::vector<float> out(size_t(2 * kN));
    for (size_t c = 0; c < 3; ++c) {
      reader.read(kSavedCategories[c], 0, 2 * kN, reinterpret_cast<std::byte*>(out.data()));
      EXPECT_EQ(std::memcmp(out.data(), original.data() + c * 2 * kN, size_t(2 * kN * 4)), 0) << "category " << c;
    }
  }
}

// The write and read paths at the API level, with ranges larger than a
// staging slot: written from their homes in place (an aligned home) or
// staged piece by piece (a fill, or a home that is not 4 KiB aligned), with
// garbage in the shard padding after each range, and read back with targets
// that cross ranges and pieces. Every byte must come back, the padding in
// the file must be zero, and done() must come in order before later bytes.
TEST(CheckpointIoTest, LargeRangesRoundTripInPlaceAndStaged) {
  TempDir dir;
  constexpr int64_t kP = 5'000'003;  // parameters: not a multiple of 1024, ranges of > 1 slot
  const std::map<Category, int> eb = {{Category::kMaster, 4}, {Category::kExpAvg, 2}, {Category::kExpAvgSq, 2}};
  // Per category: the saved bytes (random), and homes with padding garbage.
  std::mt19937_64 rng(7);
  std::map<Category, std::vector<uint8_t>> saved;
  std::vector<ShardRange> ranges;
  int64_t shard_at = 0;
  for (Category c : kSavedCategories) {
    std::vector<uint8_t>& v = saved[c];
    v.resize(size_t(kP * eb.at(c)));
    for (uint8_t& x : v) x = uint8_t(rng());
    for (auto [start, numel] : {std::pair<int64_t, int64_t>{0, 3'000'000}, {3'000'000, kP - 3'000'000}}) {
      ShardRange r;
      r.category = c;
      r.start = start;
      r.numel = numel;
      r.shard_offset = shard_at;
      r.shard_numel = (numel + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems;
      shard_at += r.shard_numel;
      ranges.push_back(r);
    }
  }
  // The shard space (4 bytes per element covers every dtype), 0xAB in the padding.
  HostBuffer home(size_t(shard_at * 4 + 4096), "test homes");
  std::memset(home.data(), 0xAB, home.bytes());
  auto home_of = [&](const ShardRange& r) {
    // exp_avg_sq's homes are misaligned by 2 bytes: staged despite being resident.
    return home.as<std::byte>() + r.shard_offset * 4 + (r.category == Category::kExpAvgSq ? 2 : 0);
  };
  for (const ShardRange& r : ranges) {
    std::memcpy(home_of(r), saved[r.category].data() + r.start * eb.at(r.category), size_t(r.numel * eb.at(r.category)));
  }
  RangeSource source;
  int64_t filled = 0;
  source.resident = [&](size_t i) -> const std::byte* {
    return ranges[i].category == Category::kExpAvg ? nullptr : home_of(ranges[i]);
  };
  source.fill = [&](size_t i, int64_t at, int64_t numel, std::byte* buf) {
    const ShardRange& r = ranges[i];
    ASSERT_TRUE(numel % kShardAlignElems == 0 || at + numel == r.shard_numel);
    ASSERT_LE(at + numel, r.shard_numel);
    std::memcpy(buf, home_of(r) + at * eb.at(r.category), size_t(numel * eb.at(r.category)));
    filled += numel;
  };
  Manifest header;
  header.step = 1;
  header.parameters = kP;
  header.tensors = {{"w", {kP}, 0}};
  header.elem_bytes = eb;
  CheckpointOptions opt;
  opt.dir = dir.file("ck");
  opt.engine.block_size_bytes = int64_t(1) << 20;
  std::unique_ptr<Communicator> comm = make_local_communicator();
  const std::string ck = save_checkpoint(opt, *comm, header, ranges, source);
  // exp_avg went through fill; master was in place (exp_avg_sq: staged from its misaligned home).
  EXPECT_GE(filled, 2 * kP);

  // The padding after every range in the file is zero.
  CheckpointReader reader(ck, opt.engine);
  const std::string bin = file_contents(ck + "/rank-00000.bin");
  for (const SavedRange& r : reader.manifest().ranges) {
    const int64_t end = r.offset + r.numel * eb.at(r.category);
    for (int64_t b = end; b % 4096 != 0; ++b) ASSERT_EQ(bin[size_t(b)], 0) << "byte " << b;
  }
  // Whole categories, then a piece across the ranges' boundary, all into one buffer.
  std::vector<uint8_t> out(size_t(kP * 4));
  std::vector<CheckpointReader::Target> targets;
  for (Category c : kSavedCategories) targets.push_back({c, 0, kP, reinterpret_cast<std::byte*>(out.data())});
  targets.push_back({Category::kExpAvg, 2'999'000, 3'001, reinterpret_cast<std::byte*>(out.data())});
  std::vector<size_t> order;
  reader.read_all(targets, [&](size_t k) {
    order.push_back(k);
    const CheckpointReader::Target& t = targets[k];
    const int e = eb.at(t.category);
    EXPECT_EQ(std::memcmp(out.data(), saved[t.category].data() + t.start * e, size_t(t.numel * e)), 0)
        << "target " << k;
  });
  EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2, 3}));
  // A flipped byte in the third MiB of a range is found, naming its MiB.
  const SavedRange& r = reader.manifest().ranges[0];
  {
    std::fstream f(ck + "/rank-00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    const int64_t at = r.offset + (int64_t(2) << 20) + 123;
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    f.seekp(at);
    c = char(c ^ 1);
    f.write(&c, 1);
  }
  CheckpointReader damaged(ck, opt.engine);
  try {
    damaged.read(r.category, r.start, r.numel, reinterpret_cast<std::byte*>(out.data()));
    FAIL() << "expected a checksum mismatch";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(strprintf("bytes %lld..", (long long)(r.offset + (int64_t(2) << 20)))),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace strata

// Tests of data/: both token file formats, determinism from the seed, errors.
#include "data/dataset.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>

#include "test_util.h"
#include "util/fs.h"
#include "util/errors.h"

namespace strata {
namespace {

using testing::TempDir;

std::string le_bytes(const std::vector<uint32_t>& tokens, int width) {
  std::string out;
  for (uint32_t t : tokens)
    for (int b = 0; b < width; ++b) out.push_back(char((t >> (8 * b)) & 0xff));
  return out;
}

// An example file as tools/tokenize.py writes it (docs/token-format.md,
// "Examples and loss masks"): uint16 ids, a mask byte a token, the index's
// uint64 offsets. Example e has lengths[e] tokens, ids 1000 x e + position
// (so a token says which example and place it is), its first `prompt`
// tokens not counted.
struct ExampleFiles {
  DataConfig cfg;
  std::vector<int64_t> lengths;
};

ExampleFiles write_examples(const TempDir& dir, const std::string& name, const std::vector<int64_t>& lengths,
                            int64_t prompt, DataSampling sampling) {
  std::vector<uint32_t> ids;
  std::string mask, index = le_bytes({0, 0}, 4);
  for (size_t e = 0; e < lengths.size(); ++e) {
    for (int64_t t = 0; t < lengths[e]; ++t) {
      ids.push_back(uint32_t(1000 * (e + 1) + t));
      mask.push_back(t < prompt ? 0 : 1);
    }
    const uint64_t end = ids.size();
    index += le_bytes({uint32_t(end), uint32_t(end >> 32)}, 4);
  }
  ExampleFiles f;
  f.cfg.paths = {dir.write(name, le_bytes(ids, 2))};
  f.cfg.format = DataFormat::kUint16;
  f.cfg.mask_paths = {dir.write(name + ".mask", mask)};
  f.cfg.index_paths = {dir.write(name + ".idx", index)};
  f.cfg.sampling = sampling;
  f.cfg.val_fraction = 0.0;
  f.lengths = lengths;
  return f;
}

int64_t example_of(int64_t token) { return (token & kTokenIdMask) / 1000 - 1; }
int64_t place_of(int64_t token) { return (token & kTokenIdMask) % 1000; }

// Windows over a masked file: a token's flag is its mask byte's negation.
TEST(DataTest, MasksFlagTheTargetsTheyDoNotCount) {
  TempDir dir;
  ExampleFiles f = write_examples(dir, "m.bin", {9, 14, 6, 20, 11}, 3, DataSampling::kWindows);
  TokenDataset ds(f.cfg, 30000, 8);
  EXPECT_TRUE(ds.masked());
  std::vector<int64_t> w(20 * 9);
  std::mt19937_64 rng(3);
  ds.sample_train(rng, 20, w.data());
  int64_t flagged = 0;
  for (int64_t t : w) {
    EXPECT_EQ((t & kNotCounted) != 0, place_of(t) < 3) << t;
    flagged += (t & kNotCounted) != 0;
  }
  EXPECT_GT(flagged, 0);
  EXPECT_LT(flagged, int64_t(w.size()));
}

// data.sampling examples: each sequence is one example from its first token,
// padded with id 0 never counted; its first token never counted; each
// example once per epoch, in an order that is the seed's and the epoch's.
TEST(DataTest, ExamplesAreEachDrawnOncePerEpochFromTheirFirstTokenAndPadded) {
  TempDir dir;
  const std::vector<int64_t> lengths = {5, 9, 3, 12, 7, 8, 4, 11, 6, 10};
  ExampleFiles f = write_examples(dir, "e.bin", lengths, 2, DataSampling::kExamples);
  const int64_t T = 11, W = T + 1;
  TokenDataset ds(f.cfg, 30000, T);
  ASSERT_EQ(ds.num_examples(), 10);
  auto epoch_of = [&](ExampleCursor& cur, uint64_t seed) {
    std::vector<int64_t> order, w(static_cast<size_t>(W));
    for (int i = 0; i < 10; ++i) {
      EXPECT_EQ(ds.sample_examples(cur, seed, 1, w.data()), 0);
      const int64_t e = example_of(w[0]);
      order.push_back(e);
      for (int64_t t = 0; t < W; ++t) {
        if (t < lengths[size_t(e)]) {
          EXPECT_EQ(example_of(w[size_t(t)]), e);
          EXPECT_EQ(place_of(w[size_t(t)]), t);
          EXPECT_EQ((w[size_t(t)] & kNotCounted) != 0, t < 2) << "example " << e << " token " << t;
        } else {
          EXPECT_EQ(w[size_t(t)], kNotCounted) << "padding of example " << e;
        }
      }
    }
    return order;
  };
  ExampleCursor a, b, c;
  const std::vector<int64_t> first = epoch_of(a, 7), second = epoch_of(a, 7);
  EXPECT_EQ(std::set<int64_t>(first.begin(), first.end()).size(), 10u);
  EXPECT_EQ(std::set<int64_t>(second.begin(), second.end()).size(), 10u);
  EXPECT_NE(first, second) << "the second epoch repeats the first's order";
  EXPECT_EQ(a.epoch, 1);
  EXPECT_EQ(epoch_of(b, 7), first);
  EXPECT_NE(epoch_of(c, 8), first) << "another seed, the same order";
}

// data.sampling packed: whole examples back to back, as many as fit, the
// rest padded; none split, each once per epoch.
TEST(DataTest, PackedSequencesHoldWholeExamples) {
  TempDir dir;
  const std::vector<int64_t> lengths = {5, 9, 3, 12, 7, 8, 4, 11, 6, 10};
  ExampleFiles f = write_examples(dir, "p.bin", lengths, 1, DataSampling::kPacked);
  const int64_t T = 15, W = T + 1;
  TokenDataset ds(f.cfg, 30000, T);
  ExampleCursor cur;
  std::map<int64_t, int> seen;
  int64_t sequences = 0, multi = 0;
  while (cur.epoch == 0 && seen.size() < 10) {
    std::vector<int64_t> w(static_cast<size_t>(W));
    ds.sample_examples(cur, 5, 1, w.data());
    ++sequences;
    int64_t at = 0, here = 0;
    while (at < W && w[size_t(at)] != kNotCounted) {
      const int64_t e = example_of(w[size_t(at)]);
      ASSERT_GE(e, 0);
      ASSERT_LE(at + lengths[size_t(e)], W) << "example " << e << " split";
      for (int64_t t = 0; t < lengths[size_t(e)]; ++t) {
        EXPECT_EQ(example_of(w[size_t(at + t)]), e);
        EXPECT_EQ(place_of(w[size_t(at + t)]), t);
        EXPECT_EQ((w[size_t(at + t)] & kNotCounted) != 0, t < 1);
      }
      ++seen[e];
      ++here;
      at += lengths[size_t(e)];
    }
    for (; at < W; ++at) EXPECT_EQ(w[size_t(at)], kNotCounted);
    multi += here > 1;
  }
  EXPECT_EQ(seen.size(), 10u);
  for (const auto& [e, n] : seen) EXPECT_EQ(n, 1) << "example " << e;
  EXPECT_LT(sequences, 10) << "nothing was packed";
  EXPECT_GT(multi, 0);
}

// A checkpoint keeps (epoch, next): the draws from a cursor rebuilt from
// those two alone are the uninterrupted run's.
TEST(DataTest, ExamplesResumeMidEpoch) {
  TempDir dir;
  ExampleFiles f = write_examples(dir, "r.bin", {5, 9, 3, 12, 7, 8, 4, 11, 6, 10, 3, 5, 7}, 1, DataSampling::kPacked);
  const int64_t W = 16;
  TokenDataset ds(f.cfg, 30000, W - 1);
  ExampleCursor run;
  std::vector<int64_t> w(size_t(3 * W)), again(size_t(3 * W));
  ds.sample_examples(run, 9, 3, w.data());
  ExampleCursor resumed;
  resumed.epoch = run.epoch;
  resumed.next = run.next;
  for (int step = 0; step < 6; ++step) {  // across the epoch's end
    ds.sample_examples(run, 9, 3, w.data());
    ds.sample_examples(resumed, 9, 3, again.data());
    EXPECT_EQ(w, again) << "step " << step;
  }
  EXPECT_GE(run.epoch, 1);
}

// Bad files: one InputError naming the file and the offset (or the example).
TEST(DataTest, BadMasksIndexesAndLongExamplesNameFileAndOffset) {
  TempDir dir;
  auto expect_error = [](const DataConfig& c, int64_t T, const std::string& a, const std::string& b) {
    try {
      TokenDataset ds(c, 30000, T);
      ADD_FAILURE() << "no error; expected " << a << " ... " << b;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(a), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(b), std::string::npos) << e.what();
    }
  };
  ExampleFiles f = write_examples(dir, "b.bin", {5, 9, 3, 12}, 1, DataSampling::kExamples);
  std::string mask = file_contents(f.cfg.mask_paths[0]);
  mask[7] = 2;
  DataConfig c = f.cfg;
  c.mask_paths = {dir.write("bad.mask", mask)};
  expect_error(c, 15, "bad.mask", "offset 7");
  c.mask_paths = {dir.write("short.mask", mask.substr(0, 20))};
  expect_error(c, 15, "short.mask", "offset 20");
  c = f.cfg;
  std::string index = file_contents(f.cfg.index_paths[0]);
  index[16] = 100;  // the third offset (bytes 16-23): past the file's 29 tokens
  c.index_paths = {dir.write("bad.idx", index)};
  expect_error(c, 15, "bad.idx", "byte 16");
  // 12 tokens, a window of 11: refused unless data.truncate; then cut, counted.
  expect_error(f.cfg, 10, "b.bin", "example 3");
  c = f.cfg;
  c.truncate = true;
  TokenDataset ds(c, 30000, 10);
  ExampleCursor cur;
  std::vector<int64_t> w(4 * 11);
  EXPECT_EQ(ds.sample_examples(cur, 1, 4, w.data()), 1);
  // Examples modes need an index: the config refuses it naming data.sampling
  // (config_test); the dataset's own check is an invariant.
}

TEST(DataTest, TextIsBytesAndFilesConcatenate) {
  TempDir dir;
  const std::string a = dir.write("a.txt", "hello ");
  const std::string b = dir.write("b.txt", "world\xff");
  TokenDataset ds({a, b}, TokenFormat::kText, 256, 4, 0.0);
  ASSERT_EQ(ds.num_tokens(), 12);
  const std::string expect = "hello world\xff";
  for (size_t i = 0; i < expect.size(); ++i) EXPECT_EQ(ds.token(int64_t(i)), uint32_t(uint8_t(expect[i])));
  EXPECT_EQ(ds.val_tokens(), 0);
}

TEST(DataTest, Uint16AndUint32AreLittleEndian) {
  TempDir dir;
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 100; ++i) toks.push_back((i * 7919u) % 50000u);
  TokenDataset d16({dir.write("t16.bin", le_bytes(toks, 2))}, TokenFormat::kUint16, 50000, 8, 0.0);
  TokenDataset d32({dir.write("t32.bin", le_bytes(toks, 4))}, TokenFormat::kUint32, 50000, 8, 0.0);
  for (size_t i = 0; i < toks.size(); ++i) {
    EXPECT_EQ(d16.token(int64_t(i)), toks[i]) << i;
    EXPECT_EQ(d32.token(int64_t(i)), toks[i]) << i;
  }
}

TEST(DataTest, WindowsAreDeterministicFromTheSeedAndComeFromTheRightSplit) {
  TempDir dir;
  std::vector<uint32_t> toks(1000);
  for (uint32_t i = 0; i < 1000; ++i) toks[i] = i;  // token == position
  TokenDataset ds({dir.write("t.bin", le_bytes(toks, 4))}, TokenFormat::kUint32, 1000, 16, 0.2);
  EXPECT_EQ(ds.train_tokens(), 800);
  std::vector<int64_t> a(4 * 17), b(4 * 17), c(4 * 17);
  std::mt19937_64 r1(7), r2(7), r3(8);
  ds.sample_train(r1, 4, a.data());
  ds.sample_train(r2, 4, b.data());
  ds.sample_train(r3, 4, c.data());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  for (int w = 0; w < 4; ++w) {
    for (int t = 1; t < 17; ++t) EXPECT_EQ(a[w * 17 + t], a[w * 17 + t - 1] + 1);  // contiguous
    EXPECT_LE(a[w * 17 + 16], 799);  // whole window inside the training part
  }
  std::vector<int64_t> v(4 * 17);
  ds.sample_val(r1, 4, v.data());
  for (int64_t x : v) EXPECT_GE(x, 800);
}

TEST(DataTest, FileShorterThanOneSequenceIsAnErrorNamingTheFile) {
  TempDir dir;
  const std::string p = dir.write("short.txt", "tiny");
  try {
    TokenDataset ds({p}, TokenFormat::kText, 256, 8, 0.0);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(e.path(), p);
    EXPECT_NE(std::string(e.what()).find("fewer than one sequence"), std::string::npos) << e.what();
  }
}

TEST(DataTest, HeldOutPartShorterThanASequenceIsAnError) {
  TempDir dir;
  const std::string p = dir.write("t.txt", std::string(100, 'a'));
  EXPECT_THROW(TokenDataset({p}, TokenFormat::kText, 256, 16, 0.1), InputError);  // 10 held out < 17
  EXPECT_NO_THROW(TokenDataset({p}, TokenFormat::kText, 256, 16, 0.2));
}

TEST(DataTest, MissingFileOddSizeAndOutOfVocabularyTokensNameFileAndOffset) {
  TempDir dir;
  try {
    TokenDataset ds({dir.file("nope.bin")}, TokenFormat::kUint16, 100, 4, 0.0);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("nope.bin"), std::string::npos);
  }
  const std::string odd = dir.write("odd.bin", std::string(21, '\0'));
  try {
    TokenDataset ds({odd}, TokenFormat::kUint16, 100, 4, 0.0);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("offset 20"), std::string::npos) << e.what();
  }
  std::vector<uint32_t> toks(20, 5);
  toks[13] = 100;  // == vocab_size
  const std::string bad = dir.write("bad.bin", le_bytes(toks, 2));
  try {
    TokenDataset ds({bad}, TokenFormat::kUint16, 100, 4, 0.0);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("byte offset 26"), std::string::npos) << e.what();
  }
}

// Windows across the boundary of two files read both, in order.
TEST(DataTest, WindowsCrossFileBoundaries) {
  TempDir dir;
  std::vector<uint32_t> a(30), b(7), c(40);
  uint32_t next = 0;
  for (auto* v : {&a, &b, &c}) for (uint32_t& t : *v) t = next++;  // token == position
  TokenDataset ds({dir.write("a.bin", le_bytes(a, 2)), dir.write("b.bin", le_bytes(b, 2)),
                   dir.write("c.bin", le_bytes(c, 2))},
                  TokenFormat::kUint16, 1000, 15, 0.0);
  ASSERT_EQ(ds.num_tokens(), 77);
  std::mt19937_64 rng(1);
  std::vector<int64_t> w(64 * 16);
  ds.sample_train(rng, 64, w.data());
  for (int k = 0; k < 64; ++k) {
    for (int t = 1; t < 16; ++t) ASSERT_EQ(w[size_t(k * 16 + t)], w[size_t(k * 16 + t - 1)] + 1) << k;
  }
}

// Note [Mapped tokens]: a rank's anonymous memory does not grow with the
// corpus (the tokens are mapped, validated in one pass, widened per window).
int64_t rss_anon_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8));
  }
  return -1;
}

TEST(DataTest, AnonymousMemoryDoesNotGrowWithTheCorpus) {
  if (rss_anon_kib() < 0) GTEST_SKIP() << "no RssAnon in /proc/self/status";
  TempDir dir;
  std::vector<int64_t> growth;
  for (const int64_t bytes : {int64_t(4) << 20, int64_t(64) << 20}) {
    const std::string path = dir.file("corpus-" + std::to_string(bytes) + ".bin");
    {
      std::ofstream f(path, std::ios::binary);
      ASSERT_TRUE(f.good());
    }
    ASSERT_EQ(::truncate(path.c_str(), bytes), 0);  // zeros: token 0, valid; 32M tokens for the large one
    const int64_t before = rss_anon_kib();
    TokenDataset ds({path}, TokenFormat::kUint16, 50000, 128, 0.1);
    std::mt19937_64 rng(3);
    std::vector<int64_t> batch(8 * 129);
    for (int i = 0; i < 100; ++i) ds.sample_train(rng, 8, batch.data());
    growth.push_back(rss_anon_kib() - before);
  }
  // 64 MiB of uint16 held widened would be 128 MiB of anonymous memory.
  EXPECT_LT(growth[1], 8 * 1024) << "KiB of RssAnon for 64 MiB of tokens; " << growth[0] << " for 4 MiB";
  EXPECT_LT(growth[1] - growth[0], 4 * 1024);
}

}  // namespace
}  // namespace strata

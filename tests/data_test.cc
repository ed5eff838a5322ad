// Tests of data/: both token file formats, determinism from the seed, errors.
#include "data/dataset.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <fstream>
#include <random>
#include <string>

#include "test_util.h"
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

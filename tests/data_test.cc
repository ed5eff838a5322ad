// Tests of data/: both token file formats, determinism from the seed, errors.
#include "data/dataset.h"

#include <gtest/gtest.h>

#include <random>

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
  for (size_t i = 0; i < expect.size(); ++i) EXPECT_EQ(ds.tokens()[i], uint32_t(uint8_t(expect[i])));
  EXPECT_EQ(ds.val_tokens(), 0);
}

TEST(DataTest, Uint16AndUint32AreLittleEndian) {
  TempDir dir;
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 100; ++i) toks.push_back((i * 7919u) % 50000u);
  TokenDataset d16({dir.write("t16.bin", le_bytes(toks, 2))}, TokenFormat::kUint16, 50000, 8, 0.0);
  TokenDataset d32({dir.write("t32.bin", le_bytes(toks, 4))}, TokenFormat::kUint32, 50000, 8, 0.0);
  EXPECT_EQ(d16.tokens(), toks);
  EXPECT_EQ(d32.tokens(), toks);
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

TEST(DataTest, UnknownFormatNamesTheKey) {
  try {
    parse_token_format("utf8");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "data.format");
  }
}

}  // namespace
}  // namespace strata

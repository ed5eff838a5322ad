// tools/tokenize.py: text files, JSON lines and directories of them become a
// token file equal to what a plain loop over the `tokenizers` package writes
// (EOS after every document), with a sidecar that `strata train` checks; bad
// input is one line and leaves nothing behind. The tokenizer is a small BPE
// trained in the test (tests/hf_tokenizer.py).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <fstream>
#include <random>

#include "config/config.h"
#include "test_util.h"
#include "util/errors.h"
#include "util/fs.h"

namespace strata {
namespace {

using testing::Result;
using testing::sh;
using testing::TempDir;

const std::string kPython = std::string(STRATA_SOURCE_DIR) + "/.venv/bin/python";
const std::string kTool = kPython + " " + std::string(STRATA_SOURCE_DIR) + "/tools/tokenize.py";
const std::string kHelper = kPython + " " + std::string(STRATA_SOURCE_DIR) + "/tests/hf_tokenizer.py";
const std::string kStrata = std::string(STRATA_BINARY_DIR) + "/strata";

// Lines of words, one newline between lines (no blank lines, so a text file
// cut at line ends tokenizes as it does whole).
std::string words(size_t lines, uint64_t seed) {
  static const char* w[] = {"the", "model", "trains", "on", "tokens", "from", "text", "and",
                            "memory", "offload", "state", "gpu", "déjà", "naïve", "42", "x=y;"};
  std::mt19937_64 rng(seed);
  std::string s;
  for (size_t l = 0; l < lines; ++l) {
    for (int i = 0; i < 12; ++i) s += std::string(i ? " " : "") + w[rng() % 16];
    s += "\n";
  }
  return s;
}

class TokenizeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (sh(kPython + " -c 'import tokenizers'").code != 0) {
      if (testing::under_ci()) FAIL() << "no tokenizers in .venv under CI";
      GTEST_SKIP() << "no tokenizers in .venv (tools/setup.sh installs it)";
    }
    const std::string corpus = dir_.write("train.txt", words(2000, 1));
    tok_ = dir_.file("tok");
    Result r = sh(kHelper + " train " + tok_ + " 300 " + corpus);
    ASSERT_EQ(r.code, 0) << r.output;
    ASSERT_NE(r.output.find("vocab 300"), std::string::npos) << r.output;
  }
  nlohmann::json config(const std::string& data, int64_t vocab) const {
    return {{"train_micro_batch_size_per_gpu", 2},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
            {"model", {{"dim", 32}, {"n_layers", 1}, {"n_heads", 2}, {"seq_len", 16}, {"vocab_size", vocab}}},
            {"data", {{"path", data}}},
            {"run", {{"steps", 2}, {"threads", 1}}}};
  }
  TempDir dir_;
  std::string tok_;
};

TEST_F(TokenizeTest, TokenFileIsThePackagesEncodingWithEosAfterEveryDocument) {
  const std::string in = dir_.file("in");
  make_dirs(in + "/sub");
  dir_.write("in/a.txt", words(300, 2));
  std::string jl;
  for (int i = 0; i < 40; ++i) jl += nlohmann::json({{"id", i}, {"text", words(2, 10 + i)}}).dump() + "\n\n";
  dir_.write("in/sub/b.jsonl", jl);
  dir_.write("in/.hidden", "skipped");
  Result r = sh(kTool + " --tokenizer " + tok_ + " --out " + dir_.file("out.bin") + " " + in);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("documents"), std::string::npos) << "a progress line: " << r.output;
  // The same documents in the same order (directories walked sorted),
  // encoded one by one by the package itself.
  const std::string want = dir_.file("want.bin");
  Result e = sh(kHelper + " expect " + tok_ + "/tokenizer.json 0 " + want + " " + in + "/a.txt " + in + "/sub/b.jsonl");
  ASSERT_EQ(e.code, 0) << e.output;
  const std::string got = file_contents(dir_.file("out.bin")), expected = file_contents(want);
  EXPECT_GT(expected.size(), 2000u);
  EXPECT_TRUE(got == expected) << got.size() << " vs " << expected.size() << " bytes";
  const nlohmann::json side = nlohmann::json::parse(file_contents(dir_.file("out.bin.json")));
  EXPECT_EQ(side["format"], "strata-tokens");
  EXPECT_EQ(side["dtype"], "uint16");
  EXPECT_EQ(side["vocab_size"], 300);
  EXPECT_EQ(side["tokens"], int64_t(got.size() / 2));
  EXPECT_EQ(side["documents"], 41);
  EXPECT_EQ(side["eos_id"], 0);
  // uint32 on request: the same ids, twice the width.
  Result r32 = sh(kTool + " --tokenizer " + tok_ + "/tokenizer.json --dtype uint32 --out " + dir_.file("out32.bin") +
                  " " + in + " --no-progress");
  ASSERT_EQ(r32.code, 0) << r32.output;
  const std::string got32 = file_contents(dir_.file("out32.bin"));
  ASSERT_EQ(got32.size(), 2 * got.size());
  bool same = true;
  for (size_t i = 0; i < got.size() / 2; ++i) {
    same = same && got32[4 * i] == got[2 * i] && got32[4 * i + 1] == got[2 * i + 1] && got32[4 * i + 2] == 0 &&
           got32[4 * i + 3] == 0;
  }
  EXPECT_TRUE(same);
}

// Parquet, as Hugging Face datasets ship it: the --field column, row by
// row, gives the token file the same rows as JSON lines give (read in
// several row groups); a missing column, a column that is not text and a
// null row are one line naming the file (and row), exit 2, nothing written.
TEST_F(TokenizeTest, ParquetRowsAreDocumentsLikeJsonLines) {
  if (sh(kPython + " -c 'import pyarrow'").code != 0) {
    if (testing::under_ci()) FAIL() << "no pyarrow in .venv under CI";
    GTEST_SKIP() << "no pyarrow in .venv (tools/setup.sh installs it)";
  }
  std::string jl;
  for (int i = 0; i < 300; ++i) jl += nlohmann::json({{"id", i}, {"text", words(1 + i % 3, 50 + i)}}).dump() + "\n";
  const std::string jsonl = dir_.write("rows.jsonl", jl), parquet = dir_.file("rows.parquet");
  Result w = sh(kHelper + " parquet " + jsonl + " " + parquet + " 64");
  ASSERT_EQ(w.code, 0) << w.output;
  ASSERT_NE(w.output.find("parquet 5 row groups"), std::string::npos) << w.output;
  Result a = sh(kTool + " --tokenizer " + tok_ + " --no-progress --out " + dir_.file("jl.bin") + " " + jsonl);
  ASSERT_EQ(a.code, 0) << a.output;
  Result b = sh(kTool + " --tokenizer " + tok_ + " --no-progress --out " + dir_.file("pq.bin") + " " + parquet);
  ASSERT_EQ(b.code, 0) << b.output;
  const std::string want = file_contents(dir_.file("jl.bin")), got = file_contents(dir_.file("pq.bin"));
  EXPECT_GT(want.size(), 3000u);
  EXPECT_TRUE(got == want) << got.size() << " vs " << want.size() << " bytes";
  EXPECT_EQ(nlohmann::json::parse(file_contents(dir_.file("pq.bin.json")))["documents"], 300);
  auto refused = [&](const std::string& args, const std::string& input, const std::string& says) {
    Result r = sh(kTool + " --tokenizer " + tok_ + " --no-progress --out " + dir_.file("bad.bin") + " " + args + " " +
                  input);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(input + ": " + says), std::string::npos) << r.output;
    EXPECT_FALSE(std::ifstream(dir_.file("bad.bin")).good()) << args;
    EXPECT_FALSE(std::ifstream(dir_.file("bad.bin.json")).good()) << args;
  };
  refused("--field body", parquet, "no column 'body' (--field); columns: id, text");
  refused("--field id", parquet, "column 'id' is int64, not a string column");
  const std::string with_null = dir_.file("null.parquet");
  ASSERT_EQ(sh(kHelper + " parquet " + jsonl + " " + with_null + " 64 null").code, 0);
  refused("", with_null, "row 2: 'text' is null");
}

// A text file larger than a piece is encoded in pieces cut at line ends:
// nothing lost or repeated, and with no blank lines the same ids as whole.
TEST_F(TokenizeTest, LargeTextFilesAreEncodedInPiecesWithTheSameIds) {
  dir_.write("big.txt", words(40000, 3));  // ~2.9 MB
  Result r = sh(kTool + " --tokenizer " + tok_ + " --piece-mb 1 --no-progress --out " + dir_.file("big.bin") + " " +
                dir_.file("big.txt"));
  ASSERT_EQ(r.code, 0) << r.output;
  Result e = sh(kHelper + " expect " + tok_ + "/tokenizer.json 0 " + dir_.file("want.bin") + " " + dir_.file("big.txt"));
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_TRUE(file_contents(dir_.file("big.bin")) == file_contents(dir_.file("want.bin")));
}

TEST_F(TokenizeTest, BadInputIsOneLineAndLeavesNothing) {
  dir_.write("a.txt", words(10, 4));
  const std::string out = dir_.file("out.bin");
  // A directory without tokenizer.json.
  Result r = sh(kTool + " --tokenizer " + dir_.path() + " --out " + out + " " + dir_.file("a.txt"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(dir_.path() + ": no tokenizer.json"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  // A JSON line without the field, after good ones: named by file and line.
  dir_.write("c.jsonl", "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n");
  r = sh(kTool + " --tokenizer " + tok_ + " --out " + out + " " + dir_.file("a.txt") + " " + dir_.file("c.jsonl"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(dir_.file("c.jsonl") + ":2: no string field 'text'"), std::string::npos) << r.output;
  r = sh(kTool + " --tokenizer " + tok_ + " --out " + out + " " + dir_.file("missing.txt"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("missing.txt: does not exist"), std::string::npos) << r.output;
  r = sh(kTool + " --tokenizer " + tok_ + " --eos-token '<eos>' --out " + out + " " + dir_.file("a.txt"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("the tokenizer has no token '<eos>'"), std::string::npos) << r.output;
  for (const std::string& f : list_dir(dir_.path())) {
    EXPECT_EQ(f.rfind("out.bin", 0), std::string::npos) << "left behind: " << f;
  }
}

// The sidecar as strata train reads it: data.format from its dtype, the
// tokenizer's vocabulary against model.vocab_size, tokens against the size.
TEST_F(TokenizeTest, StrataChecksTheSidecar) {
  dir_.write("a.txt", words(400, 5));
  const std::string data = dir_.file("a.bin");
  Result r = sh(kTool + " --tokenizer " + tok_ + " --no-progress --out " + data + " " + dir_.file("a.txt"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_STREQ(data_format_name(parse_config(config(data, 300)).data.format), "uint16");  // not the default, text
  try {
    parse_config(config(data, 256));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.vocab_size: 256 is smaller than the vocabulary of the tokenizer "
                                         "that wrote " + data + " (300, in " + data + ".json)"),
              std::string::npos)
        << e.what();
  }
  nlohmann::json j = config(data, 300);
  j["data"]["format"] = "uint32";
  try {
    parse_config(j);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("data.format: \"uint32\" here, but " + data + ".json says the file is uint16"),
              std::string::npos)
        << e.what();
  }
  // The same through strata train: one line, exit 2.
  const std::string cfg = dir_.write("job.json", config(data, 256).dump());
  r = sh(kStrata + " train " + cfg);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.vocab_size: 256 is smaller"), std::string::npos) << r.output;
  // A sidecar that does not match the file's size.
  nlohmann::json side = nlohmann::json::parse(file_contents(data + ".json"));
  side["tokens"] = side["tokens"].get<int64_t>() + 1;
  std::ofstream(data + ".json") << side.dump();
  try {
    parse_config(config(data, 300));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(data + ".json: says " + std::to_string(side["tokens"].get<int64_t>())),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("but " + data + " has"), std::string::npos) << e.what();
  }
}

// README's "Fine-tune a model you have", run as written: its bash block,
// taken from the README itself, in a directory where my-model is a tiny
// Llama with a BPE tokenizer and my-texts a tree of text and JSON lines.
TEST(FineTuneWalkthrough, ReadmeCommandsRunAsWritten) {
  if (sh(kPython + " -c 'import tokenizers, transformers'").code != 0) {
    if (testing::under_ci()) FAIL() << "no tokenizers/transformers in .venv under CI";
    GTEST_SKIP() << "no tokenizers/transformers in .venv (tools/setup.sh installs them)";
  }
  const std::string readme = file_contents(std::string(STRATA_SOURCE_DIR) + "/README.md");
  const size_t marker = readme.find("<!-- fine-tune walk-through");
  ASSERT_NE(marker, std::string::npos);
  const size_t begin = readme.find("```bash\n", marker);
  ASSERT_NE(begin, std::string::npos);
  const size_t end = readme.find("\n```\n", begin + 8);
  ASSERT_NE(end, std::string::npos);
  const std::string block = readme.substr(begin + 8, end + 1 - (begin + 8));

  TempDir dir;
  const std::string src = STRATA_SOURCE_DIR, bin = STRATA_BINARY_DIR;
  ASSERT_EQ(::symlink(bin.c_str(), dir.file("build").c_str()), 0);
  ASSERT_EQ(::symlink((src + "/tools").c_str(), dir.file("tools").c_str()), 0);
  ASSERT_EQ(::symlink((src + "/.venv").c_str(), dir.file(".venv").c_str()), 0);
  make_dirs(dir.file("my-texts/more"));
  dir.write("my-texts/notes.txt", words(600, 7));
  std::string jl;
  for (int i = 0; i < 200; ++i) jl += nlohmann::json({{"text", words(3, 100 + i)}}).dump() + "\n";
  dir.write("my-texts/more/docs.jsonl", jl);
  Result r = sh(kHelper + " train " + dir.file("my-model") + " 300 " + dir.file("my-texts/notes.txt"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = sh(kHelper + " model " + dir.file("my-model") + " 300");
  ASSERT_EQ(r.code, 0) << r.output;
  dir.write("walkthrough.sh", block);
  // No network: transformers must find everything on disk.
  r = sh("cd " + dir.path() + " && HF_HUB_OFFLINE=1 bash -euo pipefail walkthrough.sh");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("tokenize: wrote corpus.bin"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\nLlamaForCausalLM\n"), std::string::npos) << r.output;
  EXPECT_TRUE(path_exists(dir.file("my-model-tuned/model.safetensors")));
  EXPECT_TRUE(path_exists(dir.file("my-model-tuned/tokenizer.json")));
  EXPECT_TRUE(path_exists(dir.file("finetune-ckpt/latest")));
}

}  // namespace
}  // namespace strata

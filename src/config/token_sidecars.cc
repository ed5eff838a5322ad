// The token files' sidecars (docs/token-format.md), read while the data
// section is parsed.
#include <sys/stat.h>

#include "config/sections.h"
#include "util/fs.h"

namespace strata::config {

// A token file written by tools/tokenize.py has a sidecar, FILE.json: its
// dtype is data.format unless the config sets one (then they must agree), its
// tokenizer's vocabulary must fit model.vocab_size, and its token count must
// match the file's size. Files without a sidecar are taken as the config says.
void apply_token_sidecars(Config& c, bool format_set) {
  std::string from;  // the sidecar data.format came from
  c.data.mask_paths.assign(c.data.paths.size(), "");
  c.data.index_paths.assign(c.data.paths.size(), "");
  for (size_t f = 0; f < c.data.paths.size(); ++f) {
    const std::string& file = c.data.paths[f];
    const std::string side = file + ".json";
    if (!path_exists(side) || is_directory(side)) continue;
    const json j = json::parse(file_contents(side), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || j.value("format", std::string()) != "strata-tokens") {
      fail(side, "not a token file sidecar (tools/tokenize.py writes {\"format\": \"strata-tokens\", ...})");
    }
    for (const char* k : {"dtype", "vocab_size", "tokens"}) {
      if (!j.contains(k)) fail(side, std::string("no \"") + k + "\" field");
    }
    if (!j["dtype"].is_string() || (j["dtype"] != "uint16" && j["dtype"] != "uint32")) {
      fail(side, "dtype " + j["dtype"].dump() + " is not uint16 or uint32");
    }
    if (!j["vocab_size"].is_number_integer() || !j["tokens"].is_number_integer() || j["tokens"].get<int64_t>() < 0) {
      fail(side, "vocab_size and tokens must be non-negative integers");
    }
    const std::string dtype = j["dtype"].get<std::string>();
    const std::string format = data_format_name(c.data.format);
    if (format_set && format != dtype) {
      fail("data.format", json(format).dump() + " here, but " + side + " says the file is " + dtype);
    }
    if (!format_set) {
      if (!from.empty() && format != dtype) {
        fail(side, "dtype " + dtype + " differs from " + format + " in " + from + " (one data.format for all files)");
      }
      c.data.format = dtype == "uint16" ? DataFormat::kUint16 : DataFormat::kUint32;
      from = side;
    }
    const int64_t vocab = j["vocab_size"].get<int64_t>();
    if (vocab > c.model.vocab_size) {
      fail("model.vocab_size", num(c.model.vocab_size) + " is smaller than the vocabulary of the tokenizer that wrote " +
                                   file + " (" + num(vocab) + ", in " + side + ")");
    }
    // Version 2 (examples): the loss mask and the example index beside the
    // file, named relative to its directory.
    const int64_t version = j.value("version", int64_t(1));
    if (version < 1 || version > 2) fail(side, "version " + num(version) + " is newer than this Strata reads (1 or 2)");
    const size_t slash = file.rfind('/');
    const std::string dir = slash == std::string::npos ? "" : file.substr(0, slash + 1);
    for (auto [key, out] : {std::pair{"mask", &c.data.mask_paths[f]}, std::pair{"index", &c.data.index_paths[f]}}) {
      if (!j.contains(key)) continue;
      if (!j[key].is_string() || j[key].get<std::string>().empty() || j[key].get<std::string>().find('/') != std::string::npos) {
        fail(side, std::string("\"") + key + "\" must name a file beside it");
      }
      *out = dir + j[key].get<std::string>();
      if (!path_exists(*out)) fail(side, std::string("names ") + key + " file " + *out + ", which does not exist");
    }
    struct stat st;
    if (::stat(file.c_str(), &st) == 0) {
      const int64_t tokens = j["tokens"].get<int64_t>(), width = dtype == "uint16" ? 2 : 4;
      if (int64_t(st.st_size) != tokens * width) {
        fail(side, "says " + num(tokens) + " " + dtype + " tokens (" + num(tokens * width) + " bytes), but " + file +
                       " has " + num(int64_t(st.st_size)) + " bytes");
      }
    }
  }
}

}  // namespace strata::config

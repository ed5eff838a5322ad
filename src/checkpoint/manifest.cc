// The checkpoint's manifest as JSON, both ways; reading checks every field
// (docs/checkpoint.md).
#include <algorithm>

#include "checkpoint/internal.h"
#include "util/errors.h"

namespace strata {

using namespace ckpt;  // NOLINT: this module's own helpers (checkpoint/internal.h)

namespace ckpt {

bool parse_category(const std::string& s, Category* out) {
  for (Category c : kSavedCategories) {
    if (s == saved_name(c)) {
      *out = c;
      return true;
    }
  }
  return false;
}

[[noreturn]] void bad(const std::string& path, const std::string& key, const std::string& what) {
  throw InputError(path, "manifest " + key + ": " + what);
}

bool plain_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos &&
         n.find('\0') == std::string::npos;
}

json range_to_json(const SavedRange& r) {
  return {{"category", saved_name(r.category)}, {"start", r.start}, {"numel", r.numel},
          {"file", r.file},                     {"offset", r.offset}, {"crc32c", r.crc}};
}

void sort_ranges(std::vector<SavedRange>& ranges) {
  std::stable_sort(ranges.begin(), ranges.end(), [](const SavedRange& a, const SavedRange& b) {
    return a.category != b.category ? a.category < b.category : a.start < b.start;
  });
}

}  // namespace ckpt

namespace {

const json& member(const json& j, const char* key, const std::string& path, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) bad(path, where.empty() ? key : where + "." + key, "missing");
  return j[key];
}

int64_t integer(const json& j, const char* key, const std::string& path, const std::string& where) {
  const json& v = member(j, key, path, where);
  if (!v.is_number_integer()) bad(path, where.empty() ? key : where + "." + key, "expected an integer");
  return v.get<int64_t>();
}

}  // namespace

// ---- manifest -------------------------------------------------------------------

json manifest_to_json(const Manifest& m) {
  json tensors = json::array();
  for (const TensorEntry& t : m.tensors) tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"start", t.start}});
  json dtypes = json::object();
  for (const auto& [c, eb] : m.elem_bytes) dtypes[saved_name(c)] = eb == 4 ? "fp32" : "bf16";
  json ranges = json::array();
  for (const SavedRange& r : m.ranges) ranges.push_back(range_to_json(r));
  json files = json::object();
  for (const auto& [name, bytes] : m.files) files[name] = bytes;
  return {{"format", "strata-checkpoint"},
          {"version", kCheckpointVersion},
          {"step", m.step},
          {"saved_world_size", m.saved_world_size},
          {"parameters", m.parameters},
          {"tensors", tensors},
          {"dtypes", dtypes},
          {"checksum_bytes", kChecksumBytes},
          {"files", files},
          {"ranges", ranges},
          {"trainer", m.trainer},
          {"data", m.data},
          {"invariants", m.invariants},
          {"config", m.config}};
}

namespace {

std::vector<TensorEntry> tensors_from_json(const json& j, const std::string& path) {
  std::vector<TensorEntry> out;
  const json& tensors = member(j, "tensors", path, "");
  if (!tensors.is_array()) bad(path, "tensors", "expected an array");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string where = strprintf("tensors[%zu]", i);
    TensorEntry t;
    const json& name = member(tensors[i], "name", path, where);
    if (!name.is_string()) bad(path, where + ".name", "expected a string");
    t.name = name.get<std::string>();
    const json& shape = member(tensors[i], "shape", path, where);
    if (!shape.is_array()) bad(path, where + ".shape", "expected an array");
    for (const json& d : shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 1) bad(path, where + ".shape", "expected positive integers");
      t.shape.push_back(d.get<int64_t>());
    }
    t.start = integer(tensors[i], "start", path, where);
    out.push_back(std::move(t));
  }
  return out;
}

// ranges[i], checked against the manifest's files, parameters and dtypes.
SavedRange range_from_json(const json& r, const std::string& path, const std::string& where, const Manifest& m) {
  SavedRange s;
  const json& cat = member(r, "category", path, where);
  if (!cat.is_string() || !parse_category(cat.get<std::string>(), &s.category)) {
    bad(path, where + ".category", "expected master, exp_avg or exp_avg_sq");
  }
  s.start = integer(r, "start", path, where);
  s.numel = integer(r, "numel", path, where);
  s.offset = integer(r, "offset", path, where);
  const json& file = member(r, "file", path, where);
  if (!file.is_string() || !plain_name(file.get<std::string>())) {
    bad(path, where + ".file", "'" + (file.is_string() ? file.get<std::string>() : file.dump()) +
                                   "' is not a plain file name inside the checkpoint directory");
  }
  s.file = file.get<std::string>();
  if (!m.files.count(s.file)) bad(path, where + ".file", "'" + s.file + "' is not listed in files");
  if (s.start < 0 || s.numel < 1 || s.start + s.numel > m.parameters) {
    bad(path, where, "start and numel must lie inside the parameters");
  }
  const int64_t bytes = s.numel * m.elem_bytes.at(s.category);
  if (s.offset < 0 || s.offset % kAlign != 0 || s.offset + round_up(bytes, kAlign) > m.files.at(s.file)) {
    bad(path, where + ".offset", "must be a multiple of 4096 inside the file");
  }
  const json& crc = member(r, "crc32c", path, where);
  if (!crc.is_array() || int64_t(crc.size()) != (bytes + kChecksumBytes - 1) / kChecksumBytes) {
    bad(path, where + ".crc32c", "expected one CRC-32C per MiB of the range");
  }
  for (const json& v : crc) {
    if (!v.is_number_unsigned() || v.get<uint64_t>() > 0xffffffffULL) bad(path, where + ".crc32c", "expected 32-bit values");
    s.crc.push_back(uint32_t(v.get<uint64_t>()));
  }
  return s;
}

// Every saved category is tiled exactly by the (sorted) ranges: no gap, no overlap.
void check_tiling(const Manifest& m, const std::string& path) {
  for (Category c : kSavedCategories) {
    int64_t next = 0;
    for (const SavedRange& r : m.ranges) {
      if (r.category != c) continue;
      if (r.start != next) {
        bad(path, "ranges", strprintf("%s elements %lld.. are %s", saved_name(c), (long long)std::min(next, r.start),
                                      r.start > next ? "missing" : "saved twice"));
      }
      next = r.start + r.numel;
    }
    if (next != m.parameters) {
      bad(path, "ranges", strprintf("%s elements %lld.. are missing", saved_name(c), (long long)next));
    }
  }
}

}  // namespace

Manifest manifest_from_json(const json& j, const std::string& path) {
  if (!j.is_object()) bad(path, "(top level)", "expected a JSON object");
  if (!j.contains("format") || j["format"] != "strata-checkpoint") {
    bad(path, "format", "not a Strata checkpoint manifest");
  }
  const int64_t version = integer(j, "version", path, "");
  if (version != kCheckpointVersion) {
    bad(path, "version", strprintf("%lld is not supported (this build reads version %d)", (long long)version,
                                   kCheckpointVersion));
  }
  if (integer(j, "checksum_bytes", path, "") != kChecksumBytes) bad(path, "checksum_bytes", "must be 1048576");
  Manifest m;
  m.step = integer(j, "step", path, "");
  if (m.step < 1) bad(path, "step", "must be positive");
  m.saved_world_size = integer(j, "saved_world_size", path, "");
  m.parameters = integer(j, "parameters", path, "");
  if (m.parameters < 1) bad(path, "parameters", "must be positive");
  m.tensors = tensors_from_json(j, path);
  const json& dtypes = member(j, "dtypes", path, "");
  for (Category c : kSavedCategories) {
    const json& d = member(dtypes, saved_name(c), path, "dtypes");
    if (d == "fp32") {
      m.elem_bytes[c] = 4;
    } else if (d == "bf16" && c != Category::kMaster) {
      m.elem_bytes[c] = 2;
    } else {
      bad(path, std::string("dtypes.") + saved_name(c), "expected \"fp32\"" +
                                                            std::string(c == Category::kMaster ? "" : " or \"bf16\""));
    }
  }
  const json& files = member(j, "files", path, "");
  if (!files.is_object()) bad(path, "files", "expected an object");
  for (auto it = files.begin(); it != files.end(); ++it) {
    if (!plain_name(it.key())) {
      bad(path, "files", "'" + it.key() + "' is not a plain file name inside the checkpoint directory");
    }
    if (!it->is_number_integer() || it->get<int64_t>() < 0) bad(path, "files." + it.key(), "expected a byte count");
    m.files[it.key()] = it->get<int64_t>();
  }
  const json& ranges = member(j, "ranges", path, "");
  if (!ranges.is_array()) bad(path, "ranges", "expected an array");
  for (size_t i = 0; i < ranges.size(); ++i) {
    m.ranges.push_back(range_from_json(ranges[i], path, strprintf("ranges[%zu]", i), m));
  }
  sort_ranges(m.ranges);
  check_tiling(m, path);
  if (j.contains("trainer")) m.trainer = j["trainer"];
  if (j.contains("data")) m.data = j["data"];
  if (j.contains("config")) m.config = j["config"];
  if (j.contains("invariants")) m.invariants = j["invariants"];
  return m;
}

}  // namespace strata

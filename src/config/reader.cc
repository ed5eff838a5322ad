// The config's readers: messages, the "did you mean" hint, typed reads of one
// section against its key table (config/reader.h).
#include "config/reader.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <utility>

#include "util/errors.h"

namespace strata::config {

// ---- messages ---------------------------------------------------------------

std::string join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// A JSON value for a message: its type and, for scalars, its value.
std::string describe(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return std::string("boolean ") + (v.get<bool>() ? "true" : "false");
    case json::value_t::string: {
      std::string s = v.get<std::string>();
      if (s.size() > 60) s = s.substr(0, 57) + "...";
      return "string " + json(s).dump();
    }
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "number " + v.dump();
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "a value of unsupported type";
  }
}

std::string num(double v) { return json(v).dump(); }
std::string num(int64_t v) { return std::to_string(v); }

[[noreturn]] void fail(const std::string& key, const std::string& message) {
  throw ConfigError(key, message);
}

[[noreturn]] void wrong_type(const std::string& key, const char* expected, const json& v) {
  fail(key, std::string("expected ") + expected + ", got " + describe(v));
}

// ---- "did you mean" ---------------------------------------------------------

// Optimal string alignment distance (edits incl. adjacent transpositions).
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

size_t common_prefix(const std::string& a, const std::string& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// The closest candidate to `key`, or "" when none is close. Candidates within
// edit distance 3 come first (nearest wins); otherwise the longest shared
// prefix of at least 5 characters (or all of a key of 3+) wins.
std::string suggest(const std::string& key, const Keys& a, const Keys& b) {
  const std::string k = lower(key);
  std::string best;
  // Lower rank is better: (0, distance) for near typos, (1, -prefix) otherwise.
  std::pair<int, long> best_rank{2, 0};
  auto consider = [&](std::string_view cand_view) {
    const std::string cand = lower(cand_view);
    const size_t dist = edit_distance(k, cand);
    const size_t prefix = common_prefix(k, cand);
    std::pair<int, long> rank;
    if (dist <= 3) {
      rank = {0, static_cast<long>(dist)};
    } else if (prefix >= 5 || (prefix >= 3 && (prefix == k.size() || prefix == cand.size()))) {
      rank = {1, -static_cast<long>(prefix)};
    } else {
      return;
    }
    if (rank < best_rank) {
      best = std::string(cand_view);
      best_rank = rank;
    }
  };
  for (auto c : a) consider(c);
  for (auto c : b) consider(c);
  return best;
}

// Checks the keys of the object at `path`: each must be in `known` (read by the
// caller) or in `ignored` (accepted, recorded in `ignored_out`).
void check_keys(const json& obj, const std::string& path, const Keys& known, const Keys& ignored,
                std::vector<std::string>& ignored_out) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string& key = it.key();
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    if (std::find(ignored.begin(), ignored.end(), key) != ignored.end()) {
      ignored_out.push_back(join(path, key));
      continue;
    }
    std::string msg = "unknown key";
    const std::string close = suggest(key, known, ignored);
    if (!close.empty()) msg += ", did you mean '" + close + "'?";
    fail(join(path, key), msg);
  }
}

// Integers: JSON integers, or floats with an integral value (DeepSpeed configs
// write 5e8).
int64_t to_int(const json& v, const std::string& key) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(key, "integer " + v.dump() + " is out of range");
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) {
      fail(key, "expected an integer, got " + v.dump());
    }
    if (d >= 9.2e18 || d <= -9.2e18) fail(key, "integer " + v.dump() + " is out of range");
    return static_cast<int64_t>(d);
  }
  wrong_type(key, "an integer", v);
}

// ---- range checks -----------------------------------------------------------

void positive(const std::string& key, int64_t v) {
  if (v <= 0) fail(key, "must be > 0, got " + num(v));
}
void non_negative(const std::string& key, int64_t v) {
  if (v < 0) fail(key, "must be >= 0, got " + num(v));
}
void positive(const std::string& key, double v) {
  if (!(v > 0)) fail(key, "must be > 0, got " + num(v));
}
void non_negative(const std::string& key, double v) {
  if (!(v >= 0)) fail(key, "must be >= 0, got " + num(v));
}
void in_closed(const std::string& key, double v, double lo, double hi) {
  if (!(v >= lo && v <= hi)) {
    fail(key, "must be in [" + num(lo) + ", " + num(hi) + "], got " + num(v));
  }
}

// ---- one section --------------------------------------------------------------

Section::Section(const json& obj, std::string path, const SectionKeys& keys, std::vector<std::string>& ignored_out)
    : obj_(obj), keys_(keys), ignored_out_(ignored_out), path_(std::move(path)), asked_(keys.read.size(), false) {
  check_keys(obj_, path_, keys_.read, keys_.ignored, ignored_out_);
}

size_t Section::index(std::string_view k) const {
  const auto it = std::find(keys_.read.begin(), keys_.read.end(), k);
  if (it == keys_.read.end()) {
    // A read the table does not list: the key would be refused as unknown.
    throw std::logic_error("config/reader.cc: " + join(std::string(keys_.path), k) +
                           " is read but not in its section's key table");
  }
  return static_cast<size_t>(it - keys_.read.begin());
}

const json* Section::find(std::string_view k) {
  asked_[index(k)] = true;
  auto it = obj_.find(k);
  return it == obj_.end() ? nullptr : &*it;
}

const json& Section::object(std::string_view k) {
  static const json empty = json::object();
  const json* v = find(k);
  if (!v) return empty;
  if (!v->is_object()) wrong_type(key(k), "an object", *v);
  return *v;
}

bool Section::read(std::string_view k, bool& out) {
  const json* v = find(k);
  if (!v) return false;
  if (!v->is_boolean()) wrong_type(key(k), "a boolean (true or false)", *v);
  out = v->get<bool>();
  return true;
}

bool Section::read(std::string_view k, int64_t& out) {
  const json* v = find(k);
  if (!v) return false;
  out = to_int(*v, key(k));
  return true;
}

bool Section::read(std::string_view k, uint64_t& out) {
  const json* v = find(k);
  if (!v) return false;
  const std::string name = key(k);
  if (v->is_number_unsigned()) {
    out = v->get<uint64_t>();
  } else if (v->is_number_integer()) {
    const int64_t i = v->get<int64_t>();
    if (i < 0) fail(name, "must be >= 0, got " + v->dump());
    out = static_cast<uint64_t>(i);
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) fail(name, "expected an integer, got " + v->dump());
    if (d < 0) fail(name, "must be >= 0, got " + v->dump());
    if (d >= 1.8e19) fail(name, "integer " + v->dump() + " is out of range");
    out = static_cast<uint64_t>(d);
  } else {
    wrong_type(name, "a non-negative integer", *v);
  }
  return true;
}

bool Section::read(std::string_view k, double& out) {
  const json* v = find(k);
  if (!v) return false;
  if (!v->is_number()) wrong_type(key(k), "a number", *v);
  out = v->get<double>();
  return true;
}

bool Section::read(std::string_view k, std::string& out) {
  const json* v = find(k);
  if (!v) return false;
  if (!v->is_string()) wrong_type(key(k), "a string", *v);
  out = v->get<std::string>();
  return true;
}

bool Section::read_choice(std::string_view k, std::string& out, const Keys& allowed) {
  std::string s;
  if (!read(k, s)) return false;
  for (auto a : allowed) {
    if (lower(a) == lower(s)) {
      out = std::string(a);
      return true;
    }
  }
  std::string list;
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (i > 0) list += i + 1 == allowed.size() ? " or " : ", ";
    list += std::string(allowed[i]);
  }
  fail(key(k), "expected " + list + ", got " + json(s).dump());
}

bool Section::read_paths(std::string_view k, std::vector<std::string>& out, bool allow_null) {
  const json* v = find(k);
  if (!v) return false;
  const std::string name = key(k);
  out.clear();
  if (v->is_null() && allow_null) return true;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      if (!e.is_string()) {
        fail(name, "expected a string or a list of strings, element " + std::to_string(i) + " is " + describe(e));
      }
      out.push_back(e.get<std::string>());
    }
  } else {
    wrong_type(name, "a string or a list of strings", *v);
  }
  for (const auto& p : out) {
    if (p.empty()) fail(name, "paths must not be empty strings");
  }
  return true;
}

void Section::done() const {
  for (size_t i = 0; i < asked_.size(); ++i) {
    if (!asked_[i]) {
      throw std::logic_error("config/reader.cc: " + join(std::string(keys_.path), keys_.read[i]) +
                             " is in its section's key table but never read");
    }
  }
}

}  // namespace strata::config

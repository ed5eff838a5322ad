// The config's readers (config/ only): messages, the "did you mean" hint, and
// Section, which reads one JSON object against its key table. A section's
// table (SectionKeys) is the one list of its keys: Section checks the object's
// keys against it when it is made, refuses to read a key the table lacks, and
// done() checks that every key the table says is read was asked for, so the
// table, the reads and docs/config.md (tests/config_test.cc,
// DocsListEveryKeyTheParserReads) cannot drift apart.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"

namespace strata::config {

using json = nlohmann::json;
using Keys = std::vector<std::string_view>;

// One section's keys: those Strata reads, and DeepSpeed's that it accepts
// with a warning (recorded in Config::ignored_keys).
struct SectionKeys {
  std::string_view path;  // dotted path of the section; "" = the top level
  Keys read;
  Keys ignored;
};

// ---- messages ---------------------------------------------------------------
std::string join(const std::string& path, std::string_view key);
std::string lower(std::string_view s);
std::string describe(const json& v);  // a JSON value's type and, for scalars, its value
std::string num(double v);
std::string num(int64_t v);
[[noreturn]] void fail(const std::string& key, const std::string& message);
[[noreturn]] void wrong_type(const std::string& key, const char* expected, const json& v);

// Checks the keys of `obj` at `path`: each must be in `known` or in `ignored`
// (then recorded in `ignored_out`); an unknown one fails with a hint.
void check_keys(const json& obj, const std::string& path, const Keys& known, const Keys& ignored,
                std::vector<std::string>& ignored_out);

// Integers: JSON integers, or floats with an integral value (DeepSpeed configs write 5e8).
int64_t to_int(const json& v, const std::string& key);

// ---- range checks -----------------------------------------------------------
void positive(const std::string& key, int64_t v);
void non_negative(const std::string& key, int64_t v);
void positive(const std::string& key, double v);
void non_negative(const std::string& key, double v);
void in_closed(const std::string& key, double v, double lo, double hi);

// ---- enums ------------------------------------------------------------------
// One table per enum: its values and their config spellings, both ways.
template <class E>
struct EnumName {
  E value;
  const char* name;
};

template <class E, size_t N>
const char* name_of(const EnumName<E> (&table)[N], E v) {
  for (const auto& e : table) {
    if (e.value == v) return e.name;
  }
  return table[0].name;
}

// ---- one section --------------------------------------------------------------
class Section {
 public:
  // Checks obj's keys against `keys`. `path`, when given, names the object
  // in messages in place of the table's (bfloat16 for bf16, a placement
  // category's split, csv_monitor for the monitors' table).
  Section(const json& obj, const SectionKeys& keys, std::vector<std::string>& ignored_out)
      : Section(obj, std::string(keys.path), keys, ignored_out) {}
  Section(const json& obj, std::string path, const SectionKeys& keys, std::vector<std::string>& ignored_out);

  const std::string& path() const { return path_; }
  std::string key(std::string_view k) const { return join(path_, k); }  // dotted, for messages
  std::vector<std::string>& ignored_out() { return ignored_out_; }

  // Each reads obj[k] when present (leaving `out` as it is otherwise) and
  // returns whether it was. `k` must be a read key of the table.
  const json* find(std::string_view k);
  bool read(std::string_view k, bool& out);
  bool read(std::string_view k, int64_t& out);
  bool read(std::string_view k, uint64_t& out);
  bool read(std::string_view k, double& out);
  bool read(std::string_view k, std::string& out);
  // A string from `allowed`, matched case-insensitively; `out` gets the listed spelling.
  bool read_choice(std::string_view k, std::string& out, const Keys& allowed);
  template <class E, size_t N>
  bool read_enum(std::string_view k, E& out, const EnumName<E> (&table)[N]) {
    Keys allowed;
    for (const auto& e : table) allowed.push_back(e.name);
    std::string s;
    if (!read_choice(k, s, allowed)) return false;
    for (const auto& e : table) {
      if (s == e.name) out = e.value;
    }
    return true;
  }
  // A string or a list of strings, none empty; null = no paths when allow_null.
  bool read_paths(std::string_view k, std::vector<std::string>& out, bool allow_null);
  // The object at obj[k], or an empty object when absent.
  const json& object(std::string_view k);

  // Every read key of the table was asked for (a broken invariant otherwise).
  void done() const;

 private:
  size_t index(std::string_view k) const;

  const json& obj_;
  const SectionKeys& keys_;
  std::vector<std::string>& ignored_out_;
  std::string path_;
  std::vector<bool> asked_;
};

}  // namespace strata::config

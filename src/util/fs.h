// Small file-system helpers over POSIX calls.
//
// Note [No std::filesystem next to LibTorch]
// The libtorch.so of PyPI's torch wheel exports its own copy of
// std::filesystem's functions, built against a newer libstdc++. In a binary
// that links LibTorch those definitions interpose on the system libstdc++'s,
// and some of them crash (std::filesystem::remove_all jumps to address 0).
// So no code that may end up in such a binary uses std::filesystem; it uses
// these helpers instead.
#pragma once

#include <string>

namespace strata {

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// The directory part of `path` ("a/b/c" -> "a/b", "c" -> ".").
std::string parent_dir(const std::string& path);
// mkdir -p with `mode` for the directories it creates. Throws IoError.
void make_dirs(const std::string& path, unsigned mode = 0755);
// Removes a file if it exists; errors other than "does not exist" throw IoError.
void remove_file(const std::string& path);

}  // namespace strata

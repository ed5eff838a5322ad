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
#include <vector>

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
// Removes a directory and everything under it (symbolic links are removed,
// never followed); a missing path is not an error. Throws IoError.
void remove_tree(const std::string& path);
// The names in a directory, sorted, without "." and "..". Throws IoError.
std::vector<std::string> list_dir(const std::string& path);
// rename(2). Throws IoError naming both paths.
void rename_path(const std::string& from, const std::string& to);
// fsync of a directory, so that the entries created, renamed or removed in
// it are durable. Throws IoError.
void sync_dir(const std::string& path);
// The whole file as bytes. Throws InputError naming the path.
std::string file_contents(const std::string& path);
// Writes `text` to `path` atomically: to PATH.tmp (0600), fsynced, renamed
// over `path`, the directory fsynced. Throws IoError; a failure leaves
// `path` as it was.
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace strata

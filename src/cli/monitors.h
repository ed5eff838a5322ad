// DeepSpeed's monitors, acted on: `tensorboard` writes TensorBoard event
// files, `csv_monitor` one CSV file per tag, both under output_path/job_name/
// and from rank 0 only, as DeepSpeed does (docs/monitors.md). No LibTorch
// here.
//
// Note [Event files]
// TensorBoard reads "events.out.tfevents.*" files: a sequence of TFRecords
// (uint64 length, its masked CRC-32C, the bytes, their masked CRC-32C, all
// little-endian), each an `Event` protobuf. The first says file_version
// "brain.Event:2"; each later one carries wall_time, step and a Summary of
// (tag, simple_value) pairs, which TensorBoard shows as scalars. Strata
// encodes those few fields by hand (EventFileWriter) instead of linking
// protobuf and compiling TensorBoard's .proto files for five fields; the
// field numbers and wire types are docs/monitors.md's, and monitors_test
// reads the files back with the `tensorboard` package.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"

namespace strata {

// One event file. Throws IoError naming the file when it cannot be created
// or written.
class EventFileWriter {
 public:
  // Creates `dir` (and parents) and a new event file in it.
  explicit EventFileWriter(const std::string& dir);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // One Event at `step` holding `scalars` (tag, value), written and flushed.
  void scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  std::FILE* f_ = nullptr;
};

// One CSV file per tag, DeepSpeed's csv_monitor layout: <dir>/<tag with '/'
// and ' ' as '_'>.csv, a header "step,<the tag's last part>" when the file
// is new, then "x,value" rows (appended: a resumed run continues its files).
class CsvMonitorWriter {
 public:
  explicit CsvMonitorWriter(const std::string& dir);
  ~CsvMonitorWriter();
  CsvMonitorWriter(const CsvMonitorWriter&) = delete;
  CsvMonitorWriter& operator=(const CsvMonitorWriter&) = delete;
  void scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::map<std::string, std::FILE*> files_;
};

// Both, fed a step's figures. The x value of every point is the global
// samples count, as DeepSpeed's: DeepSpeed's own tags (Train/Samples/...)
// where DeepSpeed writes them — train_loss at the samples before the step,
// lr and loss_scale after it — and Strata's (Strata/...) after the step.
class Monitors {
 public:
  // Nothing is created unless a monitor is enabled.
  Monitors(const Config& cfg, bool rank0);
  bool any() const { return tb_ != nullptr || csv_ != nullptr; }
  // A step's metrics line (the run.metrics JSON object's fields) after step
  // `step` of `batch` samples each.
  void step(int64_t step, int64_t batch, const std::map<std::string, double>& figures);
  // The directories written to (for the start line).
  std::vector<std::string> dirs() const;

 private:
  void write(int64_t x, const std::vector<std::pair<std::string, float>>& s);
  std::unique_ptr<EventFileWriter> tb_;
  std::unique_ptr<CsvMonitorWriter> csv_;
};

// The figures of a metrics line that monitors write, by name, and their
// tags (docs/monitors.md).
const std::vector<std::pair<std::string, std::string>>& strata_monitor_tags();

}  // namespace strata

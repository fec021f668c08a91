// The one exception type of the data layer. Every problem with training data (a path that
// matches nothing, a corrupt shard, a token outside the vocabulary, ...) is reported with
// the config field that led to the data, so the daemon can answer with a FieldError.
#pragma once

#include <stdexcept>
#include <string>

namespace nsad::data {

// Config fields that data errors point at (dotted proto paths, see nsad/config.h).
inline constexpr const char* kTrainPathField = "data.train_path";
inline constexpr const char* kValPathField = "data.val_path";
inline constexpr const char* kValFractionField = "data.val_fraction";

class DataError : public std::runtime_error {
 public:
  // what() is "<field>: <message>"; message() is the message alone.
  DataError(std::string field, std::string message);
  const std::string& field() const { return field_; }
  const std::string& message() const { return message_; }

 private:
  std::string field_;
  std::string message_;
};

}  // namespace nsad::data

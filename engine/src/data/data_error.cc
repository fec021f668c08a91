#include "data/data_error.h"

#include <utility>

namespace nsad::data {

DataError::DataError(std::string field, std::string message)
    : std::runtime_error(field + ": " + message),
      field_(std::move(field)),
      message_(std::move(message)) {}

}  // namespace nsad::data

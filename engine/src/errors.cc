// The engine's exception types; torch-free so the daemon can raise and catch them too.
#include "nsad/engine.h"

namespace nsad {

ConfigError::ConfigError(std::vector<FieldError> errors)
    : std::runtime_error(FormatFieldErrors(errors)), errors_(std::move(errors)) {}

TrainingHalt::TrainingHalt(int64_t step, const std::string& reason)
    : std::runtime_error(reason), step_(step) {}

}  // namespace nsad

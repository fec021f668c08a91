// How another thread ends a run's trainer work in flight (its workers' start, a step): the
// trainer registers what ends it (its workers killed) for as long as that is safe to call, and
// the run manager's halt watch calls Abort. Thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <utility>

namespace nsad::server {

class AbortSlot {
 public:
  // Unregisters when it goes: declare it after whatever the registered function touches.
  class Registration {
   public:
    explicit Registration(AbortSlot* slot) : slot_(slot) {}
    ~Registration() { slot_->Set(nullptr); }
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;

   private:
    AbortSlot* slot_;
  };

  [[nodiscard]] std::unique_ptr<Registration> Register(std::function<void()> abort) {
    Set(std::move(abort));
    return std::make_unique<Registration>(this);
  }

  // Runs the registered function (under the slot's lock, so its registration cannot end
  // meanwhile); false when none is registered.
  bool Abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!abort_) return false;
    abort_();
    return true;
  }

 private:
  void Set(std::function<void()> abort) {
    std::lock_guard<std::mutex> lock(mutex_);
    abort_ = std::move(abort);
  }

  std::mutex mutex_;
  std::function<void()> abort_;
};

}  // namespace nsad::server

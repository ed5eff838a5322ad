// Completion: the one small value the engine waits on, whatever the work was
// (an NVMe transfer, a collective; the GPU path adds copies and events). A
// buffer goes back to its pool only once the completion of its last user has
// fired. No LibTorch here.
#pragma once

#include <cstdint>

namespace strata {

// Who can tell when a ticket's work is done. Implemented by the owners of
// asynchronous work (the communicator, the tiered state); they keep whatever
// a ticket refers to alive until it has been waited for.
class Waiter {
 public:
  virtual ~Waiter() = default;
  // Blocks until the work of `ticket` is done; rethrows its failure.
  virtual void wait_ticket(uint64_t ticket) = 0;
};

// A value: copying it copies the ticket, not the work. Nothing is allocated:
// the waiter keeps the state of its tickets in storage sized at start-up.
class Completion {
 public:
  Completion() = default;  // already complete
  Completion(Waiter* waiter, uint64_t ticket) : waiter_(waiter), ticket_(ticket) {}

  // Waits for the work (once; later calls return at once) and rethrows its
  // failure.
  void wait() {
    if (waiter_ == nullptr) return;
    Waiter* w = waiter_;
    waiter_ = nullptr;
    w->wait_ticket(ticket_);
  }
  bool pending() const { return waiter_ != nullptr; }
  // Who fires it and which of its tickets (for a device ordering a stream
  // after its own events without blocking the host).
  Waiter* waiter() const { return waiter_; }
  uint64_t ticket() const { return ticket_; }

 private:
  Waiter* waiter_ = nullptr;
  uint64_t ticket_ = 0;
};

}  // namespace strata

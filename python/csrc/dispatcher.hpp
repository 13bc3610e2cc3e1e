// The threads that complete a group's futures, without torch's headers.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace fairring {

// Whether the calling thread runs futures' callbacks for a fairring group
// (this library's dispatchers, or the Python group's, which mark themselves).
bool on_callback_thread();
void mark_callback_thread();

// Runs futures' completions, each on a thread of its own reserved: an idle
// one, or a new thread while every one is busy in callbacks. Completing a
// future runs its callbacks on the completing thread, and a callback may wait
// on a later operation of the same group (PowerSGD's hooks do): a callback
// that blocks holds up only itself.
class Dispatcher {
 public:
  explicit Dispatcher(int rank);
  ~Dispatcher();
  // Runs `task` on a reserved thread; false once the dispatcher is closed.
  bool hand_over(std::function<void()> task);
  // Lets the threads finish what they hold and joins them (but not the
  // calling thread, if it is one of them).
  void close();

 private:
  // Shared with the threads, so that one left running (a callback that
  // closed its own group) outlives the dispatcher safely.
  struct State {
    int rank;
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<std::function<void()>> tasks;
    std::vector<std::thread> threads;
    int idle = 0;
    bool closing = false;
  };
  static void run(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
};

}  // namespace fairring

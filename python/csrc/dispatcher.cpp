// The threads that complete a group's futures.

#include "dispatcher.hpp"

#include <pthread.h>

#include <algorithm>
#include <string>

namespace fairring {

namespace {
thread_local bool callback_thread = false;
}  // namespace

bool on_callback_thread() { return callback_thread; }

void mark_callback_thread() { callback_thread = true; }

Dispatcher::Dispatcher(int rank) : state_(std::make_shared<State>()) {
  state_->rank = rank;
}

Dispatcher::~Dispatcher() { close(); }

bool Dispatcher::hand_over(std::function<void()> task) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.closing) {
    return false;
  }
  if (s.idle > 0) {
    s.idle -= 1;  // reserved for this task
  } else {
    s.threads.emplace_back([state = state_] { run(state); });
  }
  s.tasks.push_back(std::move(task));
  s.ready.notify_one();
  return true;
}

void Dispatcher::run(const std::shared_ptr<State>& state) {
  mark_callback_thread();
  State& s = *state;
  {
    // As the Python group names its dispatchers (15 characters at most).
    std::string name = "fairring-cb-" + std::to_string(s.rank);
    name.resize(std::min<size_t>(name.size(), 15));
    pthread_setname_np(pthread_self(), name.c_str());
  }
  std::unique_lock<std::mutex> lock(s.mutex);
  while (true) {
    s.ready.wait(lock, [&s] { return s.closing || !s.tasks.empty(); });
    if (s.tasks.empty()) {
      return;  // closing, and nothing left
    }
    {
      auto task = std::move(s.tasks.front());
      s.tasks.pop_front();
      lock.unlock();
      task();
    }  // what the task held is let go before the lock is taken again
    lock.lock();
    s.idle += 1;
  }
}

void Dispatcher::close() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closing = true;
    threads.swap(state_->threads);
  }
  state_->ready.notify_all();
  for (auto& t : threads) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // a callback closing its own group: it ends on return
    } else {
      t.join();
    }
  }
}

}  // namespace fairring

#include "cli/launch.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "util/errors.h"
#include "util/logging.h"

namespace strata {

namespace {

struct LaunchOptions {
  int nproc = 1;
  int nnodes = 1;       // nodes, each running one strata launch
  int node_rank = 0;    // this node's: its ranks are node_rank x nproc ..
  int master_port = 0;  // 0: a free port (one node only)
  bool master_addr_given = false;
  std::string master_addr = "127.0.0.1";
  double grace_s = 10.0;
  std::vector<std::string> command;
};

std::atomic<int> g_forward_signal{0};

void on_signal(int sig) { g_forward_signal.store(sig); }

// A port nobody listens on now (bind to port 0 and ask which one we got).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw IoError("socket", errno, "cannot create a socket to find a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError("127.0.0.1", err, "cannot find a free port");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "strata";
  buf[n] = '\0';
  return buf;
}

struct Rank {
  pid_t pid = -1;
  int out = -1;          // read end of its stdout+stderr
  std::string partial;   // an unfinished output line
  bool running = true;
  int status = 0;        // exit code (128 + signal when killed)
};

// This node's first rank (--node-rank x --nproc): output names global ranks.
int g_first_rank = 0;

void emit(int r, const std::string& line) {
  std::string s = "[rank " + std::to_string(g_first_rank + r) + "] " + line + "\n";
  (void)!::write(STDOUT_FILENO, s.data(), s.size());
}

// Reads what rank r wrote and prints every complete line with its prefix.
// Returns false at end of file.
bool drain(int r, Rank& k) {
  char buf[8192];
  const ssize_t n = ::read(k.out, buf, sizeof(buf));
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  if (n <= 0) {
    if (!k.partial.empty()) emit(r, k.partial);
    k.partial.clear();
    ::close(k.out);
    k.out = -1;
    return false;
  }
  k.partial.append(buf, size_t(n));
  size_t start = 0;
  for (size_t i = 0; i < k.partial.size(); ++i) {
    if (k.partial[i] == '\n') {
      emit(r, k.partial.substr(start, i - start));
      start = i + 1;
    }
  }
  k.partial.erase(0, start);
  return true;
}

void check_launch_options(const LaunchOptions& opt) {
  if (opt.command.empty()) throw ConfigError("command", "give the command after --, e.g. -- strata train CONFIG");
  if (opt.nproc < 1) throw ConfigError("--nproc", "must be at least 1");
  if (opt.nnodes < 1) throw ConfigError("--nnodes", "must be at least 1");
  if (opt.node_rank < 0 || opt.node_rank >= opt.nnodes) {
    throw ConfigError("--node-rank", strprintf("%d is not below --nnodes %d", opt.node_rank, opt.nnodes));
  }
  if (opt.nnodes > 1 && opt.master_port <= 0) {
    throw ConfigError("--master-port", "needed with --nnodes > 1: every node's launch names the same port of "
                                       "node 0 (--master-addr)");
  }
  if (opt.nnodes > 1 && !opt.master_addr_given) {
    throw ConfigError("--master-addr", "needed with --nnodes > 1: node 0's address, the same on every node");
  }
}

// Starts local rank r running `cmd` with the launcher's environment, its
// output into a pipe that the launcher reads.
Rank start_rank(const LaunchOptions& opt, int r, int port, std::vector<std::string>& cmd) {
  int fds[2];
  if (::pipe(fds) != 0) throw IoError("pipe", errno, "cannot create the output pipe of a rank");
  const pid_t pid = ::fork();
  if (pid < 0) throw IoError("fork", errno, "cannot start rank " + std::to_string(r));
  if (pid == 0) {
    // Its own process group, so that stopping a rank stops what it started.
    ::setpgid(0, 0);
    ::close(fds[0]);
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[1]);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    const std::string vars[][2] = {{"RANK", std::to_string(opt.node_rank * opt.nproc + r)},
                                   {"WORLD_SIZE", std::to_string(opt.nnodes * opt.nproc)},
                                   {"LOCAL_RANK", std::to_string(r)},
                                   {"LOCAL_WORLD_SIZE", std::to_string(opt.nproc)},
                                   {"MASTER_ADDR", opt.master_addr},
                                   {"MASTER_PORT", std::to_string(port)}};
    for (const auto& v : vars) ::setenv(v[0].c_str(), v[1].c_str(), 1);
    // torchrun's agent store is not there: every rank but 0 is a client of rank 0's.
    ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
    std::vector<char*> argv;
    for (std::string& a : cmd) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "strata launch: cannot run %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(fds[1]);
  ::setpgid(pid, pid);  // also here: no race with the child's own call
  Rank k;
  k.pid = pid;
  k.out = fds[0];
  return k;
}

// Reads the running ranks' output for up to 100 ms.
void drain_ready(std::vector<Rank>& ranks) {
  std::vector<pollfd> pfds;
  std::vector<int> who;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].out >= 0) {
      pfds.push_back({ranks[r].out, POLLIN, 0});
      who.push_back(int(r));
    }
  }
  if (pfds.empty()) {
    ::usleep(100 * 1000);
    return;
  }
  if (::poll(pfds.data(), pfds.size(), 100) > 0) {
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) drain(who[i], ranks[size_t(who[i])]);
    }
  }
}

// Runs until every rank has exited: their output forwarded, signals passed
// on (a second one as SIGKILL), and the others stopped when one fails
// (SIGTERM, then SIGKILL after --grace-s). Returns the first failed rank, or -1.
int supervise(const LaunchOptions& opt, std::vector<Rank>& ranks) {
  int failed = -1;
  auto stop_at = std::chrono::steady_clock::time_point::max();
  bool killed = false;
  int alive = opt.nproc;
  int forwarded = 0;
  while (alive > 0) {
    drain_ready(ranks);
    // Forward a signal to every rank (once per signal received).
    const int sig = g_forward_signal.exchange(0);
    if (sig != 0) {
      ++forwarded;
      for (Rank& k : ranks) if (k.running) ::kill(-k.pid, forwarded >= 2 ? SIGKILL : sig);
    }
    for (int r = 0; r < opt.nproc; ++r) {
      Rank& k = ranks[size_t(r)];
      if (!k.running) continue;
      int st = 0;
      const pid_t p = ::waitpid(k.pid, &st, WNOHANG);
      if (p != k.pid) continue;
      k.running = false;
      --alive;
      k.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      if (k.status != 0 && failed < 0) {
        failed = r;
        std::fprintf(stderr, "strata launch: rank %d exited with status %d; stopping the other ranks\n",
                     g_first_rank + r, k.status);
        for (Rank& o : ranks) if (o.running) ::kill(-o.pid, SIGTERM);
        stop_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(opt.grace_s * 1000));
      }
    }
    if (!killed && std::chrono::steady_clock::now() >= stop_at) {
      killed = true;
      for (Rank& o : ranks) if (o.running) ::kill(-o.pid, SIGKILL);
    }
  }
  return failed;
}

int run_launch(const LaunchOptions& opt) {
  check_launch_options(opt);
  const int port = opt.master_port > 0 ? opt.master_port : free_port();
  g_first_rank = opt.node_rank * opt.nproc;
  std::vector<std::string> cmd = opt.command;
  // `strata` names this executable, wherever it was built.
  if (cmd[0] == "strata") cmd[0] = self_exe();

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  std::vector<Rank> ranks(size_t(opt.nproc));
  for (int r = 0; r < opt.nproc; ++r) ranks[size_t(r)] = start_rank(opt, r, port, cmd);
  const int failed = supervise(opt, ranks);
  // What the ranks wrote last; whatever they started is stopped with them.
  for (int r = 0; r < opt.nproc; ++r) {
    if (failed >= 0) ::kill(-ranks[size_t(r)].pid, SIGKILL);
    while (ranks[size_t(r)].out >= 0 && drain(r, ranks[size_t(r)])) {
    }
  }
  return failed >= 0 ? ranks[size_t(failed)].status : 0;
}

}  // namespace

void register_launch(CLI::App& app, int& result) {
  auto opt = std::make_shared<LaunchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "launch", "Start N local ranks of a command (e.g. -- strata train CONFIG) with the standard variables");
  cmd->add_option("--nproc", opt->nproc, "Ranks to start on this machine")->required()->check(CLI::PositiveNumber);
  cmd->add_option("--nnodes", opt->nnodes, "Nodes of the run, each running this command (default 1)");
  cmd->add_option("--node-rank", opt->node_rank,
                  "This node's number, 0 .. nnodes - 1: its ranks are node-rank x nproc + 0 .. nproc - 1");
  cmd->add_option("--master-port", opt->master_port, "Port of the rendezvous store (default: a free one)");
  cmd->add_option("--master-addr", opt->master_addr, "Address of rank 0 (default 127.0.0.1; needed with --nnodes > 1)")
      ->each([opt](const std::string&) { opt->master_addr_given = true; });
  cmd->add_option("--grace", opt->grace_s, "Seconds the other ranks get to stop after one failed");
  cmd->add_option("command", opt->command, "The command every rank runs")->required()->expected(-1);
  cmd->prefix_command();
  cmd->callback([opt, &result]() { result = run_launch(*opt); });
}

}  // namespace strata

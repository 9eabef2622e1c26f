// What bench_server's three files share: the options every cell reads, the server process,
// a cell's result, and the cells themselves (bench_server_drive.cpp: the HTTP clients;
// bench_server_peers.cpp: PostgreSQL and etcd beside mep). Not a library: one benchmark.
#pragma once
#include "http_conn.hpp"
#include "stall_probe.hpp"

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace mep::bench::srv {

namespace fs = std::filesystem;

// ---- options (set by bench_server.cpp's run) -----------------------------------------------------

extern std::string g_mep;    // the mep binary
extern std::string g_source; // the source tree (scripts/pg-test-cluster.sh)
extern int g_repeat;         // --repeat: runs of each HTTP cell
extern int g_rounds;         // --rounds: rounds of each mep/etcd pair (0: --repeat's count when above 1, else 3)
extern int g_failed_cells;   // cells with failed requests: the run exits 1
extern double g_seconds;     // seconds per cell

/// --keys VALUE and --driver VALUE; false for a value they do not know.
bool parse_keys(std::string_view v);
bool parse_driver(std::string_view v);
/// "threads" or "epoll", for the table's first lines.
const char* driver_name();

// ---- talking to the server ----------------------------------------------------------------------

// The headers of an API request: the bearer token and an optional Idempotency-Key.
inline std::string api_headers(const std::string& token, const std::string& idem = {}) {
  std::string headers = "Authorization: Bearer " + token + "\r\n";
  if (!idem.empty()) headers += "Idempotency-Key: " + idem + "\r\n";
  return headers;
}

// Keep-alive HTTP to the server with its bearer token and an optional Idempotency-Key.
class Conn {
public:
  explicit Conn(int port) : m_http(mep::bench::HttpConn::tcp(port)), m_port(port) {}
  int port() const { return m_port; }
  std::pair<int, std::string> request(const std::string& method, const std::string& path, const std::string& token,
                                      const std::string& body, const std::string& idem = {}) {
    return m_http.request(method, path, body, api_headers(token, idem));
  }

  mep::bench::HttpConn& raw() { return m_http; }

private:
  mep::bench::HttpConn m_http;
  int m_port;
};

inline std::string field(const std::string& json, const std::string& key) {
  auto k = json.find("\"" + key + "\":");
  if (k == std::string::npos) return {};
  auto v = k + key.size() + 3;
  if (json[v] == '"') return json.substr(v + 1, json.find('"', v + 1) - v - 1);
  return json.substr(v, json.find_first_of(",}", v) - v);
}

// A mep server child process, stopped by its PID when this goes.
struct Server {
  pid_t pid = -1;
  int port = 0;
  ~Server() {
    if (pid > 0) {
      ::kill(pid, SIGTERM);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

/// Starts `mep server --db DB` on a free loopback port and waits until it listens.
void start_server(Server& s, const std::string& db);

// ---- cells ----------------------------------------------------------------------------------------

struct Result {
  double ops_per_s = 0;
  double p50_ms = 0;
  double p99_ms = 0;
  long errors = 0;
  double min_ops = 0; // over the repeats of a cell (--repeat)
  double max_ops = 0;
  mep::bench::Stalls paused; // pauses of the whole machine while the clients ran
};

Result summarize(std::vector<std::vector<double>>& lat, double secs, long errors);

/// The table's name for each workload (Script's modes 0 to 5).
extern const char* const k_workload_titles[6];

// Batched renewals (mode 4): each client holds this many leases and renews them all in one
// renew-batch, as mepd does each tick for the leases due. An operation is one batch.
constexpr int k_batch_leases = 50;

/// Fresh claims: how many memories were registered inside the cells (the pools ran out).
extern std::atomic<long> g_fresh_inline;

/// A name part that differs between runs and processes.
std::string uid();

/// One HTTP cell: `clients` clients of workload `mode` for `seconds`; `at_go` runs when
/// every client is set up, just before they start.
Result run_http_once(int port, const std::string& token, int clients, double seconds, int mode,
                     const std::function<void()>& at_go = {});
/// run_http_once --repeat times: the run with the median rate, and the range of rates.
Result run_http(int port, const std::string& token, int clients, double seconds, int mode);

// ---- peers (bench_server_peers.cpp) --------------------------------------------------------------

std::string with_db(const std::string& admin_url, const std::string& name);
std::string psql(const std::string& url, const std::string& sql);
pid_t postmaster_pid(const std::string& admin_url);
/// "9.6 % (19 pauses over 1 ms, the longest 12.3 ms)".
std::string describe(const mep::bench::Stalls& s);
/// Each workload at 8 and 64 clients, mep (on `s`) next to the private etcd, interleaved.
void compare_with_etcd(Server& s, const std::string& token, const fs::path& dir, double seconds,
                       const std::string& mode, bool postgresql, pid_t db_pid = 0, const std::string& pg_url = {});
/// The PostgreSQL table; false when it could not be made.
bool run_postgresql(const std::string& pg_arg, double seconds, const fs::path& scratch, const std::string& etcd_mode);
/// Stops the private etcd, if one was started (by its PID).
void stop_etcd();

} // namespace mep::bench::srv

// The libcurl client (see client.hpp).
#include "mep/http/client.hpp"

#include <curl/curl.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <exception>
#include <fstream>
#include <stdexcept>
#include <unistd.h>

namespace mep::http {
namespace {

struct CurlGlobal {
  CurlGlobal() { curl_global_init(CURL_GLOBAL_DEFAULT); }
};

struct Exchange {
  CURL* curl = nullptr;
  const ClientRequest* req = nullptr;
  ClientResponse* res = nullptr;
  bool write_failed = false;
  bool cancelled = false;
  std::uint64_t uploaded = 0; // of req->upload_size
  bool upload_short = false;  // the file ended before upload_size
  bool stopped = false;       // on_data said so
  std::exception_ptr thrown;  // by a callback of the caller's, rethrown once libcurl is out
};

size_t on_body(char* p, size_t size, size_t n, void* user) {
  auto* x = static_cast<Exchange*>(user);
  const size_t len = size * n;
  long code = 0;
  curl_easy_getinfo(x->curl, CURLINFO_RESPONSE_CODE, &code);
  if (x->req->on_data) {
    try {
      if (x->req->on_data(std::string_view(p, len))) return len;
      x->stopped = true;
    } catch (...) {
      x->thrown = std::current_exception();
    }
    return 0; // aborts the transfer: CURLE_WRITE_ERROR
  }
  if (x->req->download_fd >= 0 && code >= 200 && code < 300) {
    size_t done = 0;
    while (done < len) {
      ssize_t w = ::write(x->req->download_fd, p + done, len - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        x->write_failed = true;
        return 0; // aborts the transfer: CURLE_WRITE_ERROR
      }
      done += static_cast<size_t>(w);
    }
    x->res->downloaded += len;
    return len;
  }
  x->res->body.append(p, len);
  return len;
}

int on_progress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  auto* x = static_cast<Exchange*>(user);
  try {
    if (x->req->cancelled && x->req->cancelled()) {
      x->cancelled = true;
      return 1; // aborts: CURLE_ABORTED_BY_CALLBACK
    }
  } catch (...) {
    return 0;
  }
  return 0;
}

size_t on_header(char* p, size_t size, size_t n, void* user) {
  auto* x = static_cast<Exchange*>(user);
  std::string_view line(p, size * n);
  if (line.rfind("HTTP/", 0) == 0) {
    x->res->headers.clear(); // a 100 Continue's head, or a new answer: only the last counts
    return size * n;
  }
  if (line == "\r\n" || line == "\n") { // the end of a head
    long code = 0;
    curl_easy_getinfo(x->curl, CURLINFO_RESPONSE_CODE, &code);
    if (code >= 200 && x->req->on_head) {
      try {
        x->req->on_head(static_cast<int>(code));
      } catch (...) {
        x->thrown = std::current_exception();
        return 0; // aborts the transfer
      }
    }
    return size * n;
  }
  auto colon = line.find(':');
  if (colon == std::string_view::npos) return size * n;
  std::string name(line.substr(0, colon));
  for (auto& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' '))
    value.remove_suffix(1);
  x->res->headers.emplace_back(std::move(name), std::string(value));
  return size * n;
}

// Exactly upload_size bytes, the Content-Length sent: a file that grew meanwhile must not
// send more (they would reach the server as the start of another request), and one that
// shrank ends the exchange (the connection with it).
size_t on_upload(char* p, size_t size, size_t n, void* user) {
  auto* x = static_cast<Exchange*>(user);
  const std::uint64_t left = x->req->upload_size - x->uploaded;
  if (left == 0) return 0;
  const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(left, size * n));
  for (;;) {
    ssize_t r = ::read(x->req->upload_fd, p, want);
    if (r > 0) {
      x->uploaded += static_cast<std::uint64_t>(r);
      return static_cast<size_t>(r);
    }
    if (r == 0) {
      x->upload_short = true;
      return CURL_READFUNC_ABORT;
    }
    if (errno != EINTR) return CURL_READFUNC_ABORT;
  }
}

int on_socket_open(void* user, curl_socket_t fd, curlsocktype) {
  auto* x = static_cast<Exchange*>(user);
  try {
    x->req->on_socket(static_cast<int>(fd));
  } catch (...) {
    x->thrown = std::current_exception();
    return CURL_SOCKOPT_ERROR;
  }
  return CURL_SOCKOPT_OK;
}

int on_socket_close(void* user, curl_socket_t fd) {
  auto* x = static_cast<Exchange*>(user);
  try {
    x->req->on_socket(-1); // before the number can be reused
  } catch (...) {
    if (!x->thrown) x->thrown = std::current_exception();
  }
  return ::close(static_cast<int>(fd));
}

bool loopback_host(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "[::1]" || host == "::1";
}

} // namespace

std::optional<std::string> ClientResponse::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (k == name) return v;
  return std::nullopt;
}

std::optional<int> ClientResponse::retry_after() const {
  auto v = header("retry-after");
  if (!v || v->empty() || v->size() > 9 || v->find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoi(*v);
}

Client::Client(std::string ca_file) : m_ca_file(std::move(ca_file)) { static CurlGlobal global; }

std::string checked_ca_file(const std::string& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{} {}: cannot read it: {}", what, path, std::strerror(errno)));
  std::string text(1 << 20, '\0'); // a bundle of the system's size is 200 KiB
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.find("-----BEGIN CERTIFICATE-----") == std::string::npos)
    throw std::runtime_error(fmt::format("{} {}: no PEM certificate in it (-----BEGIN CERTIFICATE-----)", what, path));
  return path;
}

Client::~Client() {
  for (void* c : m_pool) curl_easy_cleanup(static_cast<CURL*>(c));
}

void* Client::acquire() {
  {
    std::lock_guard lock(m_mutex);
    if (!m_pool.empty()) {
      void* c = m_pool.back();
      m_pool.pop_back();
      return c;
    }
  }
  return curl_easy_init();
}

void Client::release(void* c) {
  std::lock_guard lock(m_mutex);
  m_pool.push_back(c);
}

ClientResponse Client::perform(const ClientRequest& req) {
  ClientResponse res;
  auto* c = static_cast<CURL*>(acquire());
  if (!c) {
    res.error = "cannot create an HTTP client handle";
    return res;
  }
  Exchange x;
  x.curl = c;
  x.req = &req;
  x.res = &res;
  curl_slist* headers = nullptr;
  std::vector<std::string> lines;
  lines.reserve(req.headers.size());
  for (const auto& [k, v] : req.headers) {
    lines.push_back(k + ": " + v);
    headers = curl_slist_append(headers, lines.back().c_str());
  }
  curl_easy_reset(c);
  curl_easy_setopt(c, CURLOPT_URL, req.url.c_str());
  if (req.upload_fd >= 0) {
    curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(c, CURLOPT_READFUNCTION, on_upload);
    curl_easy_setopt(c, CURLOPT_READDATA, &x);
    curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(req.upload_size));
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, req.method.c_str());
  } else if (req.method == "POST" || req.method == "PUT" || !req.body.empty()) {
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, req.body.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(req.body.size()));
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, req.method.c_str());
  } else if (req.method == "HEAD") {
    curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  } else {
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, req.method.c_str());
  }
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &x);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &x);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  if (!req.unix_socket.empty()) {
    curl_easy_setopt(c, CURLOPT_UNIX_SOCKET_PATH, req.unix_socket.c_str());
    curl_easy_setopt(c, CURLOPT_PATH_AS_IS, 1L); // the target as the caller wrote it: no /../ squashed
  }
  if (!req.unix_socket.empty() || req.on_socket) {
    curl_easy_setopt(c, CURLOPT_FRESH_CONNECT, 1L);
    curl_easy_setopt(c, CURLOPT_FORBID_REUSE, 1L);
  }
  if (req.on_socket) {
    curl_easy_setopt(c, CURLOPT_SOCKOPTFUNCTION, on_socket_open);
    curl_easy_setopt(c, CURLOPT_SOCKOPTDATA, &x);
    curl_easy_setopt(c, CURLOPT_CLOSESOCKETFUNCTION, on_socket_close);
    curl_easy_setopt(c, CURLOPT_CLOSESOCKETDATA, &x);
  }
  if (req.cancelled) {
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, &x);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
  } else {
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 1L);
  }
  auto connect = req.timeout.count() > 0 ? std::min(req.connect_timeout, req.timeout) : req.connect_timeout;
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(connect.count()));
  if (req.timeout.count() > 0) curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(req.timeout.count()));
  if (req.stall) {
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, static_cast<long>(req.stall->count()));
  }
  curl_easy_setopt(c, CURLOPT_SSLVERSION, static_cast<long>(CURL_SSLVERSION_TLSv1_3));
  if (!m_ca_file.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, m_ca_file.c_str());
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  // libcurl's own words for the failure ("SSL certificate problem: certificate has
  // expired"), not only its code's ("SSL peer certificate or SSH remote key was not OK").
  char detail[CURL_ERROR_SIZE] = "";
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, detail);
  CURLcode rc = curl_easy_perform(c);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, nullptr); // the handle outlives `detail`
  if (rc == CURLE_OK || x.stopped) {
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    res.status = static_cast<int>(code);
  } else {
    res.timed_out = rc == CURLE_OPERATION_TIMEDOUT;
    long os_errno = 0;
    if (curl_easy_getinfo(c, CURLINFO_OS_ERRNO, &os_errno) == CURLE_OK) res.os_errno = static_cast<int>(os_errno);
    res.status = 0;
    res.error = x.write_failed   ? std::string("cannot write the downloaded bytes: ") + std::strerror(errno)
                : x.cancelled    ? std::string("cancelled")
                : x.upload_short ? std::string("the file ended before the size it had when the upload began")
                : detail[0]      ? std::string(detail)
                                 : curl_easy_strerror(rc);
  }
  curl_slist_free_all(headers);
  if (req.on_socket) curl_easy_reset(c); // no callback of this exchange's is left behind
  release(c);
  if (x.thrown) std::rethrow_exception(x.thrown);
  return res;
}

std::string checked_base_url(std::string url, std::string_view what) {
  while (!url.empty() && url.back() == '/') url.pop_back();
  const bool https = url.rfind("https://", 0) == 0;
  const bool plain = url.rfind("http://", 0) == 0;
  if (!https && !plain) throw std::runtime_error(std::string(what) + " must start with https:// or http://");
  if (plain) {
    std::string rest = url.substr(7);
    std::string host = rest.substr(0, rest.find('/'));
    if (!host.empty() && host.front() == '[')
      host = host.substr(0, host.find(']') + 1);
    else
      host = host.substr(0, host.find(':'));
    if (!loopback_host(host))
      throw std::runtime_error("plain http:// is allowed for a loopback " + std::string(what) + " only; use https://");
  }
  return url;
}

} // namespace mep::http

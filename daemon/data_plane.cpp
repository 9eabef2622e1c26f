// The data-plane client (see data_plane.hpp).
#include "mep/data_plane.hpp"

#include "mep/json.hpp"

#include <boost/json/object.hpp>

namespace mep::daemon {

namespace {

Problem store_unavailable(std::string detail) {
  Problem p(Code::store_unavailable, std::move(detail));
  p.retry_after_s = 1;
  return p;
}

std::string unquote(std::string s) {
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') return s.substr(1, s.size() - 2);
  return s;
}

// The data plane over HTTP: `mep store`'s API (SPEC §8).
class RemoteDataPlane final : public DataPlane {
public:
  RemoteDataPlane(const std::string& url, std::string token, const std::string& ca_file)
      : m_url(http::checked_base_url(url, "data-plane URL")), m_token(std::move(token)), m_client(ca_file) {
    if (m_token.empty()) throw std::runtime_error("a data plane needs a token (--store-token-file)");
  }
  expected<std::int64_t, Problem> advance(const std::string& memory_id, std::int64_t token,
                                          std::chrono::milliseconds timeout) override;
  expected<StoredObject, Problem> put(const std::string& memory_id, std::int64_t token, int fd,
                                      std::uint64_t size) override;
  expected<StoredObject, Problem> get(const std::string& memory_id, int fd) override;
  const std::string& url() const override { return m_url; }

private:
  Problem problem_of(const http::ClientResponse& r) const;
  std::string m_url;
  std::string m_token;
  http::Client m_client;
};

} // namespace

std::unique_ptr<DataPlane> make_remote_data_plane(const std::string& url, std::string token,
                                                  const std::string& ca_file) {
  return std::make_unique<RemoteDataPlane>(url, std::move(token), ca_file);
}

// The store's refusal as the agent should see it: its fence and object problems pass
// through; a store that cannot be reached, fails, or does not accept this daemon's token
// is `store-unavailable` (the agent cannot fix that; the operator can).
Problem RemoteDataPlane::problem_of(const http::ClientResponse& r) const {
  if (r.status == 0) return store_unavailable("the data plane at " + m_url + " is unreachable: " + r.error);
  auto o = json::parse_object(r.body);
  Problem p = o && o->contains("code")
                  ? Problem::from_json(*o)
                  : Problem(Code::unavailable, "the data plane answered " + std::to_string(r.status));
  p.instance.clear();
  if (r.status == 401 || r.status == 403)
    return store_unavailable("the data plane refused this daemon's token (check mepd --store-token-file)");
  if (p.code == Code::insufficient_storage) return p;
  if (r.status >= 500) return store_unavailable("the data plane failed: " + p.detail);
  return p;
}

expected<std::int64_t, Problem> RemoteDataPlane::advance(const std::string& memory_id, std::int64_t token,
                                                         std::chrono::milliseconds timeout) {
  http::ClientRequest req;
  req.method = "POST";
  req.url = m_url + "/v1/fence/advance";
  req.headers = {{"Authorization", "Bearer " + m_token}, {"Content-Type", "application/json"}};
  req.body = json::dump(boost::json::object{{"memory_instance_id", memory_id}, {"fencing_token", token}});
  req.timeout = timeout;
  auto res = m_client.perform(req);
  if (!res.ok()) return make_unexpected(problem_of(res));
  auto o = json::parse_object(res.body);
  if (!o || !o->contains("fencing_token") || !o->at("fencing_token").is_int64())
    return make_unexpected(store_unavailable("the data plane's answer to fence/advance is not the API's"));
  return o->at("fencing_token").get_int64();
}

expected<StoredObject, Problem> RemoteDataPlane::put(const std::string& memory_id, std::int64_t token, int fd,
                                                     std::uint64_t size) {
  http::ClientRequest req;
  req.method = "PUT";
  req.url = m_url + "/v1/objects/" + memory_id;
  req.headers = {{"Authorization", "Bearer " + m_token},
                 {"Fencing-Token", std::to_string(token)},
                 {"Content-Type", "application/octet-stream"}};
  req.upload_fd = fd;
  req.upload_size = size;
  req.timeout = std::chrono::milliseconds(0);
  req.stall = std::chrono::seconds(30);
  auto res = m_client.perform(req);
  if (!res.ok()) return make_unexpected(problem_of(res));
  auto o = json::parse_object(res.body);
  if (!o) return make_unexpected(store_unavailable("the data plane's answer to PUT is not the API's"));
  StoredObject obj{memory_id, token, unquote(res.header("etag").value_or("")), size};
  if (auto* e = o->if_contains("etag"); e && e->is_string()) obj.etag = std::string(e->get_string());
  return obj;
}

expected<StoredObject, Problem> RemoteDataPlane::get(const std::string& memory_id, int fd) {
  http::ClientRequest req;
  req.url = m_url + "/v1/objects/" + memory_id;
  req.headers = {{"Authorization", "Bearer " + m_token}};
  req.download_fd = fd;
  req.timeout = std::chrono::milliseconds(0);
  req.stall = std::chrono::seconds(30);
  auto res = m_client.perform(req);
  if (!res.ok()) return make_unexpected(problem_of(res));
  StoredObject obj;
  obj.memory_id = memory_id;
  obj.etag = unquote(res.header("etag").value_or(""));
  obj.size = res.downloaded;
  try {
    obj.fencing_token = std::stoll(res.header("fencing-token").value_or("0"));
  } catch (...) {
    obj.fencing_token = 0;
  }
  return obj;
}

} // namespace mep::daemon

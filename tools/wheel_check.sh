#!/usr/bin/env bash
# kvfork installed outside the checkout, as a user gets it (CI runs this; a few minutes with a warm pip cache):
# build the wheel from a clean copy, check its top level holds `kvfork` alone, install it into a fresh virtual
# environment without pip (as uv and pipx make them), and there, from a folder that is not the checkout, run
# `kvfork --version`, `kvfork fetch-model` (into $KVFORK_HOME, the test run's: fetched once), a build of the CPU's
# int8/int4 kernel from the wheel's source, and one chat completion from `kvfork serve` on the default model.
#   tools/wheel_check.sh [PYTHON]    PYTHON builds and installs (its pip); default: the checkout's .venv
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d)
SERVER=
cleanup() {
    if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
say() { echo "wheel_check: $*" >&2; }

mkdir "$WORK/src" "$WORK/dist" "$WORK/elsewhere"
# A clean copy: an in-tree build/ may hold files a wheel built before left behind.
tar -C "$ROOT" --exclude=.git --exclude=.venv --exclude=./build --exclude='*.egg-info' --exclude=__pycache__ \
    -cf - . | tar -C "$WORK/src" -xf -
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(echo "$WORK"/dist/kvfork-*.whl)
TOP=$("$PY" -c 'import sys, zipfile; print(" ".join(sorted({n.split("/")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()})))' "$WHEEL")
case "$TOP" in
    "kvfork kvfork-"*".dist-info") say "the wheel's top level: $TOP" ;;
    *) say "FAILED: the wheel's top level holds more than kvfork: $TOP"; exit 1 ;;
esac

"$PY" -m venv --without-pip "$WORK/venv"
"$PY" -m pip --python "$WORK/venv/bin/python" install -q "$WHEEL"
BIN=$WORK/venv/bin
cd "$WORK/elsewhere"   # from here on, nothing of the checkout is on any path
if "$BIN/python" -c 'import pip' 2>/dev/null; then say "FAILED: the fresh environment has pip"; exit 1; fi
FROM=$("$BIN/python" -c 'import kvfork.server; print(kvfork.server.__file__)')
case "$FROM" in "$WORK/venv/"*) ;; *) say "FAILED: kvfork.server comes from $FROM, not the wheel"; exit 1 ;; esac

VERSION=$("$BIN/kvfork" --version)
say "$VERSION, from $FROM"
MODEL=$("$BIN/kvfork" fetch-model)
say "the default model: $MODEL"
# the wheel ships kv_reading.c, which the CPU's int8/int4 reading compiles where it runs (a temporary home)
KERNEL=$(KVFORK_HOME="$WORK/home" "$BIN/python" -c 'import shutil
from kvfork.backends import kv_reading
print("built" if kv_reading.library() else "not built (no cc)" if shutil.which("cc") is None else "FAILED")')
case "$KERNEL" in FAILED) say "FAILED: kv_reading.c did not build from the wheel"; exit 1 ;; esac
say "kv_reading.c from the wheel: $KERNEL"

"$BIN/kvfork" serve --port 0 >"$WORK/serve.log" 2>&1 &
SERVER=$!
"$BIN/python" - "$WORK/serve.log" <<'EOF'
import json, re, sys, time, urllib.error, urllib.request

log, deadline = sys.argv[1], time.monotonic() + 300
url = None
while time.monotonic() < deadline:
    text = open(log).read()
    url = url or (m.group(1) if (m := re.search(r"listening on (http://\S+)", text)) else None)
    if url:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            break
        except (urllib.error.URLError, OSError):
            pass
    time.sleep(0.5)
else:
    sys.exit(f"wheel_check: FAILED: kvfork serve did not become healthy in 300 s:\n{open(log).read()}")
body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
        "temperature": 0}
request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=120))
content = reply["choices"][0]["message"]["content"]
assert content and reply["usage"]["completion_tokens"] > 0, reply
print(f"wheel_check: one chat completion from {url}: {content!r}", file=sys.stderr)
EOF
say "passed"

#!/usr/bin/env bash
# The install path a stranger takes, checked: `.ci/outside` is copied out of the tree and
# built against the packaged crates (`target/package/*.crate`, made by `cargo publish
# --dry-run` or `cargo package`), never against the workspace's paths. It runs the root
# README's quickstart on a real Redis and Kafka-protocol broker, and the published
# conformance suite on idem-conformance's example backend; that backend broken on purpose
# must fail the suite.
#
#   eval "$(scripts/services up)"; cargo package --workspace --no-verify; .ci/outside.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
: "${IDEM_REDIS_URL:?run eval \"\$(scripts/services up)\" first}"
: "${IDEM_KAFKA_BROKERS:?run eval \"\$(scripts/services up)\" first}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/crates"

# The publishable crates of the workspace, each from its packaged .crate file.
names=$(cd "$root" && cargo metadata --format-version 1 --no-deps | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["publish"] != []:
        print(p["name"], p["version"])')
patch=$'\n[patch.crates-io]\n'
while read -r name version; do
  crate="$target/package/$name-$version.crate"
  [ -f "$crate" ] || { echo "outside: $crate is missing: run cargo package --workspace" >&2; exit 1; }
  tar -xzf "$crate" -C "$work/crates"
  patch+="$name = { path = \"$work/crates/$name-$version\" }"$'\n'
done <<< "$names"

cp -r "$root/.ci/outside" "$work/outside"
# The backend author's worked example, as idem-conformance publishes it: a backend of its
# own and the suite on it.
conformance=$(ls -d "$work"/crates/idem-conformance-*)
mkdir -p "$work/outside/tests"
cp "$conformance/examples/map_backend.rs" "$work/outside/tests/conformance.rs"
printf '%s' "$patch" >> "$work/outside/Cargo.toml"
# The same versions of every dependency as the workspace's lock, so the shared target
# directory already holds them.
cp "$root/Cargo.lock" "$work/outside/Cargo.lock"
# The quickstart, verbatim: the first rust block under "## Quickstart", without the lines
# rustdoc hides.
mkdir -p "$work/outside/src/bin"
awk '/^## Quickstart/ { q = 1 } q && /^```rust/ { f = 1; next } f && /^```/ { exit } f' \
  "$root/README.md" | grep -v '^#\( \|$\)' > "$work/outside/src/bin/quickstart.rs"
[ -s "$work/outside/src/bin/quickstart.rs" ] || { echo "outside: no quickstart in README.md" >&2; exit 1; }

cd "$work/outside"
export CARGO_TARGET_DIR="$target"
echo "== outside: the quickstart and the published suite on a backend of its own"
REDIS_URL=$IDEM_REDIS_URL KAFKA_BROKERS=$IDEM_KAFKA_BROKERS cargo test

echo "== outside: the suite must fail a broken copy of that backend"
# A case the broken backend leaves waiting fails after 30 s instead of the default 600.
if IDEM_CONFORMANCE_CASE_SECS=30 IDEM_CONFORMANCE_BREAK=1 cargo test --test conformance \
  > "$work/broken.log" 2>&1; then
  echo "outside: the suite passed a backend that grants every claim" >&2
  exit 1
fi
if ! grep -q '^test result: FAILED' "$work/broken.log"; then
  tail -30 "$work/broken.log" >&2
  echo "outside: the broken backend did not fail a test (did it build?)" >&2
  exit 1
fi
echo "outside: the broken backend fails: $(grep -c '^test .* FAILED$' "$work/broken.log") cases:"
grep '^test .* FAILED$' "$work/broken.log" | sed 's/^test /  /; s/ \.\.\. FAILED$//'

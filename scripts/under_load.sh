#!/usr/bin/env bash
# Run a command while every core is kept busy by another process: how `make test` is shown to
# pass on a machine that is doing other work (CI runs on the developer's own machine).
# Usage: scripts/under_load.sh make test
# The hog is stress-ng (Debian's package) when installed, else one busy Python loop per core;
# it runs at normal priority for the whole command and is stopped when the command ends.
set -euo pipefail
if [ "$#" -eq 0 ]; then
    echo "usage: $0 COMMAND [ARGS...]" >&2
    exit 2
fi
cores=$(nproc)
if command -v stress-ng >/dev/null 2>&1; then
    stress-ng --cpu "$cores" --quiet &
else
    python3 -c "
import multiprocessing
def spin():
    while True:
        pass
for _ in range($cores):
    multiprocessing.Process(target=spin, daemon=False).start()
" &
fi
hog=$!
trap 'pkill -P $hog 2>/dev/null; kill $hog 2>/dev/null; wait $hog 2>/dev/null || true' EXIT
echo "under load: $cores busy loops beside '$*'" >&2
"$@"

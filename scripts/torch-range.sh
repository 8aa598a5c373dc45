#!/usr/bin/env bash
# Run a default bake's whole test suite on each torch version given, each in a venv of its own:
#
#   scripts/torch-range.sh                # the floor the bake's pyproject.toml declares (its newest
#                                         # patch release) and the newest torch pip installs
#   scripts/torch-range.sh 2.9.1 2.14.1   # these versions
#
# Prints one line per version: tests passed, failed, skipped, and the wall time; the exit status
# is 1 when a version failed. The venvs stay in $TORCH_RANGE_DIR (default $TMPDIR/torch-range),
# one per version, for the next run: on Linux x86_64 pip takes a CUDA build of several GB for
# each. Each venv gets the bake with its [dev,all] extras, torch held to its version. The suite
# runs as the template's own test of the bake does (2 workers, one file each); PYTEST_ARGS
# replaces those arguments. Needs python3 and a package index; the template's .venv
# (scripts/setup.sh) bakes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${TORCH_RANGE_DIR:-${TMPDIR:-/tmp}/torch-range}"
pytest_args="${PYTEST_ARGS:--n 2 --dist loadfile}"
mkdir -p "$work"
bash "$root/scripts/setup.sh"

rm -rf "$work/bake"
"$root/.venv/bin/cookiecutter" "$root" --no-input -o "$work/bake" >/dev/null
project="$(find "$work/bake" -mindepth 1 -maxdepth 1 -type d)"

# The versions, as pip requirements: the arguments, or the floor and plain `torch`.
specs=()
for version in "$@"; do specs+=("torch==$version"); done
if [[ ${#specs[@]} -eq 0 ]]; then
  floor="$(python3 -c 'import re, sys
text = open(sys.argv[1]).read()
print(re.search(r"\"torch\s*>=\s*([0-9.]+)", text).group(1))' "$project/pyproject.toml")"
  specs=("torch==$floor.*" "torch")
fi

# The release pip picks for a requirement (a dry run in a venv of its own, as a user's).
resolver="$work/resolver"
[[ -x "$resolver/bin/python" ]] || python3 -m venv "$resolver"
resolve() {
  "$resolver/bin/python" -m pip install --dry-run --quiet --ignore-installed \
    --report "$work/resolved.json" "$1" >/dev/null 2>&1 || return 1
  python3 -c 'import json, sys
print(next(item["metadata"]["version"] for item in json.load(open(sys.argv[1]))["install"]
           if item["metadata"]["name"] == "torch"))' "$work/resolved.json"
}

status=0
for spec in "${specs[@]}"; do
  if ! version="$(resolve "$spec")"; then
    echo "torch ($spec): pip finds no such release here"
    status=1
    continue
  fi
  venv="$work/torch-$version"
  log="$work/torch-$version.log"
  echo "torch==$version" >"$work/torch-$version.txt"
  {
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet -c "$work/torch-$version.txt" "torch==$version"
    "$venv/bin/python" -m pip install --quiet -c "$work/torch-$version.txt" -e "${project}[dev,all]"
  } >"$log" 2>&1 || { echo "torch $version: install failed (see $log)"; status=1; continue; }
  start=$SECONDS
  # pytest with SIGHUP at its default: under nohup it is ignored, and the run.sh a test starts
  # would inherit that and could not trap the SIGHUP the test sends it.
  # shellcheck disable=SC2086  # pytest_args: several words
  (cd "$project" && PATH="$venv/bin:$PATH" PYTHON="$venv/bin/python" "$venv/bin/python" -c \
    'import signal, sys, pytest; signal.signal(signal.SIGHUP, signal.SIG_DFL); sys.exit(pytest.main())' \
    -q -p no:cacheprovider -rfEs $pytest_args) >>"$log" 2>&1 || status=1
  wall=$((SECONDS - start))
  python3 - "$log" "$version" "$wall" <<'EOF'
import re, sys
log, version, wall = sys.argv[1], sys.argv[2], int(sys.argv[3])
last = [line for line in open(log, errors="replace") if re.search(r" in [0-9.]+s", line)]
counts = dict.fromkeys(("passed", "failed", "error", "skipped"), 0)
for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last[-1] if last else ""):
    counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
print(f"torch {version}: {counts['passed']} passed, {counts['failed']} failed, "
      f"{counts['error']} errors, {counts['skipped']} skipped in {wall // 60} min {wall % 60} s "
      f"(log: {log})")
EOF
done
exit "$status"

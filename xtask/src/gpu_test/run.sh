#!/usr/bin/env bash
# Runs cuweave's GPU tests or benches from this bundle. Written by `cargo xtask gpu-test`.
#
#   ./run [--quiet] [ARGS...]   every test binary in tests/ with --test-threads=1 ARGS (ARGS: a test
#                               name filter, --ignored, ...); --quiet keeps passing output in logs/ only.
#                               Last line: gpu-test: DEVICE passed=N failed=N skipped=N
#   ./run --sanitize [ARGS...]  every test binary under compute-sanitizer --tool memcheck
#                               --leak-check full, with CUWEAVE_SANITIZE=1 (tests that need two streams
#                               at once skip), and CUWEAVE_EMPTY_CACHES_AT_EXIT=1 (the process-wide
#                               caches give their memory back at exit). Memory errors and leaks are
#                               counted apart from the CUDA API errors tests provoke on purpose;
#                               errors or leaks fail the run. Leaks of memory NCCL allocated itself
#                               are counted apart (nccl-leaks) and do not.
#                               Last line: gpu-test --sanitize: DEVICE passed=N failed=N skipped=N
#                               memory-errors=N leaks=N nccl-leaks=N api-errors=N
#   ./run --bench [FILTER...]   every criterion binary in benches/ with --bench FILTER
#   ./run --info [ARGS...]      bin/cuweave info ARGS
#
# CUWEAVE_REQUIRE_GPU=1 is exported, so a test that finds no GPU fails instead of skipping, and
# NCCL_NVLS_ENABLE=0 unless set, so NCCL never turns NVLink multicast on.
# Each test binary may run CUWEAVE_BINARY_TIMEOUT seconds (default 600) before it is killed and
# counted as failed.
# Logs go to logs/ beside this script and, when $OUT is set, into one $OUT/gpu-<mode>.log
# (test, sanitize, bench or info).
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CUWEAVE_REQUIRE_GPU=1
# NVLink multicast (NVLink SHARP) stays off on the lent machines; NCCL would use it on its own.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export CRITERION_HOME="${CRITERION_HOME:-$here/criterion}"
logs="$here/logs"

mode=test
quiet=0
sanitize=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) mode=bench; shift ;;
    --sanitize) sanitize=1; shift ;;
    --info) mode=info; shift ;;
    --quiet) quiet=1; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done

device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
device="$(printf '%s' "$device" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//')"
[ -n "$device" ] || device="unknown-device"

rm -rf "$logs"
mkdir -p "$logs"

# $OUT (set on the GPU machine) gets one combined log, not one file per binary: what comes back
# from there is limited in file count. (Test runs append to it binary by binary: out_append.)
copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" || return 0
    for log in "$logs"/*.log; do
      echo "===== $(basename "$log" .log)"
      cat "$log"
    done >"$OUT/gpu-${logname:-$mode}.log" 2>/dev/null
    if [ "$mode" = bench ] && [ -d "$CRITERION_HOME" ]; then
      tar -czf "$OUT/criterion.tar.gz" -C "$(dirname "$CRITERION_HOME")" \
        "$(basename "$CRITERION_HOME")" 2>/dev/null
    fi
  fi
  return 0
}

now_ms() { date +%s%3N; }

shopt -s nullglob

if [ "$mode" = info ]; then
  if [ ! -x "$here/bin/cuweave" ]; then
    echo "run: this bundle has no bin/cuweave" >&2
    exit 1
  fi
  "$here/bin/cuweave" info "$@" 2>&1 | tee "$logs/info.log"
  status=${PIPESTATUS[0]}
  copy_out
  exit "$status"
fi

if [ "$mode" = bench ]; then
  benches=("$here"/benches/*)
  if [ ${#benches[@]} -eq 0 ]; then
    echo "run: this bundle has no bench binaries" >&2
    exit 1
  fi
  echo "bench: $device"
  status=0
  for bin in "${benches[@]}"; do
    name="$(basename "$bin")"
    echo "== $name"
    "$bin" --bench "$@" 2>&1 | tee "$logs/$name.log"
    code=${PIPESTATUS[0]}
    if [ "$code" -ne 0 ]; then
      echo "run: $name exited with status $code" >&2
      status=1
    fi
  done
  copy_out
  exit "$status"
fi

# The hardware has CUDA_DEVICE_MAX_CONNECTIONS work queues (8 unless set); streams beyond that
# share one and serialize, which would hide the concurrency that ordering tests must provoke.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"

# Under --sanitize every binary runs under memcheck. API errors (a test that provokes
# CUDA_ERROR_INVALID_VALUE on purpose) are reported by the tool but are not memory errors, so the
# log is split: "Program hit CUDA_ERROR_*" lines are API errors, leak reports are leaks, and every
# other memcheck error record (invalid reads and writes, misaligned or out-of-range accesses,
# hardware exceptions, malloc/free errors) is a memory error.
runner=()
label="gpu-test"
if [ "$sanitize" = 1 ]; then
  tool="$(command -v compute-sanitizer 2>/dev/null)"
  for candidate in "${CUDA_HOME:-}/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer \
      /usr/local/cuda/compute-sanitizer/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
    [ -n "$tool" ] && break
    [ -x "$candidate" ] && tool="$candidate"
  done
  if [ -z "$tool" ]; then
    echo "run: --sanitize needs compute-sanitizer (on PATH, in \$CUDA_HOME/bin or /usr/local/cuda/bin)" >&2
    exit 1
  fi
  export CUWEAVE_SANITIZE=1
  runner=("$tool" --tool memcheck --leak-check full --report-api-errors all --print-limit 10000)
  label="gpu-test --sanitize"
  logname=sanitize
  mem_total=0; leak_total=0; api_total=0; nccl_total=0
  # Memory the process-wide caches (the default caching allocators) hold at exit is not lost:
  # they give it back when the process exits, so that what memcheck reports is real leaks.
  export CUWEAVE_EMPTY_CACHES_AT_EXIT=1
  memcheck_issues=()
fi
mem_re='^========= (Invalid |Misaligned |Out-of-range |Hardware [Ee]xception|Malloc/Free [Ee]rror|Uninitialized|Barrier error|Race|Device-side assert|Illegal )'
leak_re='^========= Leaked [0-9,]+ bytes'
api_re='^========= Program hit '

# A hung binary (a collective whose peer never comes, a kernel that never ends) must not eat the
# whole run: each binary gets CUWEAVE_BINARY_TIMEOUT seconds (default 600), then is killed and
# counted as failed, naming the test that was running.
limit="${CUWEAVE_BINARY_TIMEOUT:-600}"
guard=()
if command -v timeout >/dev/null 2>&1; then
  guard=(timeout -k 10 "$limit")
fi

tests=("$here"/tests/*)
passed=0
failed=0
skipped=0
summaries=()
failures=()

# A test run appends each finished binary's log to $OUT's combined log, and its summary line to
# gpu-<mode>-summary.txt, as it goes: a run stopped at the machine's time limit (which kills
# `run` and every pipe reading it) still brings back everything that finished.
out_log=""
if [ -n "${OUT:-}" ] && mkdir -p "$OUT"; then
  out_log="$OUT/gpu-${logname:-$mode}.log"
  : >"$out_log"
  : >"${out_log%.log}-summary.txt"
fi
out_append() { # NAME LOG SUMMARY
  [ -n "$out_log" ] || return 0
  { echo "===== $1"; cat "$2"; } >>"$out_log" 2>/dev/null
  printf '%s\n' "$3" >>"${out_log%.log}-summary.txt" 2>/dev/null
  return 0
}
for bin in ${tests[@]+"${tests[@]}"}; do
  [ -f "$bin" ] && [ -x "$bin" ] || continue
  name="$(basename "$bin")"
  log="$logs/$name.log"
  echo "== $name"
  start=$(now_ms)
  if [ "$quiet" = 1 ]; then
    ${guard[@]+"${guard[@]}"} ${runner[@]+"${runner[@]}"} "$bin" --test-threads=1 "$@" >"$log" 2>&1
    code=$?
  else
    ${guard[@]+"${guard[@]}"} ${runner[@]+"${runner[@]}"} "$bin" --test-threads=1 "$@" 2>&1 | tee "$log"
    code=${PIPESTATUS[0]}
    # A binary that died mid-line (after "test NAME ... ") would glue our verdict onto that line.
    [ -z "$(tail -c 1 "$log")" ] || echo
  fi
  ms=$(( $(now_ms) - start ))

  p=0; f=0; i=0; results=0; running=""
  re='test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored;'
  while IFS= read -r line || [ -n "$line" ]; do
    if [[ $line =~ $re ]]; then
      p=$(( p + BASH_REMATCH[1] ))
      f=$(( f + BASH_REMATCH[2] ))
      i=$(( i + BASH_REMATCH[3] ))
      results=$(( results + 1 ))
    elif [[ $line =~ ^test\ (.+)\ \.\.\.\ FAILED$ ]]; then
      failures+=("$name: ${BASH_REMATCH[1]}")
      running=""
    elif [[ $line =~ ^test\ (.+)\ \.\.\.\ (ok|ignored.*)$ ]] || [ "$line" = ok ]; then
      running=""
    elif [[ $line =~ ^test\ (.+)\ \.\.\.\  ]]; then
      # A test that started and has not reported yet: if the binary dies, it died here.
      running="${BASH_REMATCH[1]}"
    fi
  done <"$log"
  # libtest prints "test NAME ... " before running a test, so a skip note lands mid-line; count
  # occurrences anywhere, not lines starting with it.
  s=$(grep -o 'SKIPPED [^ ]*: ' "$log" | wc -l | tr -d ' ')
  [ "$s" -le "$p" ] || s=$p
  p=$(( p - s ))
  i=$(( i + s ))

  note=""
  if [ "$results" -eq 0 ]; then
    if [ "$code" -eq 0 ]; then
      # Not a libtest binary (harness = false): its exit status is its one result.
      p=$(( p + 1 ))
      note=" (no libtest summary; counted by exit status)"
    else
      f=$(( f + 1 ))
      if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
        failures+=("$name: killed after ${limit}s (CUWEAVE_BINARY_TIMEOUT) during ${running:-its start}")
      elif [ -n "$running" ]; then
        failures+=("$name: exited with status $code during $running")
      else
        failures+=("$name: exited with status $code before reporting a result")
      fi
      note=" (exited with status $code, no test result)"
    fi
  elif [ "$code" -ne 0 ] && [ "$f" -eq 0 ]; then
    f=1
    failures+=("$name: exited with status $code after all tests passed")
    note=" (exited with status $code after its tests)"
  fi
  if [ "$f" -eq 0 ]; then verdict=ok; else verdict=FAIL; fi
  if [ "$quiet" = 1 ] && [ "$f" -ne 0 ]; then
    cat "$log"
  fi

  if [ "$sanitize" = 1 ]; then
    # A binary that never calls CUDA (pure unit tests) makes the tool exit non-zero with this
    # note; its own result is what libtest printed.
    if [ "$code" -ne 0 ] && [ "$f" -le 1 ] && [ "$results" -gt 0 ] \
        && grep -q 'Target application terminated before first instrumented API call' "$log" \
        && grep -q '^test result: ok\.' "$log"; then
      f=0; verdict=ok
      failures=("${failures[@]:0:${#failures[@]}-1}")
      note=" (no CUDA calls; nothing for memcheck to check)"
    fi
    m=$(grep -E -c "$mem_re" "$log")
    l=$(grep -E -c "$leak_re" "$log")
    a=$(grep -E -c "$api_re" "$log")
    # Leaks whose allocation NCCL made (the first host frame past the driver is in libnccl):
    # NCCL's own memory, counted and shown, but not cuweave's to free.
    n=$(awk -v leak="$leak_re" '
      $0 ~ leak { open = 1; next }
      open && /Host Frame:/ && !/libcuda\.so/ { if (/libnccl/) count++; open = 0 }
      END { print count + 0 }' "$log")
    l=$(( l - n ))
    mem_total=$(( mem_total + m )); leak_total=$(( leak_total + l )); api_total=$(( api_total + a ))
    nccl_total=$(( nccl_total + n ))
    note="$note memcheck: memory-errors=$m leaks=$l nccl-leaks=$n api-errors=$a"
    if [ "$m" -ne 0 ] || [ "$l" -ne 0 ]; then
      verdict=FAIL
      memcheck_issues+=("$name: $m memory errors, $l leaks")
      grep -E -A6 "$mem_re|$leak_re" "$log" | head -40
    fi
    # The API errors, by name and count: expected from tests that check typed errors.
    grep -E -o "$api_re[^ ]+( \([^)]*\))?" "$log" | sed 's/^========= Program hit //' \
      | sort | uniq -c | sed 's/^/    api: /'
  fi
  summary=$(printf '%-4s %-48s passed=%d failed=%d skipped=%d %d.%03ds%s' \
    "$verdict" "$name" "$p" "$f" "$i" $(( ms / 1000 )) $(( ms % 1000 )) "$note")
  echo "$summary"
  summaries+=("$summary")
  passed=$(( passed + p ))
  failed=$(( failed + f ))
  skipped=$(( skipped + i ))
  out_append "$name" "$log" "$summary"
done

echo
echo "== summary"
for line in ${summaries[@]+"${summaries[@]}"}; do
  echo "$line"
done
if [ ${#failures[@]} -gt 0 ]; then
  echo "failures:"
  for line in "${failures[@]}"; do
    echo "  $line"
  done
fi
if [ ${#summaries[@]} -eq 0 ]; then
  echo "run: this bundle has no test binaries" >&2
  failed=$(( failed + 1 ))
fi
if [ "$sanitize" = 1 ]; then
  if [ ${#memcheck_issues[@]} -gt 0 ]; then
    echo "memcheck:"
    for line in "${memcheck_issues[@]}"; do
      echo "  $line"
    done
  fi
  echo "$label: $device passed=$passed failed=$failed skipped=$skipped memory-errors=$mem_total leaks=$leak_total nccl-leaks=$nccl_total api-errors=$api_total"
  [ "$failed" -eq 0 ] && [ "$mem_total" -eq 0 ] && [ "$leak_total" -eq 0 ]
  exit
fi
echo "$label: $device passed=$passed failed=$failed skipped=$skipped"
[ "$failed" -eq 0 ]

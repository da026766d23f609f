# Sourced by the script tests: a scratch folder removed on exit ($work), check NAME CONDITION...
# (prints ok/FAIL and counts failures) and finish (the count, and the exit status).
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
check() {
  local name=$1
  shift
  if "$@"; then echo "ok   $name"; else echo "FAIL $name"; failures=$((failures + 1)); fi
}
finish() {
  [ "$failures" -eq 0 ] || { echo "$failures check(s) failed"; exit 1; }
  echo "all checks passed"
}

#!/bin/sh
# tests/gtest_main.cc, each suite of tests/gtest_main_test.cc run alone (as CTest runs each case) and
# classified by CTest's rule for our test programs: skipped when the output has "[  SKIPPED ]"
# (SKIP_REGULAR_EXPRESSION, which wins over the exit status), else passed on exit status 0, else
# failed. A case whose suite's SetUpTestSuite failed must come out failed: GoogleTest's own printer
# marks it "[  SKIPPED ]" (exit status 1), which CTest reported as a skip.
# usage: gtest_main_test.sh PATH/TO/gtest_main_test
program=${1:?usage: gtest_main_test.sh PATH/TO/gtest_main_test}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
failed=0
for expect in Passes:passed Skips:skipped SetUpTestSuiteFails:failed Fails:failed; do
  suite=${expect%:*}
  want=${expect#*:}
  "$program" --gtest_filter="$suite.*" >"$out" 2>&1
  status=$?
  if grep -q '\[  SKIPPED \]' "$out"; then got=skipped; elif [ "$status" = 0 ]; then got=passed; else got=failed; fi
  echo "$suite: $got (exit status $status), expected $want"
  if [ "$got" != "$want" ]; then failed=1; cat "$out"; fi
done
exit $failed

#!/bin/sh
# tests/gtest_main.cc, each suite of tests/gtest_main_test.cc run alone (as CTest runs each case) and
# classified by CTest's rule for our test programs: skipped on exit status 77 (SKIP_RETURN_CODE),
# passed on 0, failed on anything else. A case whose suite's SetUpTestSuite failed must come out
# failed (GoogleTest's own printer marks it "[  SKIPPED ]"), and so must a skipped case after which
# something fails (a suite's tear-down; an abort at exit, as a sanitizer's report gives): reading
# "[  SKIPPED ]" in the output, as CTest did, reported both as skips.
# usage: gtest_main_test.sh PATH/TO/gtest_main_test
program=${1:?usage: gtest_main_test.sh PATH/TO/gtest_main_test}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
failed=0
for expect in Passes:passed Skips:skipped SetUpTestSuiteFails:failed Fails:failed SkipsThenTearDownFails:failed \
              SkipsThenAbortsAtExit:failed; do
  suite=${expect%:*}
  want=${expect#*:}
  "$program" --gtest_filter="$suite.*" >"$out" 2>&1
  status=$?
  if [ "$status" = 77 ]; then got=skipped; elif [ "$status" = 0 ]; then got=passed; else got=failed; fi
  echo "$suite: $got (exit status $status), expected $want"
  if [ "$got" != "$want" ]; then failed=1; cat "$out"; fi
done
exit $failed

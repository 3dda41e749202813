#!/usr/bin/env python3
"""tests/cli_check.py's SHARDSERVE_TEST_TIME_SCALE (its rule is tools/ci/launch_process.py's, which the tools
the tests run use too): the same rule and the same message as tests/process_harness.h's (HarnessTest.TimeScaleIsADecimalFrom1To1000 checks the C++ side with these
values), and a refused value ends the test that imports it. Stdlib only.

usage: cli_check_test.py
"""
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cli_check import parse_time_scale, time_scale_error  # noqa: E402

REFUSED = ["0", "0.5", "0.99", "1000.5", "1001", "-3", "abc", "3x", " 3", "3 ", "1e2", "inf", "nan", "1.", ".5",
           "1_000", "0x10", "+3"]


class TimeScaleTest(unittest.TestCase):
    def test_a_decimal_from_1_to_1000(self):
        self.assertEqual(parse_time_scale(""), 1.0)
        self.assertEqual(parse_time_scale("1"), 1.0)
        self.assertEqual(parse_time_scale("3"), 3.0)
        self.assertEqual(parse_time_scale("2.5"), 2.5)
        self.assertEqual(parse_time_scale("1000"), 1000.0)

    def test_anything_else_is_refused(self):
        for text in REFUSED:
            with self.subTest(text=text), self.assertRaises(ValueError) as refused:
                parse_time_scale(text)
            self.assertEqual(str(refused.exception), time_scale_error(text))
        self.assertEqual(time_scale_error("0.5"),
                         "SHARDSERVE_TEST_TIME_SCALE='0.5': expected a number from 1 to 1000 (1 = unscaled)")

    def test_a_refused_value_ends_the_importing_test(self):
        def run(scale):
            return subprocess.run([sys.executable, "-c", "import cli_check; print(cli_check.scaled(10))"], cwd=HERE,
                                  env=dict(os.environ, SHARDSERVE_TEST_TIME_SCALE=scale), capture_output=True,
                                  text=True, timeout=60)
        bad = run("0.5")
        self.assertEqual(bad.returncode, 1)
        self.assertEqual(bad.stdout, "")
        self.assertEqual(bad.stderr, time_scale_error("0.5") + "\n")
        good = run("3")
        self.assertEqual((good.returncode, good.stdout), (0, "30.0\n"), good.stderr)

    def test_one_rule_for_the_tests_and_the_tools_they_run(self):
        # tools/ci/launch_process.py holds the rule; cli_check re-exports it, and the tools that wait on
        # clusters (gpu_layouts_check.py, chaos_bench.py) scale their deadlines by it.
        import cli_check
        import launch_process
        self.assertIs(cli_check.parse_time_scale, launch_process.parse_time_scale)
        self.assertIs(cli_check.time_scale_error, launch_process.time_scale_error)
        tool = os.path.join(os.path.dirname(HERE), "tools", "gpu", "gpu_layouts_check.py")
        bad = subprocess.run([sys.executable, tool, "--bin", HERE, "--model", HERE],
                             env=dict(os.environ, SHARDSERVE_TEST_TIME_SCALE="0.5"), capture_output=True, text=True,
                             timeout=60)
        self.assertEqual(bad.returncode, 2)
        self.assertIn(time_scale_error("0.5"), bad.stderr)


if __name__ == "__main__":
    unittest.main()

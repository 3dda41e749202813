"""tools/bench/chaos_bench.py's accounting of the processes launch saw end, on made-up launch output
(no cluster): every killed worker must have died once, by the signal sent, whether it was started as
a worker or as a spare that had taken a slot; a process the benchmark did not kill is reported. Also
its refusal of a --launch-flag that names a flag of launch's it sets itself. The chaos run itself is
chaos_bench_test, and by hand (docs/security.md).

Run by CTest as: clients/python/setup-env.sh, then .venv-client/bin/python tests/chaos_check_test.py
"""
import os
import signal
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench"))
from chaos_bench import check_deaths, launch_flag_errors, read_deaths  # noqa: E402

OUTPUT = """shardserve launch: coordinator + 4 workers (2 node(s) x 2), model m, logs in /tmp/x
shardserve launch: worker node1/1 (pid 100) killed by signal 9 (Killed); last lines of /tmp/x/worker-node1-1.log:
  2026-12-05 23:12:30.001 worker (node node1): step 12
shardserve launch: restarting worker node1/1 in 1 s (restart 1 of at most 5)
shardserve launch: spare node0/0 (pid 101) killed by signal 9 (Killed); last lines of /tmp/x/spare-node0-0.log:
  2026-12-05 23:12:50.001 worker (node node0): spare takes slot (stage 0, tp rank 0)
"""


class ChaosAccountingTest(unittest.TestCase):
    def test_workers_and_spares_that_took_a_slot_are_read(self):
        self.assertEqual(read_deaths(OUTPUT), [("worker node1/1", 100, "killed by signal 9 (Killed)"),
                                               ("spare node0/0", 101, "killed by signal 9 (Killed)")])

    def test_each_kill_ended_once_by_its_signal(self):
        kills = [{"pid": 100, "slot": "stage 1 tp rank 1"}, {"pid": 101, "slot": "stage 0 tp rank 0"}]
        self.assertEqual(check_deaths(kills, read_deaths(OUTPUT), signal.SIGKILL), [])

    def test_a_kill_with_no_end_and_an_end_with_no_kill_are_reported(self):
        problems = check_deaths([{"pid": 100, "slot": "stage 1 tp rank 1"}, {"pid": 102, "slot": "stage 0 tp rank 1"}],
                                read_deaths(OUTPUT), signal.SIGKILL)
        self.assertEqual(len(problems), 2, problems)
        self.assertIn("worker pid 102 (stage 0 tp rank 1), killed, ended 0 times in launch's log", problems)
        self.assertIn("spare node0/0 (pid 101) killed by signal 9 (Killed), not killed by the benchmark", problems)

    def test_another_signal_is_reported(self):
        kills = [{"pid": 100, "slot": "stage 1 tp rank 1"}, {"pid": 101, "slot": "stage 0 tp rank 0"}]
        problems = check_deaths(kills, read_deaths(OUTPUT.replace("pid 101) killed by signal 9 (Killed)",
                                                                  "pid 101) exited with code 1")), signal.SIGKILL)
        self.assertEqual(problems, ["worker pid 101 (stage 0 tp rank 0) was sent SIGKILL but exited with code 1"])


class LaunchFlagsTest(unittest.TestCase):
    def test_flags_the_benchmark_sets_are_refused_naming_its_own(self):
        # A spare given to launch past the benchmark: the report would say 0 spares.
        self.assertEqual(launch_flag_errors(["--spare-workers", "1"]),
                         ["--launch-flag=--spare-workers: chaos_bench sets launch's --spare-workers itself; "
                          "give chaos_bench's --spare-workers"])
        self.assertEqual(launch_flag_errors(["--heal-timeout-seconds=5", "--http-port=8000"]),
                         ["--launch-flag=--heal-timeout-seconds=5: chaos_bench sets launch's --heal-timeout-seconds "
                          "itself; give chaos_bench's --heal-timeout",
                          "--launch-flag=--http-port=8000: chaos_bench sets launch's --http-port itself"])

    def test_other_flags_pass(self):
        self.assertEqual(launch_flag_errors(["--worker-threads", "1", "--worker-collectives=gloo", "--expert-parallel"]),
                         [])


if __name__ == "__main__":
    unittest.main(verbosity=2)

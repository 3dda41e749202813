"""tools/bench/soak.py's checks on made-up records (no cluster): a lost or wrong request, or RSS that grew, is
reported; a request that ended by its own cancellation or deadline is not. The soak itself is run by hand
(docs/security.md, "Soak").

Run by CTest as: clients/python/setup-env.sh, then .venv-client/bin/python tests/soak_check_test.py
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench"))
from soak import judge_requests, rss_growth  # noqa: E402

REFERENCE = {0: [5, 6, 7, 8], 1: "four words of text"}


def record(index, action, answer, finish=None, error=None):
    return {"index": index, "action": action, "answer": answer, "finish": finish, "error": error, "start": 10.0}


class JudgeRequestsTest(unittest.TestCase):
    def judge(self, *records):
        by_action, lost, wrong = judge_requests(list(records), REFERENCE, 0.0)
        return by_action, lost, wrong

    def test_complete_and_own_endings_pass(self):
        by_action, lost, wrong = self.judge(
            record(0, "grpc stream", [5, 6, 7, 8], "FINISH_REASON_LENGTH"),
            record(1, "http stream", "four words of text", "length"),
            record(0, "grpc cancel", [5, 6], error="CANCELLED: Locally cancelled by application!"),
            record(0, "grpc cancel", [5, 6, 7, 8], "FINISH_REASON_LENGTH"),  # the cancel came after the end
            record(0, "grpc deadline", [], error="DEADLINE_EXCEEDED: Deadline Exceeded"),
            record(1, "http disconnect mid-stream", ""))
        self.assertEqual((lost, wrong), ([], []))
        self.assertEqual(by_action, {"grpc stream": 1, "http stream": 1, "grpc cancel": 2, "grpc deadline": 1,
                                     "http disconnect mid-stream": 1})

    def test_other_tokens_or_text_are_wrong(self):
        _, lost, wrong = self.judge(record(0, "grpc stream", [5, 6, 7, 9], "FINISH_REASON_LENGTH"),
                                    record(1, "http unary", "four words of test", "length"))
        self.assertEqual(lost, [])
        self.assertEqual(len(wrong), 2)
        self.assertIn("tokens differ", wrong[0])
        self.assertIn("text differ", wrong[1])

    def test_a_short_answer_without_a_finish_reason_is_wrong(self):
        _, _, wrong = self.judge(record(0, "grpc stream", [5, 6], None))
        self.assertEqual(len(wrong), 1)
        self.assertIn("without a finish reason", wrong[0])

    def test_a_cancelled_request_must_have_received_a_prefix(self):
        _, lost, wrong = self.judge(record(0, "grpc cancel", [5, 7], error="CANCELLED: Locally cancelled"))
        self.assertEqual(lost, [])
        self.assertIn("not a prefix", wrong[0])

    def test_an_error_that_is_not_the_requests_own_ending_is_lost(self):
        _, lost, wrong = self.judge(
            record(0, "grpc stream", [5], error="UNAVAILABLE: the group did not heal"),
            record(0, "grpc cancel", [5], error="DEADLINE_EXCEEDED: Deadline Exceeded"),
            record(0, "grpc deadline", [], error="CANCELLED: by the server"),
            record(1, "http unary", "", error="HTTP 503: not serving"),
            record(1, "http disconnect waiting", "", error="ConnectionRefusedError: refused"))
        self.assertEqual(wrong, [])
        self.assertEqual(len(lost), 5)
        self.assertIn("grpc stream of pool entry 0 at t=10.0 s: UNAVAILABLE", lost[0])


class RssGrowthTest(unittest.TestCase):
    def test_growth_from_the_first_quarter_to_the_last(self):
        # 16 samples 5 s apart: 100 MiB for the first quarter, 130 MiB for the last.
        samples = [(5.0 * i, 42, "coordinator", (100 + (30 if i >= 12 else 10 * (i >= 4))) * 1024, 9)
                   for i in range(16)]
        # A worker killed half-way and its replacement: both left out.
        samples += [(5.0 * i, 43, "worker a", 300 * 1024, 20) for i in range(8)]
        samples += [(5.0 * i, 44, "worker a", 300 * 1024, 20) for i in range(8, 16)]
        out = rss_growth(samples, 0.0, 75.0, 5.0)
        self.assertEqual([(r["process"], r["pid"]) for r in out], [("coordinator", 42)])
        self.assertEqual((out[0]["first_quarter_mib"], out[0]["last_quarter_mib"], out[0]["growth_mib"]),
                         (100.0, 130.0, 30.0))

    def test_too_few_samples_measure_nothing(self):
        samples = [(5.0 * i, 42, "coordinator", 1024, 9) for i in range(7)]
        self.assertEqual(rss_growth(samples, 0.0, 30.0, 5.0), [])


if __name__ == "__main__":
    unittest.main()

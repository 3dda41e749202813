"""tools/ci/check_skips.py on made-up CTest JUnit files: the skips of a machine without a GPU or with
fewer CPU features pass, any other skip fails naming the test, and a failed or passed case is not
its business."""
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "ci", "check_skips.py")


def junit(*cases):
    body = "".join(
        f'<testcase name="{name}" status="{status}">{"<skipped/>" if status == "notrun" else ""}'
        f"<system-out>{out}</system-out></testcase>" for name, status, out in cases)
    return f'<?xml version="1.0"?><testsuite tests="{len(cases)}">{body}</testsuite>'


def run(xml):
    with tempfile.NamedTemporaryFile("w", suffix=".xml", delete=False) as f:
        f.write(xml)
    try:
        p = subprocess.run([sys.executable, SCRIPT, f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return p.returncode, p.stdout


class CheckSkipsTest(unittest.TestCase):
    def test_gpu_and_cpu_feature_skips_are_expected(self):
        rc, out = run(junit(("Ops/CudaVsCpu.Add", "notrun", "kernels_cuda_test.cc:12: Skipped\nno CUDA device"),
                            ("CommunicatorTest.NcclTwoRanks", "notrun", "needs 2 CUDA devices, found 1"),
                            ("PanelTest.Avx512", "notrun", "this CPU lacks AVX-512F"),
                            ("Passes.Case", "run", "ok"), ("Fails.Case", "fail", "boom")))
        self.assertEqual(rc, 0, out)
        self.assertIn("2 skipped, as expected: no GPU", out)
        self.assertIn("1 skipped, as expected: a CPU feature", out)

    def test_any_other_skip_fails_naming_it(self):
        rc, out = run(junit(("deploy_k8s_test", "notrun", "SKIPPED: no kubectl"),
                            ("Ops/CudaVsCpu.Add", "notrun", "no CUDA device")))
        self.assertEqual(rc, 1, out)
        self.assertIn("UNEXPECTED skip: deploy_k8s_test: SKIPPED: no kubectl", out)

    def test_an_unreadable_file_is_an_error(self):
        rc, _ = run("not xml")
        self.assertEqual(rc, 2)


if __name__ == "__main__":
    unittest.main()

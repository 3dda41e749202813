"""tools/ci/ports.py: the ports it hands out are outside the kernel's ephemeral range (where a bind
to port 0 could take them), bindable, distinct and claimed; a block is consecutive and claimed
whole; a fresh claim keeps a port from every other picker (another process included) and a stale
one is taken again. Claims go to a directory of this test's own ($TMPDIR), so that it neither sees
nor leaves the claims of the tests running beside it."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

work = tempfile.mkdtemp(prefix="ports_test.")
os.environ["TMPDIR"] = work
tempfile.tempdir = None  # ports.py reads the temp dir at import: this test's
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "ci"))
import ports  # noqa: E402

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print(f"FAIL: {what}")


def claim_file(port):
    return os.path.join(work, "shardserve-ports", str(port))


check(ports.CLAIM_DIR == os.path.join(work, "shardserve-ports"), f"claims in {ports.CLAIM_DIR}, not under $TMPDIR")
low, high = ports._ephemeral_range()
seen = set()
for port in ports.free_ports(200):
    check(port < low or port > high, f"{port} is in the ephemeral range {low}-{high}")
    check(ports.LOWEST <= port <= 65535, f"{port} is outside [{ports.LOWEST}, 65535]")
    check(ports._bindable(port), f"{port} cannot be bound")
    check(os.path.exists(claim_file(port)), f"{port} is not claimed")
    check(port not in seen, f"{port} handed out twice")
    seen.add(port)
print(f"ok: 200 ports outside the ephemeral range {low}-{high}, bindable, distinct and claimed")

base = ports.free_port_block(8)
for port in range(base, base + 8):
    check(port not in seen and os.path.exists(claim_file(port)), f"block port {port} is not claimed, or was given before")
print(f"ok: a block of 8 from {base}, each claimed")

port = ports.free_port()
check(not ports._claim(port), "a fresh claim was taken again")
other = subprocess.run([sys.executable, "-c", f"import ports, sys; sys.exit(0 if not ports._claim({port}) else 1)"],
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(ports.__file__)))
check(other.returncode == 0, "another process took a fresh claim")
old = time.time() - ports.CLAIM_SECONDS - 60
os.utime(claim_file(port), (old, old))
check(ports._claim(port), "a stale claim was not taken")
check(os.stat(claim_file(port)).st_mtime > old, "the claim taken again was not renewed")
check(not ports._claim(port), "the renewed claim was taken again")
print("ok: a fresh claim holds, in this process and another; a stale one is taken again and renewed")

shutil.rmtree(work, ignore_errors=True)
if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)

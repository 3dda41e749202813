#!/usr/bin/env python3
"""Runs the commands of README.md, so that the front page cannot drift from the code.

The marker: a fenced block whose info string is `sh runnable` is shell, run as it is written; one
whose info string is `python runnable` is Python, run by the given interpreter (the one with the
openai client). Any other block (plain `sh`, output, a GPU host's commands) is not run. Mark a block
runnable only if it needs no GPU and no network beyond 127.0.0.1, and finishes in seconds.

The runnable blocks are run in README order, as one bash script (`set -euo pipefail`), so that a
block may start a cluster in the background (`shardserve launch ... &`) and a later one stop it
(`kill %1; wait`): every block that starts something must be paired with a block that stops it.
The script runs in a fresh temporary directory holding links to the checkout's folders the README
names (`models`, `tests`, `tools`, `clients`) and `build/bin`, a link to the built binaries, so the
commands read as a user types them after `tools/demo.sh`. It runs in its own user, network, PID and
mount namespaces (`unshare`, with a /proc of its own): only a loopback of its own, so the default
ports (50051, 8000, 9400, ...) collide with nothing else on the machine, no network beyond it, and
every process it started is killed when it ends. Where the machine refuses namespaces (or has no `ip` to bring the loopback
up) it runs without them, in its own process group, killed at the end. The whole is bounded in time (--timeout, default 240 s,
scaled by SHARDSERVE_TEST_TIME_SCALE). A failing command fails the test, naming its block and the
README line where it starts.

usage: readme_doc_test.py --readme README.md --bin BUILD/bin --python PYTHON [--timeout S]
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile

FENCE = re.compile(r"^```(.*)$")
LINKED_FOLDERS = ("models", "tests", "tools", "clients")


def fail(message):
    print(f"readme_doc_test.py: FAIL: {message}")
    sys.exit(1)


def runnable_blocks(readme_text):
    """[(language, first line number, text)] of the blocks marked runnable, in order."""
    blocks = []
    info = None  # the open block's info string, or None outside a block
    start = 0
    lines = []
    for number, line in enumerate(readme_text.splitlines(), start=1):
        match = FENCE.match(line)
        if info is None:
            if match:
                info, start, lines = match.group(1).strip(), number + 1, []
            continue
        if line.strip() == "```":
            words = info.split()
            if len(words) >= 2 and words[1] == "runnable":
                if words[0] not in ("sh", "python"):
                    fail(f"README.md line {start - 1}: a runnable block must be sh or python, not '{words[0]}'")
                blocks.append((words[0], start, "\n".join(lines)))
            info = None
        else:
            lines.append(line)
    if info is not None:
        fail(f"README.md line {start - 1}: a code block is never closed")
    return blocks


def script_of(blocks, python):
    parts = ["set -euo pipefail"]
    for index, (language, line, text) in enumerate(blocks, start=1):
        parts.append(f"echo '=== README block {index} (line {line})'")
        if language == "sh":
            parts.append(text)
        else:
            parts.append(f"{python} - <<'README_PYTHON_BLOCK_END'\n{text}\nREADME_PYTHON_BLOCK_END")
    parts.append("echo '=== README blocks all ran'")
    return "\n".join(parts) + "\n"


def namespaces_work():
    try:
        probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc",
                                "ip", "link", "set", "lo", "up"], capture_output=True, timeout=20)
        return probe.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--readme", required=True)
    parser.add_argument("--bin", required=True)
    parser.add_argument("--python", required=True)
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    scale = float(os.environ.get("SHARDSERVE_TEST_TIME_SCALE", "1") or "1")
    timeout = args.timeout * scale

    readme = os.path.abspath(args.readme)
    with open(readme, encoding="utf-8") as f:
        blocks = runnable_blocks(f.read())
    # The tour must be there: a README that lost its runnable blocks would pass an empty test.
    if len(blocks) < 4:
        fail(f"{readme} has {len(blocks)} runnable blocks; the tour needs at least 4")
    for tool in ("shardserve", "shardserve-coordinator", "shardserve-worker"):
        if not os.access(os.path.join(args.bin, tool), os.X_OK):
            fail(f"{tool} is not built in {args.bin}")

    source = os.path.dirname(readme)
    with tempfile.TemporaryDirectory(prefix="readme-doc-") as work:
        for folder in LINKED_FOLDERS:
            os.symlink(os.path.join(source, folder), os.path.join(work, folder))
        os.makedirs(os.path.join(work, "build"))
        os.symlink(os.path.abspath(args.bin), os.path.join(work, "build", "bin"))
        script = os.path.join(work, "readme.sh")
        with open(script, "w", encoding="utf-8") as f:
            f.write(script_of(blocks, os.path.abspath(args.python)))
        env = dict(os.environ, SHARDSERVE_STATE_DIR=os.path.join(work, "state"), NO_PROXY="*", no_proxy="*")
        for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
            env.pop(proxy, None)
        if namespaces_work():
            # PID 1 of the new namespace is bash: when it exits, the kernel kills every process left.
            # --mount-proc: a /proc of the namespace's own, whose PIDs are the ones its processes see
            # (LeakSanitizer, in the ASan-built binaries, reads /proc/<its pid>/task to stop threads).
            command = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc",
                       "bash", "-c", "ip link set lo up && exec bash ./readme.sh"]
        else:
            print("readme_doc_test.py: no namespaces here; running on the machine's own loopback")
            command = ["bash", "./readme.sh"]
        process = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Reap whatever is left (the namespace's processes die with its PID 1; without one, the group).
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if timed_out:
            output, _ = process.communicate()
        print(output)
        ran = re.findall(r"^=== README block (\d+) \(line (\d+)\)$", output, re.MULTILINE)
        where = f"block {ran[-1][0]} (README.md line {ran[-1][1]})" if ran else "before the first block"
        if timed_out:
            fail(f"the README's commands did not finish in {timeout:.0f} s; stuck in {where}")
        if process.returncode != 0:
            fail(f"a README command failed (exit {process.returncode}) in {where}")
        if "=== README blocks all ran" not in output:
            fail("the script stopped before its last block")
    print(f"readme_doc_test.py: PASS: {len(blocks)} runnable blocks of {readme} ran")


if __name__ == "__main__":
    main()

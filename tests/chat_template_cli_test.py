#!/usr/bin/env python3
"""shardserve chat-template (tools/cli/cmd_chat_template.cc): every fixture case of
tests/fixtures/chat_templates and of chat_template_continuations.json (--continue-final-message)
rendered through the command line, stdout compared byte for byte with
transformers' output, a raising template's message on stderr with exit code 1, and bad flags exit 2.
Usage: chat_template_cli_test.py BIN_DIR"""
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "chat_templates")
CONTINUATIONS = os.path.join(ROOT, "tests", "fixtures", "chat_template_continuations.json")
# The date formats the fixtures' templates give strftime_now (gpt-oss's, Llama 3.2's).
DATE_FORMATS = ("%Y-%m-%d", "%d %b %Y")


def expected_today(expected, pinned, today):
    """The fixture's text with today's date for the day its renders were pinned to (cases.json's
    "today"), in each format of DATE_FORMATS: a template that writes the date writes today's here."""
    if pinned is None:
        return expected
    day = datetime.datetime.strptime(pinned, "%Y-%m-%d")
    for fmt in DATE_FORMATS:
        expected = expected.replace(day.strftime(fmt), today.strftime(fmt))
    return expected


def main():
    shardserve = os.path.join(sys.argv[1], "shardserve")
    failures = 0
    runs = 0
    continuations = json.load(open(CONTINUATIONS, encoding="utf-8"))
    suites = [(family, json.load(open(os.path.join(FIXTURES, family, "cases.json"), encoding="utf-8")))
              for family in sorted(os.listdir(FIXTURES))]
    suites += [(family, {"today": continuations["today"], "cases": cases})
               for family, cases in continuations["families"].items()]
    with tempfile.TemporaryDirectory() as tmp:
        for family, fixture in suites:
            for case in fixture["cases"]:
                paths = {}
                for key in ("messages", "tools", "extra"):
                    if case[key] in (None, {}):
                        continue
                    paths[key] = os.path.join(tmp, f"{key}.json")
                    with open(paths[key], "w", encoding="utf-8") as f:
                        json.dump(case[key], f, ensure_ascii=False)
                cmd = [shardserve, "chat-template", "--model", os.path.join(FIXTURES, family)]
                for key, path in paths.items():
                    cmd += [f"--{key}", path]
                if case.get("continue_final_message"):
                    cmd.append("--continue-final-message")
                elif not case["add_generation_prompt"]:
                    cmd.append("--no-generation-prompt")
                while True:  # (a run across midnight is run again)
                    today = datetime.date.today()
                    r = subprocess.run(cmd, capture_output=True, timeout=60)
                    if datetime.date.today() == today:
                        break
                runs += 1
                if "error" in case:
                    ok = r.returncode == 1 and case["error"].encode() in r.stderr and r.stdout == b""
                else:
                    want = expected_today(case["expected"], fixture.get("today"), today)
                    ok = r.returncode == 0 and r.stdout == want.encode("utf-8")
                if not ok:
                    failures += 1
                    print(f"FAIL {family}/{case['name']}: exit {r.returncode}, stderr {r.stderr[:300]!r}")
        # Usage errors.
        for bad in (["chat-template"], ["chat-template", "--model", FIXTURES], ["chat-template", "--bogus"]):
            r = subprocess.run([shardserve] + bad, capture_output=True, timeout=60)
            runs += 1
            if r.returncode != 2:
                failures += 1
                print(f"FAIL {bad}: exit {r.returncode}, want 2")
        r = subprocess.run([shardserve, "chat-template", "--model", os.path.join(tmp, "missing"), "--messages",
                            os.path.join(tmp, "messages.json")], capture_output=True, timeout=60)
        runs += 1
        if r.returncode != 1 or b"NOT_FOUND" not in r.stderr:
            failures += 1
            print(f"FAIL missing model dir: exit {r.returncode}, stderr {r.stderr!r}")
    print(f"chat_template_cli_test: {runs - failures}/{runs} passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

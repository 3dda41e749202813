#!/usr/bin/env python3
"""Keeps README.md and docs/ a reference: no tracker numbers, no links that lead nowhere.

Fails, naming the file and line, when
  - README.md or a page of docs/ names an issue, a pull request or a stop by number
    ("issue 25", "issues 25 and 26", "PR 12", "stop 32", "#29"): the pages speak of what the
    project does, and the history of how it came to do it is git's;
  - a Markdown link of theirs ([text](path), [text](path#anchor), [text](#anchor)) leads to a file
    or folder that is not in the repository, or to an anchor that no heading of the target page
    makes (GitHub's rule: lower case, punctuation dropped, spaces to hyphens, -1, -2 ... for
    repeats);
  - their prose (outside code blocks and `code spans`) names a page, `<page>.md` or
    `docs/<page>.md`, that is not there;
  - another file git tracks (code comments, scripts, build files) cites `docs/<page>.md` and there
    is no such page.
Links to other sites (http:, https:, mailto:) are not followed: the test needs no network.

usage: docs_test.py [--root REPO]
"""
import argparse
import os
import re
import subprocess
import sys

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
TRACKER = [
    re.compile(r"\b(?:issues?|stops?|PRs?|pull requests?)\s+#?\d+", re.IGNORECASE),
    re.compile(r"(?<![\w/&(#])#\d{2,}\b"),
]
PAGE_MENTION = re.compile(r"(?<![\w/.-])((?:docs/)?[A-Za-z0-9_-]+\.md)\b")
DOCS_CITATION = re.compile(r"(?<![\w/.-])docs/([A-Za-z0-9_-]+\.md)\b")
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh", ".c", ".cpp", ".py", ".sh", ".txt", ".cmake", ".proto",
                   ".yaml", ".yml", ".toml", ".cfg", ".json", ".md")


def pages(root):
    """README.md and docs/*.md, as paths relative to root."""
    found = ["README.md"]
    docs = os.path.join(root, "docs")
    found += sorted(os.path.join("docs", name) for name in os.listdir(docs) if name.endswith(".md"))
    return found


def prose_lines(text):
    """[(line number, line)] outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        seen, result = {}, set()
        for _, line in prose_lines(text):
            match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if not match:
                continue
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
        for explicit in re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text):
            result.add(explicit)
        cache[path] = result
    return cache[path]


def check_page(root, page, problems):
    path = os.path.join(root, page)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    here = os.path.dirname(path)
    for number, line in prose_lines(text):
        where = f"{page}:{number}"
        for pattern in TRACKER:
            for match in pattern.finditer(line):
                problems.append(f"{where}: a tracker number, '{match.group(0)}' (say what the project does)")
        for match in LINK.finditer(line):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # another site (http:, https:, mailto:)
            file_part, _, anchor = target.partition("#")
            linked = os.path.normpath(os.path.join(here, file_part)) if file_part else path
            if not os.path.exists(linked):
                problems.append(f"{where}: the link '{target}' leads to {os.path.relpath(linked, root)}, "
                                "which is not in the repository")
                continue
            if anchor and linked.endswith(".md") and anchor not in anchors(linked):
                problems.append(f"{where}: the link '{target}' names the anchor '#{anchor}', which no heading "
                                f"of {os.path.relpath(linked, root)} makes")
        # Page names in the prose, links and code spans aside.
        prose = CODE_SPAN.sub("", LINK.sub("", line))
        for match in PAGE_MENTION.finditer(prose):
            name = match.group(1)
            candidates = [os.path.join(here, name), os.path.join(root, name), os.path.join(root, "docs", name)]
            if not any(os.path.exists(candidate) for candidate in candidates):
                problems.append(f"{where}: names the page '{name}', which is not in the repository")


def tracked_files(root):
    try:
        listing = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, check=True,
                                 timeout=60).stdout.decode("utf-8", "replace")
        return [name for name in listing.split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        found = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith((".", "build"))]
            found += [os.path.relpath(os.path.join(folder, name), root) for name in files]
        return found


def check_citations(root, problems, checked_pages):
    for name in tracked_files(root):
        if name in checked_pages:
            continue
        if not name.endswith(SOURCE_SUFFIXES) and os.path.basename(name) not in ("CMakeLists.txt", "Dockerfile"):
            continue
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(lines, start=1):
            for match in DOCS_CITATION.finditer(line):
                if not os.path.exists(os.path.join(root, "docs", match.group(1))):
                    problems.append(f"{name}:{number}: cites docs/{match.group(1)}, which is not in the repository")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    problems = []
    checked = pages(root)
    for page in checked:
        check_page(root, page, problems)
    check_citations(root, problems, set(checked))
    for problem in problems:
        print(f"docs_test.py: FAIL: {problem}")
    if problems:
        return 1
    print(f"docs_test.py: {len(checked)} pages and the code's citations of docs/ checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())

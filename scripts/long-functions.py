#!/usr/bin/env python3
"""List Rust functions longer than N lines (default 80), outside #[cfg(test)] modules
and tests/. Test-only files are skipped too: a file named `tests.rs` under src/ is a
#[cfg(test)] module kept in its own file (src/tasks/tests.rs, src/output/figure/tests.rs).
Usage: python3 scripts/long-functions.py [N] [paths...] (default: src).

A function starts at a line whose code begins with `fn`/`pub fn`/... and ends where
its braces balance; lines are counted from the signature to the closing brace. Brace
counting ignores string and char literals and comments roughly, which is enough for
this codebase (it is a reading aid, not a parser)."""
import os
import re
import sys

FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")


def strip(line):
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return line.split("//", 1)[0]


def scan(path, limit):
    lines = open(path, encoding="utf-8").read().split("\n")
    out = []
    i = 0
    while i < len(lines):
        code = strip(lines[i])
        if re.match(r"^\s*#\[cfg\(test\)\]", code):
            break  # test modules sit at the end of our files
        m = FN.match(code)
        if m and "{" in "".join(strip(l) for l in lines[i : i + 12]):
            depth, j, opened = 0, i, False
            while j < len(lines):
                c = strip(lines[j])
                depth += c.count("{") - c.count("}")
                opened = opened or "{" in c
                if opened and depth <= 0:
                    break
                if not opened and c.rstrip().endswith(";"):
                    break  # a declaration without a body
                j += 1
            n = j - i + 1
            if opened and n > limit:
                out.append((n, path, i + 1, m.group(6)))
            i = j + 1 if opened else i + 1
            continue
        i += 1
    return out


def main():
    args = sys.argv[1:]
    limit = int(args.pop(0)) if args and args[0].isdigit() else 80
    roots = args or ["src"]
    found = []
    for root in roots:
        files = [root] if root.endswith(".rs") else [
            os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".rs")
        ]
        files = [f for f in files if os.path.basename(f) != "tests.rs"]  # test-only modules
        for f in sorted(files):
            found += scan(f, limit)
    for n, path, line, name in sorted(found, reverse=True):
        print(f"{n:5}  {path}:{line}  {name}")
    print(f"{len(found)} function(s) over {limit} lines")


if __name__ == "__main__":
    main()

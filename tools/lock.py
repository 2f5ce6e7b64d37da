"""The constraints files: what the test suite passed with, written and compared.

Where it sits: outside the library, beside the Makefile. `make setup` / `make test` / `make docs`
install with `pip -c constraints/main.txt`, `make test-floor` with `constraints/floor.txt` and
`make test-transformers-5.17` with `constraints/transformers-5.17.txt`, so a fresh clone installs
the exact releases its suite last passed with, whatever PyPI released since. `make test-latest`
builds a venv of the newest releases, prints how they differ from the lock (`diff`) and runs the
suite; `make lock` then rewrites the lock from that venv (`write`), on purpose, with the date.

torch and its CUDA wheels are never locked here: TORCH_SPEC (or FLOOR_SPEC) picks the build.

    python tools/lock.py diff  --python .venv-latest/bin/python --lock constraints/main.txt
    python tools/lock.py write --python .venv-latest/bin/python --out constraints/main.txt --note "..."
    python tools/lock.py write --path .floor-transformers-5.17 --python .venv-floor/bin/python --out ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys

UNLOCKED = re.compile(r"^(torch|triton|pytorch-triton|nvidia-.*|cuda-.*|hf-longctx|pip|setuptools|wheel)$")


def canonical(name: str) -> str:
    """PEP 503 normal form: `Jinja2` and `jinja2`, `typing_extensions` and `typing-extensions` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(python: str, path: str | None = None) -> dict[str, str]:
    """{canonical name: version} of what `python`'s pip sees (or of the `--target` folder `path`),
    editable installs and the unlocked packages left out."""
    cmd = [python, "-m", "pip", "list", "--format=json", "--exclude-editable", "--disable-pip-version-check"]
    if path:
        cmd += ["--path", path]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {canonical(r["name"]): r["version"] for r in rows if not UNLOCKED.match(canonical(r["name"]))}


def read(lock: str) -> dict[str, str]:
    """{canonical name: version} of a constraints file of `name==version` lines; anything else
    (a range, a URL) is refused, naming the line: a lock pins exact releases."""
    out = {}
    with open(lock) as f:
        for n, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^=<>!~;\s]+)", line)
            if m is None:
                raise ValueError(f"{lock}:{n}: {line!r} is not name==version (a lock pins exact releases)")
            out[canonical(m.group(1))] = m.group(2)
    return out


def differences(locked: dict[str, str], now: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, locked version or '-', installed version or '-') for every package that differs."""
    return [(n, locked.get(n, "-"), now.get(n, "-")) for n in sorted(set(locked) | set(now)) if locked.get(n) != now.get(n)]


def write(out: str, packages: dict[str, str], note: str, python: str) -> None:
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"], check=True,
                             capture_output=True, text=True).stdout.strip()
    with open(out, "w") as f:
        f.write(f"# Exact releases the test suite passed with (pip constraints: `pip install -c {out} ...`).\n")
        f.write(f"# Written {datetime.date.today().isoformat()} by tools/lock.py on CPython {version}: {note}\n")
        f.write("# torch is not here: TORCH_SPEC / FLOOR_SPEC picks its build. Refreshed on purpose only "
                "(docs/project/tests.md, 'The constraints files').\n")
        for name in sorted(packages):
            f.write(f"{name}=={packages[name]}\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["diff", "write"])
    p.add_argument("--python", default=sys.executable, help="the interpreter whose packages are read")
    p.add_argument("--path", default=None, help="read a pip --target folder instead of the interpreter's site-packages")
    p.add_argument("--lock", default="constraints/main.txt", help="diff: the lock to compare with")
    p.add_argument("--out", default=None, help="write: the lock to write")
    p.add_argument("--note", default="", help="write: what the suite passed (one line)")
    args = p.parse_args(argv)
    now = installed(args.python, args.path)
    if args.action == "write":
        if not args.out:
            p.error("write needs --out")
        write(args.out, now, args.note, args.python)
        print(f"{args.out}: {len(now)} packages")
        return 0
    changed = differences(read(args.lock), now)
    print(f"against {args.lock}: " + ("the same releases" if not changed else f"{len(changed)} differ"))
    for name, old, new in changed:
        print(f"  {name:32s} {old:>16s} -> {new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

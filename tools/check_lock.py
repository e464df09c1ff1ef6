"""Checks that this Python's installed packages are exactly the lock's: `python tools/check_lock.py [LOCK]`.

Compares `pip freeze` (the editable jaxport left out) with the `name==version` lines of the lock that `make lock`
writes (default: requirements.lock beside pyproject.toml); prints every package missing, extra or at another
version, and exits 1 if there is one.
"""

import re
import subprocess
import sys
from pathlib import Path

LOCK = Path(__file__).resolve().parent.parent / "requirements.lock"


def pins(lines) -> dict[str, str]:
    """{normalised name: version} of the `name==version` lines (comments and options skipped)."""
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = (part.strip() for part in line.split("==", 1))
            found[re.sub(r"[-_.]+", "-", name).lower()] = version.split(";", 1)[0].strip()
    return found


def main(argv: list[str]) -> int:
    lock = Path(argv[0]) if argv else LOCK
    locked = pins(lock.read_text().splitlines())
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
    )
    installed = pins(freeze.stdout.splitlines())
    problems = [f"missing: {name}=={locked[name]}" for name in sorted(locked.keys() - installed.keys())]
    problems += [f"not in the lock: {name}=={installed[name]}" for name in sorted(installed.keys() - locked.keys())]
    problems += [
        f"{name}: {installed[name]} installed, {locked[name]} locked"
        for name in sorted(locked.keys() & installed.keys())
        if locked[name] != installed[name]
    ]
    for problem in problems:
        print(f"{lock.name}: {problem}", file=sys.stderr)
    if problems:
        print(f"{lock.name}: {len(problems)} difference(s); `make` installs the lock into .venv", file=sys.stderr)
        return 1
    print(f"{lock.name}: the {len(locked)} installed packages are exactly the lock's")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

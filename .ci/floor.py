"""Print pip constraints that pin every dependency pyproject.toml declares
(its own and the test extra's) to its declared floor: `name>=X` -> `name==X`.
A dependency without a floor is an error: the floor run must test each one."""

import re
import sys
from pathlib import Path

import tomllib  # (run by the host's python3, 3.11 or later; the floor run's Python may be older)

root = Path(__file__).resolve().parent.parent
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
missing = []
for spec in project["dependencies"] + project["optional-dependencies"]["test"]:
    m = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)\s*>=\s*([^,;\s]+)(?:\s*,.*)?", spec)
    if m is None:
        missing.append(spec)
    else:
        name = re.sub(r"\[.*\]", "", m.group(1))  # (an extra's brackets: constraints name the package alone)
        print(f"{name}=={m.group(2)}")
if missing:
    sys.exit(f"ci: pyproject.toml declares no floor (name>=X) for {missing}: the floor run cannot test them")

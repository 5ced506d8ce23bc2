"""Figures the README states about the code hold."""

import itertools
import re
import subprocess

from conftest import REPO, STAGES


def changed_lines(a: str, b: str) -> int:
    diff = subprocess.run(["diff", REPO / f"{a}.py", REPO / f"{b}.py"], capture_output=True)
    return sum(line[:1] in (b"<", b">") for line in diff.stdout.splitlines())


def test_the_diff_sizes_the_readme_states():
    readme = (REPO / "README.md").read_text()
    for a, b in itertools.pairwise(STAGES):
        stated = re.search(rf"^diff {a}\.py {b}\.py +# (\d+)", readme, re.M)
        assert stated and int(stated[1]) == changed_lines(a, b), (a, b)

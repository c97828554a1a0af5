"""The README's promises a new user acts on: its first commands work on a stock Debian Python
(a venv before pip), and its requeue example says what happens to the requests in flight."""

from __future__ import annotations

from conftest import REPO

README = (REPO / "README.md").read_text()


def test_the_first_commands_make_a_venv_before_installing_then_test():
    block = README.split("```sh", 1)[1].split("```", 1)[0]
    lines = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert lines[0].startswith("python3 -m venv .venv && . .venv/bin/activate")
    assert "pip install" in lines[1] and "genq demo" in lines[1]
    # The test command is the quick default tier; .ci/run, every tier, is named as the full CI.
    assert lines[2] == "python3 -m pytest -q"
    assert lines[3] == "bash .ci/run" and "full CI" in block.strip().splitlines()[3]


def test_the_requeue_example_names_the_in_flight_default_and_its_alternative():
    how = README.split("genq requeue --set max_tokens=8192 --redo truncated` changes", 1)[1]
    paragraph = how.split("\n\n", 1)[0]
    assert "`--inflight abort`" in paragraph and "`--inflight finish`" in paragraph
    assert "aborted" in paragraph

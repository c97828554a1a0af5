"""What `pip install genq` puts into site-packages: one import name, genq, so no other project's
`common` (or `monitor`, `producer`…) can collide with genq's."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from conftest import REPO


def test_the_wheel_installs_one_top_level_name(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("genq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"genq"}
    # the linked folders travel whole: code, the Lua scripts and the monitor's page
    for path in ("genq/common/queue/keys.py", "genq/common/queue/lua/claim.lua",
                 "genq/monitor/page.html", "genq/simulator/cli.py", "genq/consumer/worker.py"):
        assert path in names


def test_the_image_copies_every_folder_genq_links():
    """The Dockerfile copies the card's folders one by one (a small last layer): each folder
    genq/ links in must be among them, or the image's genq cannot import it."""
    linked = {p.name for p in (REPO / "genq").iterdir() if p.is_symlink()}
    copied = {line.split()[1] for line in (REPO / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and len(line.split()) == 3}
    assert linked and linked <= copied, sorted(linked - copied)
    # ... and the build context holds them: .dockerignore lets in only what it names.
    let_in = {line[1:].strip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.startswith("!")}
    assert linked <= let_in, sorted(linked - let_in)

"""The READMEs stay short enough to read in ten minutes, and the baked documentation's links
lead somewhere: the baked README at most 300 lines with the way to two machines and to SLURM in
its first 120, the template's README at most 150 lines with the two commands of its contract."""

import re
from pathlib import Path

import pytest
from conftest import TEMPLATE

BAKED_README_LINES = 300
TEMPLATE_README_LINES = 150
FIRST_LINES = 120  # where a newcomer must find how to run on two machines and on SLURM
# A relative markdown link: [text](target) or [text](<target>), not a URL.
LINK = re.compile(r"\]\(<?(?!https?:|mailto:)([^)>\s]+)>?\)")


@pytest.fixture(scope="module")
def bakes(tmp_path_factory) -> dict[str, Path]:
    """A default bake, and one for 2 nodes (its README has the most lines)."""
    from cookiecutter.main import cookiecutter

    root = tmp_path_factory.mktemp("readmes")
    return {name: Path(cookiecutter(str(TEMPLATE), no_input=True, extra_context=answers,
                                    output_dir=str(root / name)))
            for name, answers in {"default": {}, "two-nodes": {"num_nodes": "2"}}.items()}


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def broken_links(page: Path, root: Path) -> list[str]:
    """The relative links of `page` whose file, or whose heading, is not there."""
    broken = []
    for line in prose(page):
        for target in LINK.findall(line):
            name, _, fragment = target.partition("#")
            linked = (page.parent / name).resolve() if name else page
            if not linked.exists() or root.resolve() not in [linked, *linked.parents]:
                broken.append(f"{page.relative_to(root)}: {target}")
            elif fragment and linked.suffix == ".md" and fragment not in {
                    anchor(line.lstrip("#")) for line in prose(linked) if line.startswith("#")}:
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_the_baked_readme_fits_300_lines_and_leads_to_two_machines_and_slurm_early(bakes):
    for name, project in bakes.items():
        lines = (project / "README.md").read_text().splitlines()
        assert len(lines) <= BAKED_README_LINES, (name, len(lines))
        # The rows of "Where do I change X" name the commands and link to the section with them.
        start = lines.index("## Where do I change X")
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
        assert end <= FIRST_LINES, (name, end)
        table = lines[start:end]
        two_machines = [line for line in table if line.startswith("| two machines |")]
        slurm = [line for line in table if line.startswith("| SLURM |")]
        assert len(two_machines) == len(slurm) == 1, name
        assert "NNODES=2" in two_machines[0] and "sbatch slurm.sbatch" in slurm[0]
        for row in (two_machines[0], slurm[0]):
            assert "](#several-machines-and-slurm)" in row
        section = "\n".join(lines[lines.index("## Several machines and SLURM"):])
        assert "NNODES=2 NODE_RANK=0 MASTER_ADDR=" in section and "\nsbatch slurm.sbatch" in section
    # What moved out of the README is where its links (and the pages' links) say.
    project = bakes["default"]
    pages = [project / "README.md", *sorted((project / "docs").rglob("*.md"))]
    assert [link for page in pages for link in broken_links(page, project)] == []


def test_the_template_readme_fits_150_lines_and_keeps_its_two_commands():
    readme = TEMPLATE / "README.md"
    lines = readme.read_text().splitlines()
    assert len(lines) <= TEMPLATE_README_LINES, len(lines)
    # The contract: on a fresh machine, one command runs the main job, one passes the tests
    # (the one CI runs).
    assert "bash scripts/demo.sh" in readme.read_text()
    assert "bash scripts/test.sh" in readme.read_text()
    assert "\nbash scripts/test.sh\n" in (TEMPLATE / ".ci" / "run").read_text()
    contributing = TEMPLATE / "CONTRIBUTING.md"
    assert [*broken_links(readme, TEMPLATE), *broken_links(contributing, TEMPLATE)] == []

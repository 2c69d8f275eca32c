"""The README speaks of files in this repository only: every local link resolves inside it,
and no path leads out of it."""
import os
import re

from conftest import REPO_ROOT


def test_readme_points_only_at_files_of_this_repository():
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        text = f.read()
    assert "../" not in text
    links = [link for link in re.findall(r"\]\(([^)#\s]+)\)", text)
             if not link.startswith(("http://", "https://"))]
    assert links, "the README links to no file (the figures at least)"
    for link in links:
        assert os.path.exists(os.path.join(REPO_ROOT, link)), link

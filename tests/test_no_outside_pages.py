"""Every comment, docstring and doc names only pages and files the repository holds.

A user of the repository has README.md, docs/ and the code; the design pages it was built
from are not shipped, so a pointer such as "(55-models.md)" or "the seed's page" sends a
reader nowhere. Relative links in the Markdown files must name files that exist.
"""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# test_catalogue checks the catalogue against the design's error page when that page is
# beside the checkout (skipped otherwise): the one file that names it, on purpose
READS_THE_DESIGN = {"tests/test_catalogue.py", "tests/test_no_outside_pages.py"}
POINTERS = [
    (re.compile(r"\b\d\d-[a-z0-9-]+\.md\b"), "a design page"),
    (re.compile(r"\bshared/(spec|seeds)\b"), "the design folder"),
    (re.compile(r"\bspec/\d\d"), "a design page"),
    (re.compile(r"\bthe seed(?:'s|s')? (?:page|Devices|run)\b|\bseed page", re.I), "a seed page"),
]
TEXT = (".py", ".md", ".sx", ".sh", ".toml", ".cfg", ".txt", ".yaml", ".yml")


def _tracked() -> list[str]:
  r = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
  if r.returncode != 0:
    pytest.skip("not a git checkout")
  return [p for p in r.stdout.splitlines()
          if p.endswith(TEXT) and os.path.isfile(os.path.join(ROOT, p))]


def test_no_file_points_to_a_design_page():
  found = []
  for rel in _tracked():
    if rel in READS_THE_DESIGN or rel.startswith("tests/data/"):
      continue
    with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
      for n, line in enumerate(f, 1):
        for pattern, what in POINTERS:
          if pattern.search(line):
            found.append(f"{rel}:{n}: {what}: {line.strip()[:100]}")
  assert found == []


def test_the_markdown_files_link_only_to_files_that_exist():
  missing = []
  for rel in _tracked():
    if not rel.endswith(".md"):
      continue
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
      text = f.read()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
      if re.match(r"[a-z]+:", target):  # a URL: not a file of the repository
        continue
      if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(rel), target))):
        missing.append(f"{rel}: {target}")
  assert missing == []


def test_the_pointer_patterns_catch_what_they_are_for():
  """The patterns above find the pointers this test is for, and not an RNG's seed."""
  def caught(line):
    return any(p.search(line) for p, _ in POINTERS)
  assert caught("# the rules of the seed's Devices page") and caught("see (55-models.md)")
  assert caught("../shared/spec/60-errors.md") and caught("spec/30-run.md, Benchmarks")
  assert not caught("drawn from the seed and the epoch so a resume stays exact")
  assert not caught("from sexpgpu.data.spec import loader")

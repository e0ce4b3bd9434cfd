"""A run's files stay inside their location, and `--resume latest` never starts over silently.

The slug is one folder name whatever its source (the file's name, SEXPGPU_RUN_SLUG, the
knobs set); pruning deletes only step folders a save wrote; step folders that exist but
cannot be verified are skipped by name, and when none verifies the resume is refused.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import sexpgpu
from conftest import ROOT
from sexpgpu.ckpt import CheckpointStore, resolve_resume
from sexpgpu.ckpt.manifest import MANIFEST
from sexpgpu.ckpt.where import LOCAL_DONE
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.lang.select import MAX_SLUG, make_slug, run_slug_stem, slug_component

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _precious(folder, names):
  for name in names:
    (folder / name).mkdir(parents=True, exist_ok=True)
    (folder / name / "precious.txt").write_text(f"the user's {name}")


def _intact(folder, names):
  return all((folder / n / "precious.txt").read_text() == f"the user's {n}" for n in names)


# -- the slug ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["..", ".", "...", "a/b", "../x", "a\\b", "x\0y", "x" * 201])
def test_a_run_slug_that_is_no_folder_name_is_e_env_001(value):
  with pytest.raises(SxError) as e:
    run_slug_stem({"SEXPGPU_RUN_SLUG": value})
  assert e.value.code == "E-ENV-001" and e.value.where == "SEXPGPU_RUN_SLUG"
  assert "SEXPGPU_RUN_SLUG" in e.value.message and "one folder name" in e.value.fix


def test_a_run_slug_of_ordinary_characters_is_kept():
  assert run_slug_stem({"SEXPGPU_RUN_SLUG": "my run"}) == "my run"
  assert run_slug_stem({"SEXPGPU_RUN_SLUG": ""}) is None and run_slug_stem({}) is None
  assert make_slug("my run", None, []) == "my_run"


@pytest.mark.parametrize("stem", ["..", ".", "", "\udcff..", "a/../b"])
def test_every_slug_is_one_safe_component(stem):
  slug = make_slug(stem, None, [])
  assert "/" in stem or os.path.basename(slug) == slug
  assert slug.strip(".") != "" and "/" not in slug and "\0" not in slug
  assert slug.encode("ascii")  # no byte a file system may refuse
  assert slug_component(slug) == slug


def test_a_long_slug_is_cut_with_a_hash_of_the_whole():
  a = make_slug("x", None, [(f"k{i}", "v" * 30) for i in range(20)])
  b = make_slug("x", None, [(f"k{i}", "v" * 30) for i in range(19)] + [("k19", "w" * 30)])
  assert len(a) == len(b) == MAX_SLUG and a != b and a[:150] == b[:150]


def test_a_slug_of_dots_runs_nothing_and_deletes_nothing(tmp_path, monkeypatch, capsys):
  parent = tmp_path / "P"
  _precious(parent, ["1", "2", "3"])
  (parent / "ck").mkdir()
  monkeypatch.setenv("SEXPGPU_RUN_SLUG", "..")
  code = main(["run", TINY, "--steps", "20", "--checkpoint-dir", str(parent / "ck")])
  err = capsys.readouterr().err
  assert code == 1 and "error[E-ENV-001]" in err and "SEXPGPU_RUN_SLUG" in err, err
  assert "Traceback" not in err
  assert sorted(os.listdir(parent)) == ["1", "2", "3", "ck"] and _intact(parent, "123")
  assert os.listdir(parent / "ck") == []


def test_a_sweep_with_a_slug_of_dots_is_refused(tmp_path, monkeypatch):
  from sexpgpu.tools.sweep import SweepOptions, plan
  monkeypatch.setenv("SEXPGPU_RUN_SLUG", "..")
  with pytest.raises(SxError) as e:
    plan(SweepOptions(file=TINY, grid=[("lr", ["0.01"])], status_dir=str(tmp_path)))
  assert e.value.code == "E-ENV-001"


def test_a_store_refuses_a_slug_that_leaves_its_location(tmp_path):
  with pytest.raises(SxError) as e:
    CheckpointStore(str(tmp_path / "ck"), "..", keep=1)
  assert e.value.code == "E-CKPT-004" and "SEXPGPU_RUN_SLUG" in e.value.fix


# -- pruning ----------------------------------------------------------------------------------


def _state(seed):
  rng = np.random.default_rng(seed)
  return {"w": rng.standard_normal((8, 4)).astype(np.float32), "pos": np.int64(seed)}


@pytest.mark.slow  # runs with checkpoints
def test_a_real_run_prunes_only_the_step_folders_it_wrote(tmp_path):
  ck = tmp_path / "ck"
  exp = sexpgpu.compile(TINY, variant="smoke", set={"checkpoint-every": 2, "keep": 2})
  run_dir = ck / exp.slug
  _precious(run_dir, ["1", "3", "5"])  # named like steps, within what pruning reaches
  summary = exp.run(steps=8, checkpoint_dir=str(ck))
  assert summary.checkpoint == str(run_dir / "8")
  assert sorted(os.listdir(run_dir)) == ["1", "3", "5", "6", "8"]
  assert _intact(run_dir, "135")


def test_an_earlier_runs_step_is_pruned_but_a_folder_with_the_users_files_is_not(tmp_path):
  with CheckpointStore(str(tmp_path), "run", keep=5) as old:
    old.save(1, _state(1), {}, wait=True)  # an earlier run of the same slug: a save's own
  run = tmp_path / "run"
  _precious(run, ["2"])
  shutil.copytree(run / "1", run / "3")
  (run / "3" / "precious.txt").write_text("the user's 3")  # a step folder the user added to
  with CheckpointStore(str(tmp_path), "run", keep=1) as store:
    for step in (4, 5):
      store.save(step, _state(step), {}, wait=True)
  assert sorted(os.listdir(run)) == ["2", "3", "5"]
  assert _intact(run, "23")


def test_saving_over_a_folder_of_the_users_files_is_e_ckpt_004(tmp_path):
  with CheckpointStore(str(tmp_path), "run", keep=3) as old:
    old.save(2, _state(2), {}, wait=True)
  run = tmp_path / "run"
  (run / "2" / "notes.txt").write_text("mine")
  store = CheckpointStore(str(tmp_path), "run", keep=3)
  with pytest.raises(SxError) as e:
    store.save(2, _state(2), {}, wait=True)
  store.close()
  assert e.value.code == "E-CKPT-004" and str(run / "2") in e.value.message
  assert (run / "2" / "notes.txt").read_text() == "mine"


# -- --resume latest --------------------------------------------------------------------------


def _saved(tmp_path, steps=(1, 2, 3)):
  with CheckpointStore(str(tmp_path / "ck"), "run", keep=5) as store:
    for s in steps:
      store.save(s, _state(s), {"step": s}, wait=True)
  return tmp_path / "ck" / "run"


@pytest.mark.parametrize("lost", [MANIFEST, LOCAL_DONE])
def test_no_step_verifies_is_e_ckpt_003_naming_each_folder_and_what_it_lacks(tmp_path, capsys,
                                                                              lost):
  run = _saved(tmp_path, steps=(1, 2))
  for s in ("1", "2"):
    (run / s / lost).unlink()
  with pytest.raises(SxError) as e:
    resolve_resume("latest", str(tmp_path / "ck"), "run")
  text = str(e.value)
  assert e.value.code == "E-CKPT-003" and e.value.where == "--resume latest"
  assert f"{run / '1'}: it has no {lost}" in text and f"{run / '2'}: it has no {lost}" in text
  assert "without --resume" in e.value.fix
  assert capsys.readouterr().err.count("checkpoint: skipped") == 2


@pytest.mark.parametrize("lost", [MANIFEST, LOCAL_DONE])
def test_a_step_that_cannot_be_verified_is_skipped_with_a_line(tmp_path, capsys, lost):
  run = _saved(tmp_path)
  (run / "3" / lost).unlink()
  assert resolve_resume("latest", str(tmp_path / "ck"), "run") == (str(run / "2"),
                                                                   f"latest={run / '2'}")
  err = capsys.readouterr().err
  assert f"checkpoint: skipped {run / '3'}: it has no {lost}" in err


def test_an_empty_run_folder_is_still_latest_none(tmp_path):
  (tmp_path / "ck" / "run" / "7.orbax-checkpoint-tmp-1").mkdir(parents=True)
  assert resolve_resume("latest", str(tmp_path / "ck"), "run") == (None, "latest=none")


@pytest.mark.slow  # runs with checkpoints
def test_a_run_whose_manifests_are_gone_does_not_start_over(tmp_path, capsys):
  ck = tmp_path / "ck"
  exp = sexpgpu.compile(TINY, variant="smoke")
  first = exp.run(steps=2, checkpoint_dir=str(ck))
  os.unlink(os.path.join(first.checkpoint, MANIFEST))
  capsys.readouterr()
  code = main(["run", TINY, "--variant", "smoke", "--steps", "4", "--checkpoint-dir", str(ck),
               "--resume", "latest"])
  err = capsys.readouterr().err
  assert code == 1 and "error[E-CKPT-003]" in err, err
  assert f"{first.checkpoint}: it has no {MANIFEST}" in err
  assert "latest=none" not in err and "done:" not in err
  assert sorted(n for n in os.listdir(ck / exp.slug) if n.isdigit()) == ["2"]

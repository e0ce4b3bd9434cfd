"""`--help` for the program and every command, generated from the absl flags."""

import pytest

from sexpgpu.cli import help as cli_help
from sexpgpu.cli.main import _commands, _run_flags, main

COMMANDS = list(_commands())


def _help(capsys, *args):
  code = main(list(args))
  out, err = capsys.readouterr()
  return code, out, err


def test_program_help_lists_every_command(capsys):
  code, out, _ = _help(capsys, "--help")
  assert code == 0
  for name in COMMANDS:
    line = next(l for l in out.splitlines() if l.strip().startswith(name + " "))
    assert len(line.split(None, 1)[1]) > 10, line  # a one-line meaning
  assert {"run", "check", "sweep", "bundle", "watch", "plot", "doctor"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("spelling", ["--help", "-h"])
def test_every_command_has_help(capsys, name, spelling):
  code, out, err = _help(capsys, name, spelling)
  assert code == 0 and err == "", err
  assert out.startswith(f"usage: sexpgpu {name}")
  assert "error[" not in out


def test_run_help_names_each_flag_with_its_variable(capsys):
  code, out, _ = _help(capsys, "run", "--help")
  assert code == 0
  rows = {l.split()[0]: l for l in out.splitlines() if l.startswith("  --")}
  for flag, variable in [("--device", "SEXPGPU_DEVICE"), ("--metrics", "SEXPGPU_METRICS"),
                         ("--status", "SEXPGPU_STATUS"),
                         ("--checkpoint-dir", "SEXPGPU_CHECKPOINT_DIR"),
                         ("--resume", "SEXPGPU_RESUME")]:
    assert variable in rows[flag].split(), rows[flag]
  fv = _run_flags()
  for name in fv:
    row = rows["--" + name.replace("_", "-")]
    assert len(row.split()) >= 4, row  # flag, value, variable or -, a meaning
  for var, _ in cli_help.OTHER_VARIABLES:
    assert var in out


def test_help_subcommand(capsys):
  code, out, _ = _help(capsys, "help", "check")
  assert code == 0 and out.startswith("usage: sexpgpu check")


def test_no_command_is_usage_on_stderr(capsys):
  code, out, err = _help(capsys)
  assert code == 1 and err.startswith("usage: sexpgpu")

"""The command line: every subcommand turns a bad or missing flag into one line and exit code 2."""

import pytest

from gptrain.__main__ import COMMANDS
from gptrain.__main__ import main as cli


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["sample"], "gptrain sample: the following arguments are required: --run"),
        (["sample", "--run", "r", "--top-k", "many"], "argument --top-k: invalid int value"),
        (["plot"], "gptrain plot: the following arguments are required: --run"),
        (["bench", "--steps", "x"], "gptrain bench: argument --steps: invalid int value: 'x'"),
        (["prepare", "--workers", "two"], "gptrain prepare: argument --workers: invalid int"),
        (["tokenizer"], "gptrain tokenizer: the following arguments are required: cmd"),
        (["tokenizer", "train", "--out", "t.json"], "required: --input, --vocab-size"),
        (["train", "--nope=1"], "nope"),
        (["fly"], "unknown command 'fly'; choose one of: " + ", ".join(COMMANDS)),
    ],
)
def test_bad_flags_are_one_line_exit_2(argv, needle, capsys):
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gptrain: error: "), err
    assert needle in err[0], err[0]


def test_help_lists_the_commands(capsys):
    assert cli(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)

import subprocess
import sys

from qshard.cli import main


def test_version_and_help(capsys):
    assert main(["version"]) == 0
    assert "qshard" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "version" in capsys.readouterr().out


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "qshard.cli", "version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("qshard ")

import subprocess
import sys

from qshard.cli import main


def test_version_and_help(capsys):
    assert main(["version"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("qshard ")
    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        assert capsys.readouterr().out == printed
    assert main(["--help"]) == 0
    assert "version" in capsys.readouterr().out


def test_console_script_runs():
    for module in ("qshard.cli", "qshard"):  # python -m qshard is the command too
        out = subprocess.run(
            [sys.executable, "-m", module, "version"], capture_output=True, text=True, check=True
        )
        assert out.stdout.startswith("qshard "), module

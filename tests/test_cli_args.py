"""The CLI checks every argument and output path before any work starts (issue 33 items 5 and 6,
SPEC T5): a bad number or an unwritable ``--json``/``--plot`` is argparse's one-line error and
exit status 2 with nothing run; a ``ConfigError`` is one line and exit status 2, not a traceback."""

from __future__ import annotations

import pytest

from aiosync.cli import bench, demo, simulate
from aiosync.cli.main import main
from aiosync.errors import ConfigError


@pytest.fixture
def nothing_runs(monkeypatch):
    """Any work started is a failure: the commands' work functions raise."""
    def work(*args, **kwargs):
        raise AssertionError("the command started working before its arguments were checked")

    monkeypatch.setattr(simulate, "simulate", work)
    monkeypatch.setattr(demo, "demo", work)
    monkeypatch.setattr(bench, "run_bench", work)


@pytest.mark.parametrize("argv, word", [
    (["simulate", "--steps", "-3"], "--steps"),
    (["simulate", "--steps", "0"], "--steps"),
    (["simulate", "--minutes", "-1"], "--minutes"),
    (["simulate", "--minutes", "nan"], "--minutes"),
    (["simulate", "--batch", "-2"], "--batch"),
    (["simulate", "--explorers", "0"], "--explorers"),
    (["simulate", "--latency", "-0.1"], "--latency"),
    (["simulate", "--bandwidth", "0"], "--bandwidth"),
    (["simulate", "--max-ahead", "-1"], "--max-ahead"),
    (["bench", "--bucket-size", "0"], "--bucket-size"),
    (["bench", "--elements", "-5"], "--elements"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["bench", "--lr", "0"], "--lr"),
    (["demo", "--envs", "0"], "--envs"),
    (["demo", "--max-seconds", "0"], "--max-seconds"),
    (["demo", "--latency", "-1"], "--latency"),
])
def test_a_bad_argument_is_refused_before_any_work(argv, word, nothing_runs, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and word in err and "Traceback" not in err


@pytest.mark.parametrize("command, flag", [(["simulate"], "--json"), (["bench", "--quick"], "--json"),
                                           (["demo", "--quiet"], "--json"), (["demo", "--quiet"], "--plot")])
def test_an_unwritable_output_path_is_refused_before_any_work(command, flag, tmp_path, nothing_runs, capsys):
    for path in (tmp_path / "missing" / "out.json", tmp_path):  # a folder that does not exist; a folder
        with pytest.raises(SystemExit) as info:
            main([*command, flag, str(path)])
        assert info.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


def test_a_writable_output_path_is_left_as_it_was(tmp_path):
    from aiosync.cli.args import output_path

    fresh, kept = tmp_path / "new.json", tmp_path / "old.json"
    kept.write_text("keep me")
    assert output_path(str(fresh)) == str(fresh) and not fresh.exists()
    assert output_path(str(kept)) == str(kept) and kept.read_text() == "keep me"


def test_a_config_error_is_one_line_and_exit_status_2(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise ConfigError("weight_syncer.bucket.bucket_size must be a positive integer (bytes), got 0")

    monkeypatch.setattr(bench, "run_bench", refuse)
    assert main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err == "aiosync bench: weight_syncer.bucket.bucket_size must be a positive integer (bytes), got 0\n"

"""Optional output cannot end a run (issue 57): the console (cli.Console) when the pipe behind it is gone,
and --metrics-out (commands/common.MetricsFile) when a record cannot be written. In one process, on real
file descriptors: a pipe whose reader has closed (what a killed launcher or `| head` leaves), and a metrics
path that became a directory (an OSError from open, as a full disk or a lost mount gives)."""

from __future__ import annotations

import io
import json
import os

from longstraw_mcore.cli import Console
from longstraw_mcore.commands.common import MetricsFile


def test_a_console_whose_pipe_is_gone_goes_quiet_and_the_run_goes_on():
    read_end, write_end = os.pipe()
    stream = io.TextIOWrapper(io.FileIO(write_end, "w"), line_buffering=True)
    console = Console(stream)
    console.write("before\n")
    assert os.read(read_end, 100) == b"before\n"
    os.close(read_end)
    console.write("after the reader left\n")  # EPIPE: silenced, not raised
    console.flush()
    assert console.lost
    console.write("x" * 100_000)
    stream.flush()  # (the interpreter's own flush at exit: the descriptor now goes to /dev/null)
    assert os.readlink(f"/proc/self/fd/{stream.fileno()}") == os.devnull
    stream.close()


def test_metrics_that_cannot_be_written_are_counted_and_said_once(tmp_path, capsys):
    path = tmp_path / "run" / "metrics.jsonl"
    m = MetricsFile(str(path))
    m.append({"step": 1, "loss": 0.5})
    path.unlink()
    path.mkdir()  # open(path, "a") now fails as a full disk would
    m.append({"step": 2, "loss": 0.4})
    m.append({"step": 3, "loss": 0.3})
    path.rmdir()
    m.append({"step": 4, "loss": 0.2})
    assert [json.loads(x) for x in path.read_text().splitlines()] == \
        [{"step": 4, "loss": 0.2, "metrics_write_failures": 2}]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "a metrics record was not written" in err[0] and str(path) in err[0], err

"""LogProgress (the online encoding's progress in a server's log): a line every few seconds with done/total, rate
and ETA, and one when the planned work is done; the logger shows INFO lines where nothing else configured it."""

import logging

from exl3rt.util.progress import LogProgress, visible_logger


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_lines_every_interval_with_eta_and_a_last_line(caplog):
    clock = Clock()
    log = logging.getLogger("exl3rt.test.progress")
    p = LogProgress(log, "encoding", unit="w", interval=5.0, clock=clock)
    p.plan(1000)
    p.plan(1000)
    with caplog.at_level(logging.INFO, logger="exl3rt.test.progress"):
        p.update(100, "layer.0")            # starts the clock: no line yet (nothing measured)
        clock.t += 2
        p.update(100, "layer.1")            # 2 s: inside the interval
        clock.t += 4
        p.update(200, "layer.2")            # 6 s after the start: a line; 400 w in 6 s, 1600 left -> 24 s
        clock.t += 10
        p.update(1600, "layer.3")           # all done: the last line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == "encoding: 400/2.0kw (20.0 %), 67w/s, elapsed 00:06, eta 00:24 (layer.2)"
    assert lines[1].startswith("encoding: 2.0k/2.0kw (100.0 %), 125w/s, elapsed 00:16, done in 00:16")


def test_visible_logger_shows_info_only_where_nothing_was_configured():
    fresh = visible_logger("exl3rt.test.visible.fresh")
    assert fresh.handlers and fresh.getEffectiveLevel() == logging.INFO and not fresh.propagate
    configured = logging.getLogger("exl3rt.test.visible.configured")
    handler = logging.NullHandler()
    configured.addHandler(handler)
    try:
        assert visible_logger("exl3rt.test.visible.configured").handlers == [handler]
    finally:
        configured.removeHandler(handler)

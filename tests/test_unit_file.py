"""The systemd unit agrees with what the daemon does: stop timeouts, and the fd limit."""

import configparser

from conftest import ROOT
from gpuwarden.config import ServeConfig
from gpuwarden.service.daemon import STOP_MARGIN_S
from gpuwarden.serving.compose.drain import DRAIN_MARGIN_S
from gpuwarden.web.server import MAX_CONNECTIONS


def unit():
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(ROOT / "units" / "gpuwarden.service")
    return parser["Service"]


def test_timeout_stop_covers_the_default_drain_and_longer_ones_are_announced():
    stop = int(unit()["TimeoutStopSec"])
    serve = ServeConfig()
    assert stop >= max(serve.stop_timeout_s, serve.drain_s + DRAIN_MARGIN_S) + STOP_MARGIN_S
    # Larger serve.stop_timeout_s and drain_s values are covered by EXTEND_TIMEOUT_USEC, sent by the daemon as
    # it begins a stop: test_faults.py and test_drain.py check the message on a real stop.


def test_the_fd_limit_leaves_room_for_the_connection_cap_and_keeps_select_safe():
    soft, hard = (int(v) for v in unit()["LimitNOFILE"].split(":"))
    assert MAX_CONNECTIONS + 200 <= soft <= 1024 < hard

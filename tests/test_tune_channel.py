"""The clients of the control channel (tune/channel.py): Connection, bounded; and tune's SweepClient on it: the
lease-lost signal (SIGUSR1) raises LeaseLost once, a storm's later signals do nothing. The channel against a real daemon is in test_tune.py."""

import pytest

from gpuwarden.tune.channel import LeaseLost, SweepClient


def test_a_second_lease_lost_signal_during_cleanup_raises_nothing():
    # A SIGUSR1 storm from outside after the lease was lost raised LeaseLost again inside the sweep's cleanup:
    # a traceback instead of tune's one line.
    client = SweepClient.__new__(SweepClient)
    import threading
    client._stop, client.lost, client._raised = threading.Event(), "the daemon closed the control channel", False
    with pytest.raises(LeaseLost):
        client._on_lost(10, None)
    client._on_lost(10, None)  # the storm's next signals: nothing
    client._on_lost(10, None)


def _served(tmp_path, answer: bytes | None):
    """A control socket whose one connection is answered once with answer (None: closed unanswered)."""
    import socket
    import threading

    path = tmp_path / "control.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            if answer is not None:
                conn.sendall(answer)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # until the client closes
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    return path


@pytest.mark.parametrize("answer, said", [
    (b'{"ok": true, "cleared": {}}\n', None),
    (b'{"ok": true', "the daemon closed the control channel"),
    (None, "the daemon closed the control channel"),
    (b"[1, 2]\n", "did not answer with one JSON object"),
    (b"not json\n", "did not answer with one JSON object"),
    (b"[" * 70000 + b"\n", "answered more than 65536 bytes in a line"),
])
def test_every_client_of_the_control_socket_reads_one_bounded_json_answer(tmp_path, answer, said):
    """One Connection for tune and `health clear`: an answer is one JSON object on one line of at most ANSWER_MAX
    bytes; anything else is one ChannelLost sentence, never a traceback or a read without end."""
    from gpuwarden.tune.channel import ChannelLost, Connection

    connection = Connection(_served(tmp_path, answer))
    try:
        if said is None:
            assert connection.ask({"op": "health-clear"}) == {"ok": True, "cleared": {}}
        else:
            with pytest.raises(ChannelLost, match=said):
                connection.ask({"op": "health-clear"})
    finally:
        connection.close()


def test_no_daemon_on_the_control_socket_is_one_sentence(tmp_path):
    from gpuwarden.tune.channel import Connection, Unreachable

    with pytest.raises(Unreachable, match="no daemon answers on .*control.sock: is it running"):
        Connection(tmp_path / "control.sock")

"""Stopping a socket's monitor while connections come and go: a process that stops cannot be held by a
connection that handshakes as it stops (the scheduler's stop was, now and then, before the order below)."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STOP_WHILE_A_PEER_HANDSHAKES = textwrap.dedent(
    """
    import tempfile, zmq
    from shared import sockets

    context = zmq.Context()
    address = "ipc://" + tempfile.mkdtemp() + "/router"
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    monitor = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    peers = []

    class MonitorThenAHandshake:
        '''The monitor's socket, whose closing a connection's handshake follows at once.'''

        def close(self):
            monitor.close()
            peer = context.socket(zmq.DEALER)
            peer.connect(address)
            peers.append(peer)
            peer.send(b"hello")  # it arrives once the connection has handshaken, on ZeroMQ's I/O thread
            assert router.poll(10_000) and router.recv_multipart()[-1] == b"hello"

    sockets.stop_monitors([router], [MonitorThenAHandshake()])
    context.destroy(linger=0)
    print("stopped")
    """
)


def test_a_connection_handshaking_as_the_monitors_stop_cannot_hold_the_stop():
    done = subprocess.run(
        [sys.executable, "-c", STOP_WHILE_A_PEER_HANDSHAKES],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and done.stdout.strip() == "stopped", done.stderr[-2000:]

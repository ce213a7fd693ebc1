"""A stop signal reaches a service's loop only at its next poll, never amid a message or an update."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

SERVICE_LOOP = textwrap.dedent(
    """
    import os, select, signal, time
    from shared.cli import drain_wakeups, stop_on_signals, stops_deferred

    wakeup = stop_on_signals()
    done = []
    try:
        with stops_deferred():
            while True:
                with stops_deferred():  # a step inside the loop: leaving it keeps the loop's deferral
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGTERM)
                for part in range(3):  # a message of several frames, or an update of several fields
                    time.sleep(0.05)
                    done.append(part)
                select.select([wakeup], [], [], 5)
                drain_wakeups()
                done.append("after the poll")
    except KeyboardInterrupt:
        print("stopped after", done)
    """
)


def test_a_signal_amid_the_loop_stops_it_at_its_next_poll_with_the_work_between_complete():
    result = subprocess.run([sys.executable, "-c", SERVICE_LOOP], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "stopped after [0, 1, 2]", result.stdout + result.stderr

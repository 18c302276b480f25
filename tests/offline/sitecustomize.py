"""Only the loopback can be reached: Python loads this at start-up in every process whose path starts here.

``conftest.network_blocked_env`` puts this directory on a launch's ``PYTHONPATH``; the ``no_network``
fixture applies the same guard inside the test process.
"""

import socket

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def guarded(connect):
    """``socket.socket.connect`` that refuses every address but the loopback's (Unix sockets pass)."""

    def loopback_only(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if self.family != socket.AF_UNIX and host not in LOOPBACK:
            raise OSError(f"network blocked in tests: {address}")
        return connect(self, address)

    return loopback_only


if __name__ == "sitecustomize":
    socket.socket.connect = guarded(socket.socket.connect)

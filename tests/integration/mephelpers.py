"""Small helpers shared by the integration tests: locating the binaries and running a
command with a timeout. Standard library only."""
import os
import subprocess
import time
import unittest

# Generous per-command limit: a hung binary fails its test instead of stalling ctest.
DEFAULT_TIMEOUT_S = 60


def wait_for(predicate, timeout=30, interval=0.05):
    """Polls `predicate` until it returns a true value (returned) or `timeout` passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def mep_bin():
    """The mep binary from $MEP_BIN (ctest sets it); skips the test when it is unset."""
    path = os.environ.get("MEP_BIN")
    if not path:
        raise unittest.SkipTest("MEP_BIN is not set (run through ctest)")
    return path


def run(argv, stdin=b"", timeout=DEFAULT_TIMEOUT_S, env=None):
    """Runs argv with `stdin` (bytes) and returns (returncode, stdout bytes, stderr bytes).
    Raises subprocess.TimeoutExpired (after killing the process) when it runs too long."""
    proc = subprocess.run(argv, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=timeout, env=env, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def send_expecting_continue(sock, head, body):
    """Sends a request header that carries `Expect: 100-continue`, waits for the interim
    `HTTP/1.1 100 Continue` (socket.timeout when none comes), then sends the body."""
    sock.sendall(head)
    interim = b""
    while b"\r\n\r\n" not in interim:
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError("the connection closed before the 100")
        interim += chunk
    if interim != b"HTTP/1.1 100 Continue\r\n\r\n":
        raise AssertionError("expected only an interim 100, got %r" % interim[:300])
    sock.sendall(body)


def read_to_close(sock):
    """Everything the peer writes until it closes the connection."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def send_all_then_read(sock, request):
    """Sends the whole request before reading anything (as Python's http.client does with
    a body and no Expect), then reads the answer until the peer closes. Returns
    (status line bytes, whole reply); a send or read error (the peer reset the connection
    while the body was still on its way) propagates to the caller."""
    sock.sendall(request)
    reply = read_to_close(sock)
    return reply.split(b"\r\n", 1)[0], reply


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process that must listen on
    the same port when started again)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port

"""The listener's handshake: any bytes from a stranger are dropped, only the run's hello admitted."""

import selectors
import socket
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from pycollect.plugins import mesh as rendezvous_mesh

TOKEN = b"t" * 32
CONTEXT = b"c" * 32


def _dropped(mesh, sock):
    """The mesh dropped ``sock``: closed it, or shut it for writing and drains it before it
    closes it (so that the caller reads why it was refused)."""
    if sock.fileno() < 0:
        return True
    key = mesh.sel.get_map().get(sock)
    return key is not None and key.data[0] == "draining"


def _feed(payload, close=True):
    """Hand ``payload`` to rank 0's handshake; return "admitted", "dropped" or "waiting"."""
    mesh = rendezvous_mesh.Mesh(0, 3, TOKEN, CONTEXT, time.monotonic() + 5)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    state = {"buf": b"", "addr": ("198.18.0.9", 4242), "since": time.monotonic()}
    mesh.sel.register(ours, selectors.EVENT_READ, ("incoming", state))
    try:
        theirs.sendall(payload)
        if close:
            theirs.shutdown(socket.SHUT_WR)
        for _ in range(len(payload) // 8 + 4):       # bounded: one read per pass
            mesh._on_incoming(ours, state)
            if _dropped(mesh, ours):
                return "dropped"
            if any(s is not None for s in mesh.socks):
                return "admitted"
        return "waiting"
    finally:
        for s in mesh.socks:
            if s is not None:
                s.close()
        if ours.fileno() >= 0:
            ours.close()
        theirs.close()
        mesh.sel.close()


def _hello(**fields):
    values = dict(magic=rendezvous_mesh.HELLO_MAGIC, version=rendezvous_mesh.VERSION, flags=0,
                  src=1, dst=0, context=CONTEXT, token=TOKEN)
    values.update(fields)
    return rendezvous_mesh.HELLO.pack(values["magic"], values["version"], values["flags"],
                                      values["src"], values["dst"], values["context"],
                                      values["token"])


def test_the_runs_hello_is_admitted():
    assert _feed(_hello(), close=False) == "admitted"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_are_dropped(payload):
    assert _feed(payload) == "dropped"


@settings(max_examples=200, deadline=None)
@given(token=st.binary(min_size=32, max_size=32), context=st.binary(min_size=32, max_size=32),
       src=st.integers(-2**31, 2**31 - 1), dst=st.integers(-2**31, 2**31 - 1),
       version=st.integers(0, 2**16 - 1))
def test_hellos_with_wrong_fields_are_dropped(token, context, src, dst, version):
    payload = _hello(token=token, context=context, src=src, dst=dst, version=version)
    expected = ("admitted" if (token, context, version, dst) == (TOKEN, CONTEXT, rendezvous_mesh.VERSION, 0)
                and 0 < src < 3 else "dropped")
    assert _feed(payload) == expected


def test_a_silent_stranger_is_dropped_after_the_grace_period(monkeypatch):
    monkeypatch.setattr(rendezvous_mesh, "STRANGER_GRACE_S", 0.0)
    mesh = rendezvous_mesh.Mesh(0, 2, TOKEN, CONTEXT, time.monotonic() + 5)
    ours, theirs = socket.socketpair()
    state = {"buf": b"", "addr": ("198.18.0.9", 4242), "since": time.monotonic() - 1}
    mesh.sel.register(ours, selectors.EVENT_READ, ("incoming", state))
    mesh._expire_strangers()
    assert _dropped(mesh, ours)
    theirs.close()
    mesh.sel.close()

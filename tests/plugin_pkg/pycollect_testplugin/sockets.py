"""Transport "testplugin-sockets": pycollect's rendezvous mesh, every pair on this package's
own Cython channel (``_sockets.pyx``)."""

__all__ = ["create_socket_transport"]


def create_socket_transport(rank, size, store, **options):
    """Connect the mesh as pycollect's "tcp" does, then carry every pair on our channel."""
    from pycollect.plugins.transports.tcp import open_tcp

    from ._sockets import CountingSocketChannel

    transport, _ = open_tcp(rank, size, store, **options)
    try:
        for peer in range(size):
            if peer != rank:
                transport.set_channel(peer, CountingSocketChannel(transport.channel(peer)))
    except BaseException:
        transport.close()
        raise
    return transport

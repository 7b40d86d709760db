"""free_port picks the port a TCP store binds seconds later (while workers start): never one the kernel may hand to
an outgoing connection or a bind(0) meanwhile (the ephemeral range), never one that is in use."""

import random
import socket

from allsync.launch.group import PORTS, ephemeral_start, free_port


def test_ports_come_from_below_the_ephemeral_range_and_above_rays_worker_ports():
    low = ephemeral_start()
    for _ in range(50):
        port = free_port()
        assert 20000 <= port < min(low, 32768) and not 29400 <= port < 29600


def test_a_port_in_use_is_never_returned():
    """The draw that would come first is taken by a listener: the next drawn one comes back."""
    first = free_port(rng=random.Random(7))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen()
        port = free_port(rng=random.Random(7))
    assert port != first and port in PORTS


def test_the_ephemeral_range_is_read_from_the_kernel_setting(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("24000\t60999\n")
    assert ephemeral_start(str(setting)) == 24000
    assert ephemeral_start(str(tmp_path / "missing")) == 32768

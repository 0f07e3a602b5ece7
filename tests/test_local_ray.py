"""serve_app.local_ray's port pick: outside the range Ray's own servers draw from, and free."""

import socket

from serve_app import local_ray


def test_a_picked_port_lies_between_rays_worker_ports_and_the_ephemeral_range_and_binds():
    low, high = local_ray.RAY_WORKER_PORTS_MAX + 1, local_ray._ephemeral_low() - 1
    assert high - low > 100  # Linux's default range leaves room below it
    ports = {local_ray.free_loopback_port() for _ in range(20)}
    assert all(low <= port <= high for port in ports), ports
    assert len(ports) > 1  # drawn at random: two processes picking at once rarely collide
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_taken_port_is_never_picked(monkeypatch):
    with socket.socket() as taken, socket.socket() as other:
        taken.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        port, free = taken.getsockname()[1], other.getsockname()[1]
        other.close()  # free again: the one the pick may return
        draws = iter([port, port, free])
        monkeypatch.setattr(local_ray, "RAY_WORKER_PORTS_MAX", min(port, free) - 1)
        monkeypatch.setattr(local_ray, "_ephemeral_low", lambda: max(port, free) + 1000)
        monkeypatch.setattr(local_ray._rng, "randint", lambda lo, hi: next(draws))
        assert local_ray.free_loopback_port() == free

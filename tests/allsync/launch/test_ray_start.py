"""A Ray instance of the run's own is started again when Ray's fixed 30 s wait for its raylet runs out (a loaded
machine passes it), and only then. ray.init is replaced by a recorder here: what is tested is the retry rule, on
the exception text Ray 2.60 raises (ray/_private/node.py)."""

import pytest
import ray

from allsync.launch.ray_actors import start_own_ray

RAY_TIMEOUT = Exception(
    "The current node timed out during startup. This could happen because some of the raylet failed to startup or "
    "the GCS has become overloaded."
)


@pytest.fixture
def ray_init(monkeypatch):
    """ray.init raising the queued errors in turn, then returning; the calls' keyword arguments recorded."""
    calls, errors = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if errors:
            raise errors.pop(0)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    return calls, errors


def test_a_start_that_timed_out_is_started_again(ray_init, capsys):
    calls, errors = ray_init
    errors.append(RAY_TIMEOUT)
    start_own_ray(2)
    assert len(calls) == 2 and calls[1]["num_cpus"] == 2 and calls[1]["address"] == "local"
    assert "starting it again (2 of 3)" in capsys.readouterr().out


def test_other_errors_and_the_last_timeout_are_raised(ray_init):
    calls, errors = ray_init
    errors.append(ValueError("bad argument"))
    with pytest.raises(ValueError, match="bad argument"):
        start_own_ray(2)
    assert len(calls) == 1
    errors.extend([RAY_TIMEOUT] * 3)
    with pytest.raises(Exception, match="timed out during startup"):
        start_own_ray(2)
    assert len(calls) == 4

"""Launch modes have names: `run.launch` picks one (a module of run.imports may register its own), and with it unset
the built-in modes are chosen by their own rules, never by which modules a run imported or in which order."""

import pytest

from allsync.config import ConfigError, parse_config
from allsync.launch.group import LAUNCH_MODES, launch_mode, launch_modes, register_launch_mode


class InlineMode:
    """one worker in this process, the test's own mode (no `order`: chosen only by name)"""

    name = "inline_test"

    @staticmethod
    def chosen(launched: bool, no_ray: bool, config) -> bool:
        return not launched


@pytest.fixture
def inline_mode():
    register_launch_mode(InlineMode)
    yield InlineMode
    del LAUNCH_MODES[InlineMode.name]


def config(workers: int = 1, launch: str | None = None):
    return parse_config({"parallel": {"workers_per_node": workers}, "run": {"launch": launch}})


def test_the_built_in_modes_are_chosen_by_their_rules_and_by_name(inline_mode):
    names = {name: mode.__name__ for name, mode in launch_modes().items()}
    assert {"spmd": "SPMDGroup", "local": "LocalGroup", "ray": "RayGroup"}.items() <= names.items()
    # run.launch unset: the registered extension changes nothing
    assert launch_mode(True, False, config(2)).name == "spmd"
    assert launch_mode(False, False, config(1)).name == "local"
    assert launch_mode(False, True, config(2)).name == "local"
    assert launch_mode(False, False, config(2)).name == "ray"
    assert launch_mode(False, False, config(2, "inline_test")) is InlineMode
    assert launch_mode(False, False, config(1, "ray")).name == "ray"


def test_a_mode_that_cannot_run_or_does_not_exist_is_refused_naming_run_launch(inline_mode):
    with pytest.raises(ConfigError, match=r"run\.launch = 'mpi': use one of inline_test, local, ray, spmd"):
        launch_mode(False, False, config(2, "mpi"))
    with pytest.raises(ConfigError, match=r"run\.launch = spmd: this run cannot be one \(started by a launcher: False"):
        launch_mode(False, False, config(2, "spmd"))
    with pytest.raises(ConfigError, match=r"run\.launch = inline_test: this run cannot be one"):
        launch_mode(True, False, config(2, "inline_test"))


def test_a_second_mode_of_a_name_or_an_outside_mode_with_an_order_is_refused(inline_mode):
    class Again(InlineMode):
        pass

    with pytest.raises(ValueError, match=r"launch mode 'inline_test' is registered twice"):
        register_launch_mode(Again)

    class Ordered(InlineMode):
        name, order = "ordered_test", -1

    with pytest.raises(ValueError, match=r"launch mode 'ordered_test' \([\w.]*test_launch_modes\) has an order"):
        register_launch_mode(Ordered)
    assert "ordered_test" not in LAUNCH_MODES

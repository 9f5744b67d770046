"""The one check of the stage names a user function returns (route, stream_done_to, wait_for,
terminal_stages): omni_core.runtime.types.chosen_names."""

from __future__ import annotations

import pytest

from omni_core.runtime.types import WiringError, chosen_names

ALLOWED = ("a", "b", "c")


@pytest.mark.parametrize(("answer", "names"), [
    ("b", ["b"]), (["c", "a", "c"], ["c", "a"]), (("a",), ["a"]), ("*", ["a", "b", "c"]), ([], []),
])
def test_a_name_a_list_or_all(answer, names):
    assert chosen_names(answer, ALLOWED, "route_fn 'r'") == names


def test_none_means_all_only_where_the_function_may_say_so():
    assert chosen_names(None, ALLOWED, "terminal_stages_fn 't'", none_is_all=True) == list(ALLOWED)
    with pytest.raises(WiringError, match=r"route_fn 'r' returned None; expected a stage name"):
        chosen_names(None, ALLOWED, "route_fn 'r'")


@pytest.mark.parametrize(("answer", "message"), [
    (["a", "x"], r"returned \['x'\] which is not in \['a', 'b', 'c'\]"),
    (["x", "y"], r"returned \['x', 'y'\] which are not in"),
    ([1], r"returned \[1\]; expected a stage name or a list of names"),
    ({"a": 1}, r"returned \{'a': 1\}; expected a stage name or a list of names"),
])
def test_unknown_names_and_wrong_types_are_wiring_errors_naming_the_function(answer, message):
    with pytest.raises(WiringError, match=r"wait_for_fn 'w' of stage 's' " + message):
        chosen_names(answer, ALLOWED, "wait_for_fn 'w' of stage 's'")


def test_an_empty_answer_is_refused_where_one_name_is_needed():
    with pytest.raises(WiringError, match=r"returned \[\]; expected at least one of"):
        chosen_names([], ALLOWED, "terminal_stages_fn 't'", none_is_all=True, empty_ok=False)

"""Whole-graph validation and the corpus of bad configs: every error with its path and a hint.

Each file in ``tests/configs/bad`` starts with ``# expect: PATH | FRAGMENT`` lines: the config must
fail with exactly that many errors, one at each PATH (``<config>`` for the file as a whole) whose
text contains FRAGMENT.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omni_core.config import collect_issues, load_config, structure, validate_config
from omni_core.errors import ConfigError, ConfigIssue

BAD = Path(__file__).parent / "configs" / "bad"
EXPECT = re.compile(r"^# expect: (?P<path>\S+) \| (?P<fragment>.+)$")


def expectations(path: Path) -> list[tuple[str, str]]:
    found = [m.group("path", "fragment") for m in map(EXPECT.match, path.read_text().splitlines()) if m]
    assert found, f"{path.name} has no '# expect:' lines"
    return found


def issue_text(issue: ConfigIssue) -> str:
    return f"{issue.message} ({issue.hint})" if issue.hint else issue.message


@pytest.mark.parametrize("path", sorted(BAD.glob("*.yaml")), ids=lambda p: p.stem)
def test_bad_config_reports_every_error_at_its_path(path, registry):
    with pytest.raises(ConfigError) as caught:
        load_config(path, registry=registry)
    error = caught.value
    expected = expectations(path)
    actual = [(issue.path or "<config>", issue_text(issue)) for issue in error.issues]
    unmatched = list(actual)
    for want_path, fragment in expected:
        match = next((a for a in unmatched if a[0] == want_path and fragment in a[1]), None)
        assert match, f"no error at {want_path!r} containing {fragment!r}; got {actual}"
        unmatched.remove(match)
    assert not unmatched, f"unexpected errors: {unmatched}"
    assert error.source == str(path)
    assert str(error).startswith(f"invalid pipeline config {path}: {len(expected)} error")


def test_error_message_lists_every_issue_with_path_message_and_hint():
    error = ConfigError([
        ConfigIssue("stages[2].wait_for[0]", "stage 'a' does not route to 'c'", "add 'c' to stages[0].next"),
        ConfigIssue("", "cannot parse"),
    ], source="p.yaml")
    assert str(error) == (
        "invalid pipeline config p.yaml: 2 errors\n"
        "  - stages[2].wait_for[0]: stage 'a' does not route to 'c' (add 'c' to stages[0].next)\n"
        "  - <config>: cannot parse"
    )
    assert str(ConfigError("just text")) == "invalid pipeline config: 1 error\n  - <config>: just text"


def stage(name: str, **fields):
    return {"name": name, "factory": "acme.upper", **fields}


def issues_of(registry, *stages, **pipeline) -> list[tuple[str, str]]:
    cfg = structure({"name": "t", "stages": list(stages), **pipeline})
    return [(i.path, i.message) for i in collect_issues(cfg, registry)]


def test_valid_graph_has_no_issues(registry):
    assert issues_of(registry, stage("a", next="b"), stage("b", terminal=True)) == []


def test_validate_config_raises_one_error_with_every_issue(registry):
    cfg = structure({"name": "t", "stages": [stage("a", next="x"), stage("a")]})
    with pytest.raises(ConfigError) as caught:
        validate_config(cfg, registry=registry, source="inline")
    paths = [i.path for i in caught.value.issues]
    assert paths == ["stages[1].name", "stages[0].next[0]", "stages[1]", "stages"]
    assert caught.value.source == "inline"


def test_self_loop_is_a_cycle_unless_declared(registry):
    loop = stage("a", next=["a", "b"], route_fn="omni.route_by_key")
    assert issues_of(registry, loop, stage("b", terminal=True)) == [
        ("stages", "the stages form a cycle: a -> a")
    ]
    assert issues_of(registry, loop, stage("b", terminal=True), allow_cycles=True) == []


def test_declared_cycle_needs_a_route_fn_in_every_loop(registry):
    stages = [
        stage("a", next=["b", "d"], route_fn="acme.pick"),
        stage("b", next="a"),
        stage("d", next=["e"]),
        stage("e", next=["d", "f"]),
        stage("f", terminal=True),
    ]
    assert issues_of(registry, *stages, allow_cycles=True) == [
        ("stages", "the cycle through d, e has no route_fn, so a request would loop forever")
    ]


def test_tp_stage_alone_in_a_named_process_is_fine(registry):
    assert issues_of(registry, stage("a", next="b", process="big", tp_size=2), stage("b", terminal=True)) == []


def test_stages_sharing_a_process_and_gpu_settings_are_fine(registry):
    assert issues_of(
        registry,
        stage("a", next="b", process="p", gpu=0, env={"X": "1"}),
        stage("b", terminal=True, process="p", gpu=0, env={"X": "1"}),
    ) == []


def test_stage_may_name_its_own_process_after_itself(registry):
    assert issues_of(registry, stage("a", next="b", process="a"), stage("b", terminal=True, process="a")) == []


def test_entry_stage_can_be_any_stage(registry):
    assert issues_of(registry, stage("a", terminal=True), stage("b", next="a"), entry_stage="b") == []
    assert issues_of(registry, stage("a", terminal=True), stage("b", next="a")) == [
        ("stages[1]", "stage 'b' is not reachable from the entry stage 'a'")
    ]


def test_fan_in_with_a_conditional_source_is_fine_with_wait_for_fn(registry):
    assert issues_of(
        registry,
        stage("a", next=["b", "c"], route_fn="acme.pick"),
        stage("b", next="c"),
        stage("c", wait_for=["a", "b"], wait_for_fn="acme.wait", merge_fn="acme.join", terminal=True),
    ) == []


def test_dotted_paths_resolve_for_every_function_kind(registry):
    fixtures = "plugin_fixtures"
    assert issues_of(
        registry,
        stage("a", factory=f"{fixtures}:Upper", next=["b"], route_fn=f"{fixtures}:pick",
              project_payload={"b": f"{fixtures}:project"}, stream_to=["b"],
              stream_done_to_fn=f"{fixtures}:done_to"),
        stage("b", terminal=True),
        terminal_stages_fn=f"{fixtures}:terminals",
    ) == []


def test_factory_arguments_are_checked_only_when_the_factory_is_already_imported(registry, tmp_path, monkeypatch):
    (tmp_path / "omnitest_unimported_factory.py").write_text("def make(model): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # not imported: validation must not import it just to check arguments
    lazy = stage("a", factory="omnitest_unimported_factory:make", args={"wrong": 1}, terminal=True)
    assert issues_of(registry, lazy) == []
    assert issues_of(registry, stage("a", factory="acme.lazy", args={"wrong": 1}, terminal=True)) == []


def test_factory_arguments_are_checked_for_imported_dotted_paths(registry):
    assert issues_of(registry, stage("a", factory="plugin_fixtures:NeedsModel", args={"model": "m", "dtype": "f16"},
                                     terminal=True)) == [
        ("stages[0].args.dtype", "factory 'plugin_fixtures:NeedsModel' does not accept argument 'dtype'")
    ]


def test_injected_arguments_need_not_be_in_args(registry):
    assert issues_of(registry, stage("a", factory="plugin_fixtures:NeedsModel", args={"model": "m"}, terminal=True)) == []


def test_factory_taking_any_keyword_accepts_any_args(registry):
    assert issues_of(registry, stage("a", factory="builtins:dict", args={"anything": 1}, terminal=True)) == []


def test_rules_report_in_order_of_the_file_within_each_rule(registry):
    found = issues_of(registry, stage("a", next="x"), stage("b", next="y"), stage("c", terminal=True))
    assert [p for p, _ in found][:2] == ["stages[0].next[0]", "stages[1].next[0]"]


def test_importing_factories_checks_a_lazily_registered_factory(registry):
    # acme.lazy is registered by dotted path: only an importing check (omni validate) sees its signature
    cfg = structure({"name": "t", "stages": [stage("a", factory="acme.lazy", args={"prefx": "x"}, terminal=True)]})
    assert collect_issues(cfg, registry) == []
    [issue] = collect_issues(cfg, registry, import_factories=True)
    assert issue.path == "stages[0].args.prefx"
    assert issue.message == "factory 'acme.lazy' does not accept argument 'prefx' (did you mean 'prefix'?)"


def test_importing_factories_reports_a_missing_attribute_at_the_factory(registry):
    cfg = structure({"name": "t", "stages": [stage("a", factory="plugin_fixtures:Uper", terminal=True)]})
    [issue] = collect_issues(cfg, registry, import_factories=True)
    assert issue.path == "stages[0].factory"
    assert issue.message.startswith("module 'plugin_fixtures' has no attribute 'Uper'")

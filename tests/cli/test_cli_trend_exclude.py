"""``trend --exclude GLOB`` and gradclip's own clipped copies in a run's folder (issue 41, item 4).

``gradclip clip run/step_10.pt --max-norm 1`` writes ``run/step_10.clipped.pt``
beside its input: the same step with other norms. ``trend run/`` leaves such
a copy out with a note; any other second file of one step is refused
naming ``--exclude``, which leaves it out.
"""

from __future__ import annotations

from .support import unwrapped
from .test_cli_trend import save_run

STEPS = tuple(range(1, 11))


def _sources(result) -> list[str]:
    return [p["source"] for p in result.json()["points"]]


def test_clipped_copy_beside_its_source_is_left_out_with_a_note(gradclip, tmp_path):
    run = tmp_path / "run"
    save_run(run, STEPS, name="step_{step}.pt")
    clipped = gradclip("clip", run / "step_10.pt", "--max-norm", "1")
    assert clipped.code == 0 and (run / "step_10.clipped.pt").is_file()
    result = gradclip("trend", run, "--format", "json")
    assert result.code == 0, result.err
    assert _sources(result) == [str(run / f"step_{n}.pt") for n in STEPS]
    assert any(note.startswith(f"left out: {run / 'step_10.clipped.pt'}: gradclip clip's "
                               f"copy of {run / 'step_10.pt'}")
               for note in result.json()["notes"])
    table = gradclip("trend", run)
    assert "left out:" in unwrapped(table.out) and "step_10.clipped.pt" in table.out


def test_another_copy_is_refused_naming_exclude_which_leaves_it_out(gradclip, tmp_path):
    run = tmp_path / "run"
    save_run(run, STEPS, name="step_{step}.pt")
    copy = run / "step_10_small.pt"
    assert gradclip("clip", run / "step_10.pt", "--max-norm", "1", "-o", copy).code == 0
    refused = gradclip("trend", run)
    assert refused.code == 2
    assert "both give step 10" in refused.err and "--exclude" in refused.err
    for glob in ("*_small.pt", str(copy)):
        result = gradclip("trend", run, "--exclude", glob, "--format", "json")
        assert result.code == 0, (glob, result.err)
        assert str(copy) not in _sources(result) and len(_sources(result)) == len(STEPS)
        assert f"left out: {copy} (--exclude {glob})" in result.json()["notes"]


def test_exclude_applies_to_paths_as_given_and_is_repeatable(gradclip, tmp_path):
    run = tmp_path / "run"
    save_run(run, STEPS, name="step_{step}.pt")
    given = [run / f"step_{n}.pt" for n in STEPS]
    result = gradclip("trend", *given, "--exclude", "step_1.pt", "--exclude", "*_2.pt",
                      "--format", "json")
    assert result.code == 0
    assert _sources(result) == [str(p) for p in given[2:]]
    none_left = gradclip("trend", given[0], "--exclude", "*.pt")
    assert none_left.code == 2 and "--exclude leaves out every input" in none_left.err


def test_a_clipped_copy_given_by_name_is_read(gradclip, tmp_path):
    run = tmp_path / "run"
    save_run(run, (1, 2), name="step_{step}.pt")
    assert gradclip("clip", run / "step_2.pt", "--max-norm", "1").code == 0
    result = gradclip("trend", run / "step_1.pt", run / "step_2.clipped.pt", "--format", "json")
    assert result.code == 0
    assert _sources(result) == [str(run / "step_1.pt"), str(run / "step_2.clipped.pt")]

"""Every ``inspect`` that exits 1 is a finding in the CI formats too.

``--format github`` writes one ``::error`` per finding (a ``::notice`` only when
nothing failed) and ``--format junit`` one ``<failure>`` (docs/reference/contract.md:
"a finding is a failure"). A total beyond float64's range, or a NaN total that
``--max-norm`` could not be checked against under ``--allow-nonfinite``, fails
the run without any one tensor being an error: the total itself is the finding,
named for what was measured.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
import torch

from tests.cli.conftest import gradclip  # noqa: F401 (fixture)

from .test_ci_formats import parse_workflow_command


def _overflowing_grads(tmp_path):
    """float64 gradients whose 2-norm is beyond float64's range (each element is not)."""
    path = tmp_path / "overflow.pt"
    torch.save({"grads": {"w": torch.full((4,), 1.5e308, dtype=torch.float64)}}, path)
    return path, [], ("gradient", "gradients")


def _overflowing_weights(tmp_path):
    model = torch.nn.Linear(3, 2).double()
    state = model.state_dict()
    state["weight"].fill_(1.5e308)
    path = tmp_path / "weights.pt"
    torch.save(state, path)
    return path, [], ("weight", "weights")


def _nan_under_a_threshold(tmp_path):
    path = tmp_path / "nan.pt"
    torch.save({"grads": {"w": torch.tensor([math.nan, 1.0]), "b": torch.ones(2)}}, path)
    return path, ["--allow-nonfinite", "--max-norm", "1"], ("gradient", "gradients")


CASES = {"overflowing gradients": _overflowing_grads,
         "overflowing weights": _overflowing_weights,
         "nan total under --allow-nonfinite": _nan_under_a_threshold}


def _names_only(text: str, attribute: str, plural: str) -> None:
    assert attribute in text, text
    if attribute != "gradient":
        assert "gradient" not in text, text


@pytest.mark.parametrize("case", list(CASES))
def test_github_says_error_when_the_run_fails(gradclip, tmp_path, case):  # noqa: F811
    path, flags, (attribute, plural) = CASES[case](tmp_path)
    r = gradclip("inspect", path, "--format", "github", *flags)
    assert r.code == 1, r.err
    commands = [parse_workflow_command(line) for line in r.out.splitlines()]
    errors = [(props, data) for kind, props, data in commands if kind == "error"]
    assert errors, r.out
    assert not [c for c in commands if c[0] == "notice"], r.out
    for props, data in errors:
        _names_only(props["title"] + " " + data, attribute, plural)


@pytest.mark.parametrize("case", list(CASES))
def test_junit_counts_a_failure_when_the_run_fails(gradclip, tmp_path, case):  # noqa: F811
    path, flags, (attribute, plural) = CASES[case](tmp_path)
    r = gradclip("inspect", path, "--format", "junit", *flags)
    assert r.code == 1, r.err
    root = ET.fromstring(r.out)
    failures = list(root.iter("failure"))
    assert root.get("failures") == str(len(failures)) and failures, r.out
    (total,) = [c for c in root.iter("testcase") if c.get("name") == "(total)"]
    assert total.find("failure") is not None
    for failure in failures:
        _names_only(failure.get("message") + " " + failure.text, attribute, plural)


def test_the_overflow_finding_says_what_the_verdict_says(gradclip, tmp_path):  # noqa: F811
    path, _, _ = _overflowing_grads(tmp_path)
    quiet = gradclip("inspect", path, "-q")
    github = gradclip("inspect", path, "--format", "github")
    ((_, props, data),) = [parse_workflow_command(x) for x in github.out.splitlines()]
    verdict = quiet.out.strip().splitlines()[-1]
    assert verdict.startswith("FAIL: gradient total norm > 1.8e308")
    assert props["title"] == "gradclip: gradient total norm beyond float64's range"
    assert f"FAIL: {data} (exit 1)" == " ".join(quiet.out.split())

"""The docs site: generated pages that follow the code, a nav with no missing page, links
that lead somewhere, and ``mkdocs build --strict`` (where the ``docs`` extra is installed;
CI installs it).

The examples on the site are run by ``tests/test_readme.py``, as the README's are.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_pages", DOCS / "gen_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
PAGES = gen.pages()


def _config() -> dict:
    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may hold !!python/name tags (none today); read them as text.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    return yaml.load((REPO / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)


def _nav_paths(nav) -> list[str]:
    paths = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        paths += _nav_paths(value) if isinstance(value, list) else [value]
    return paths


def test_every_layout_has_a_generated_page_from_its_own_docstring():
    from gradclip_cli.source.layouts import LAYOUTS

    # A page is named for its module under layouts/, a package's module joined by "_".
    layouts = {m.__name__.removeprefix("gradclip_cli.source.layouts.").replace(".", "_"): m
               for m in LAYOUTS}
    layouts["single_file"] = importlib.import_module("gradclip_cli.source.layouts.single_file")
    assert gen.layout_modules() == list(layouts)
    for module, code in layouts.items():
        page = PAGES[f"layouts/{module}.md"]
        doc = code.__doc__
        # Every paragraph of the docstring is on the page (code marks made Markdown's).
        for paragraph in doc.split("\n\n")[1:]:
            words = re.sub(r"``(.+?)``", r"`\1`", paragraph, flags=re.DOTALL).split()
            assert " ".join(words) in " ".join(page.split()), (module, paragraph[:60])
        # ... and the real example output kept beside it, when there is one.
        example = DOCS / "layouts" / "_examples" / f"{module}.md"
        assert example.is_file(), module
        assert example.read_text(encoding="utf-8").strip() in page


def test_every_layout_is_in_the_nav_the_layouts_table_and_the_readme():
    nav = _nav_paths(_config()["nav"])
    index = (DOCS / "layouts" / "index.md").read_text(encoding="utf-8")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for module in gen.layout_modules():
        assert f"layouts/{module}.md" in nav, module
        assert f"]({module}.md)" in index, module
        assert f"](docs/layouts/_examples/{module}.md)" in readme, module


def test_the_cli_page_lists_every_command_and_option():
    from gradclip_cli.cli import app

    page = PAGES["reference/cli.md"]
    ctx = click.Context(app, info_name="gradclip")
    commands = app.list_commands(ctx)
    assert {"inspect", "clip", "trend", "compare"} <= set(commands)
    for name in commands:
        assert f"## `gradclip {name}`" in page, name
        section = page.split(f"## `gradclip {name}`", 1)[1].split("\n## ", 1)[0]
        for param in app.get_command(ctx, name).params:
            if isinstance(param, click.Option) and not param.hidden:
                for opt in param.opts:
                    assert f"`{opt}" in section or f" {opt}" in section, (name, opt)


def test_the_schemas_page_lists_every_shipped_schema_and_key():
    page = PAGES["reference/schemas.md"]
    files = sorted((REPO / "gradclip_cli" / "schemas").glob("*.json"))
    assert len(files) >= 5
    for path in files:
        schema = json.loads(path.read_text(encoding="utf-8"))
        assert f"`gradclip_cli/schemas/{path.name}`" in page
        for key in schema.get("properties", {}):
            assert f"| `{key}` |" in page, (path.name, key)


def test_the_nav_names_only_pages_that_exist_or_are_generated_or_pending():
    nav = _nav_paths(_config()["nav"])
    assert len(nav) == len(set(nav))
    for path in nav:
        assert (DOCS / path).is_file() or path in PAGES or path in gen.PENDING, path
    # Every page written by hand is in the nav (nothing left unreachable).
    written = {
        p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_examples" not in p.parts
    }
    assert written <= set(nav), written - set(nav)
    # A pending page that has arrived is listed as any other.
    assert gen.PENDING <= set(nav)


def test_a_pending_page_is_left_out_of_the_nav_only_while_absent(tmp_path, monkeypatch):
    nav = [{"Guides": [{"A": "guides/diverged.md"}, {"B": "guides/missing.md"}]}]
    monkeypatch.setattr(gen, "PENDING", {"guides/missing.md"})
    assert gen._drop_pending(nav) == [{"Guides": [{"A": "guides/diverged.md"}]}]
    monkeypatch.setattr(gen, "DOCS", tmp_path)
    (tmp_path / "guides").mkdir()
    (tmp_path / "guides" / "missing.md").write_text("# here now\n")
    (tmp_path / "guides" / "diverged.md").write_text("# here\n")
    assert gen._drop_pending(nav) == nav


LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def test_the_readme_links_only_to_files_the_repository_has():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    targets = [t for t in LINK.findall(readme) if "://" not in t]
    assert len(targets) > 20
    for target in targets:
        assert (REPO / target).exists(), target


def test_every_page_written_by_hand_is_two_clicks_from_the_readme():
    # A newcomer starts at the README (on GitHub or in a clone): every guide and reference
    # page is linked from it or from a page it links (the docs' front page among them).
    def links(page: Path) -> set[Path]:
        text = page.read_text(encoding="utf-8")
        return {(page.parent / t).resolve() for t in LINK.findall(text) if "://" not in t}

    readme = REPO / "README.md"
    reached = links(readme)
    for page in list(reached):
        if page.suffix == ".md" and page.is_file():
            reached |= links(page)
    written = {p.resolve() for p in DOCS.rglob("*.md") if "_examples" not in p.parts}
    unreached = sorted(p.relative_to(REPO).as_posix() for p in written - reached)
    assert not unreached


def test_no_page_or_code_names_a_file_the_repository_lacks():
    # The contract the code's comments cite is the site's own page.
    assert (DOCS / "reference" / "contract.md").is_file()
    for path in [*(REPO / "gradclip_cli").rglob("*.py"), *(REPO / "tests").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(?<![/\w])CONTRACT\.md", text), path


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="the docs extra is not installed (CI installs it and builds the site)",
)
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    site = tmp_path / "site"
    for path in [*PAGES, "guides/diverged.md", "reference/contract.md"]:
        html = site / path.replace(".md", "") / "index.html"
        assert html.is_file(), path
    # The API reference is rendered from the docstrings.
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "clip_grad_norm_" in api and "GradMonitor" in api


def test_benchmarks_gives_each_area_its_current_table_with_machine_and_date():
    text = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 300  # current figures; the history is its own page
    machines = re.findall(
        r"^\| ([\w-]+) \| .+ \|$",
        text.split("## Machines", 1)[1].split("\n## ", 1)[0],
        flags=re.MULTILINE,
    )
    assert {"xeon-2c", "h200"} <= set(machines)
    areas = [
        "How each figure is measured",
        "CLI: inspect and clip",
        "Drop-ins and the monitor",
        "On a GPU",
        "Frameworks' checkpoints",
        "trend",
        "Spike-rule rates",
    ]
    sections = {s.split("\n", 1)[0]: s for s in text.split("\n## ")[1:]}
    for area in areas:
        (title,) = [t for t in sections if t.startswith(area)]
        if area.startswith("How"):
            continue
        section = sections[title]
        # Each area's figures say where and when, in a table.
        assert re.search(r"20\d\d-\d\d-\d\d", section), area
        assert any(m in section for m in machines), area
        assert re.search(r"^\| .+ \|$", section, flags=re.MULTILINE), area
    history = (DOCS / "benchmarks-history.md").read_text(encoding="utf-8")
    assert "## Spike detection on real runs" in history and "### On a GPU" in history


def test_getting_started_installs_as_the_readme_does():
    from tests.test_readme_install import two_commands

    page = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    shown = re.findall(r"^    (python3 -m venv .*)$", page, re.MULTILINE)
    assert shown == list(two_commands())
    assert "torch, click, rich\nand safetensors" in page


def test_getting_starteds_schema_check_runs_as_shown(tmp_path):
    # The Python block a newcomer copies to validate a document: run from the clone's root,
    # it must run as it stands (jsonschema is the test extra's, as the page says).
    page = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"^```python\n(.*?)\n```$", page, re.M | re.S)
                if "jsonschema.validate" in b]
    script = tmp_path / "check.py"
    script.write_text(block + '\nprint("valid", document["schema"])\n', encoding="utf-8")
    bin_dir = str(Path(sys.executable).parent)  # where `gradclip` is installed
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]}
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.stdout == "valid gradclip.inspect/1\n", done.stderr[-2000:]


def test_the_python_api_page_names_every_public_name_and_keyword():
    import inspect

    import gradclip

    page = (DOCS / "guides" / "python-api.md").read_text(encoding="utf-8")
    listed = page.split("Public names (`gradclip.__all__`)", 1)[1].split("\n\n", 1)[0]
    for name in gradclip.__all__:
        assert f"`{name}`" in listed, name
    for function in ("inspect", "trend", "autopsy"):
        heading = re.search(rf"^## `{function}\((.*?)\)`", page, re.MULTILINE)
        assert heading is not None, function
        shown = re.findall(r"(\w+)=", heading.group(1))
        keywords = [name for name, p in inspect.signature(getattr(gradclip, function))
                    .parameters.items() if p.kind is p.KEYWORD_ONLY]
        assert shown == keywords, function


def test_the_help_says_what_the_contract_says():
    from click.testing import CliRunner

    from gradclip_cli.cli import app

    def help_of(*command: str) -> str:
        done = CliRunner().invoke(app, [*command, "--help"], prog_name="gradclip")
        assert done.exit_code == 0, done.output
        return " ".join(done.output.split())

    # Exit 3: the input cannot be read, or the output cannot be written.
    assert "3 unreadable input or unwritable output" in help_of()
    # autopsy takes the same PATHs as trend, the trackers' files among them.
    assert "a tracker's files" in help_of("trend")
    assert "trackers' files" in help_of("autopsy")


def test_the_exit_codes_page_gives_every_commands_findings():
    # The README sends a reader there for "every case": each command's exit 1 is on it.
    from gradclip_cli.cli import app

    page = (DOCS / "reference" / "exit-codes.md").read_text(encoding="utf-8")
    (findings,) = [line for line in page.splitlines() if line.startswith("| 1 |")]
    for command in app.list_commands(click.Context(app, info_name="gradclip")):
        assert f"`{command}`" in findings, command


def test_the_readme_is_a_front_page_with_a_contents_line_for_each_recipe():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 300
    headings = re.findall(r"^## (.+)$", readme, re.MULTILINE)
    recipes = [
        "Watch gradients in my training loop",
        "My run diverged: where?",
        "Fail CI when gradients explode",
        "Clip a checkpoint",
    ]
    assert set(recipes) <= set(headings)
    contents = readme[readme.index("**Contents:**") :].split("\n\n", 1)[0]
    for heading in headings:
        # GitHub's anchor: lower case, punctuation dropped, spaces as hyphens.
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        assert f"](#{anchor})" in contents, heading
    assert readme.index("**Contents:**") < readme.index("## Install")

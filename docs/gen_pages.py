"""The docs site's generated pages, written at build time from the code itself.

An MkDocs hook (``hooks:`` in mkdocs.yml), as ruff writes its rule pages from
its rules' own doc comments: what a page says cannot drift from the code.

- ``layouts/<module>.md``, one page per checkpoint layout: the layout
  module's docstring (``gradclip_cli/source/layouts/<module>.py``, or a package's
  ``<package>/__init__.py`` and ``<package>/<module>.py``), then the
  real example output kept in ``docs/layouts/_examples/<module>.md`` (whose
  ``$`` blocks ``tests/test_readme.py`` runs or names the test that checks them).
- ``reference/cli.md``: every command and option, from the click definitions
  in ``gradclip_cli/cli.py``.
- ``benchmarks.md``: BENCHMARKS.md itself.
- ``reference/schemas.md``: every JSON Schema the package ships
  (``gradclip_cli/schemas/*.json``), its fields and the file itself.

``PENDING`` lists the pages the nav names that other branches add; while one
is absent its nav entry is left out, and every other missing page still fails
``mkdocs build --strict``. Empty it once they have all arrived.

``python docs/gen_pages.py OUT`` writes the generated pages under OUT, to read
them without building the site.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
LAYOUTS_DIR = REPO / "gradclip_cli" / "source" / "layouts"
EXAMPLES = DOCS / "layouts" / "_examples"
SCHEMAS = REPO / "gradclip_cli" / "schemas"

# Pages other branches add (the nav names them already).
PENDING: set[str] = set()


# -- layouts -------------------------------------------------------------------------------


def layout_modules() -> list[str]:
    """The layout pages, in the order ``LAYOUTS`` tries them, then plain files: each named
    for its module under ``layouts/``, a package's modules joined by ``_``
    (``megatron.legacy``: ``megatron_legacy``)."""
    return list(layout_sources())


def layout_sources() -> dict[str, str]:
    """Each layout page's module source, relative to ``layouts/``."""
    from gradclip_cli.source.layouts import LAYOUTS

    out = {}
    for module in LAYOUTS:
        dotted = module.__name__.removeprefix("gradclip_cli.source.layouts.")
        package = hasattr(module, "__path__")
        out[dotted.replace(".", "_")] = dotted.replace(".", "/") + (
            "/__init__.py" if package else ".py"
        )
    return {**out, "single_file": "single_file.py"}


def docstring(module: str) -> str:
    """The module's docstring, read from its source (nothing is imported)."""
    path = layout_sources()[module]
    text = ast.get_docstring(ast.parse((LAYOUTS_DIR / path).read_text(encoding="utf-8")))
    if not text:
        raise ValueError(f"gradclip_cli/source/layouts/{path} has no docstring")
    return text


def rst_to_markdown(text: str) -> str:
    """The few reStructuredText habits the docstrings have, as Markdown: ````x```` code,
    ``* `` bullets (kept), and a blank line before a list so Markdown starts one."""
    text = re.sub(r"``(.+?)``", r"`\1`", text, flags=re.DOTALL)
    out: list[str] = []
    for line in text.splitlines():
        bullet = re.match(r"\s*[*-] ", line)
        if bullet and out and out[-1].strip() and not re.match(r"\s*[*-] |\s{2,}\S", out[-1]):
            out.append("")
        out.append(line)
    return "\n".join(out)


def layout_page(module: str) -> str:
    title, _, body = docstring(module).partition("\n")
    title = rst_to_markdown(title.strip()).rstrip(".")
    example = EXAMPLES / f"{module}.md"
    parts = [
        f"# {title}",
        "",
        f"*Generated from the docstring of `gradclip_cli/source/layouts/"
        f"{layout_sources()[module]}`; "
        f"the example output below is real and checked by the tests.*",
        "",
        "## How gradclip reads it",
        "",
        rst_to_markdown(body.strip()),
        "",
    ]
    if example.is_file():
        parts += ["## What you see", "", example.read_text(encoding="utf-8").strip(), ""]
    return "\n".join(parts)


# -- the command line ----------------------------------------------------------------------


def _escape_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def cli_page() -> str:
    import click

    from gradclip_cli.cli import app

    ctx = click.Context(app, info_name="gradclip", **app.context_settings)
    parts = [
        "# Commands and options",
        "",
        "*Generated from the click definitions in `gradclip_cli/cli.py`: what `--help` says.*",
        "",
        "```text",
        app.get_help(ctx),
        "```",
        "",
    ]
    for name in app.list_commands(ctx):
        command = app.get_command(ctx, name)
        sub = click.Context(command, info_name=name, parent=ctx, **command.context_settings)
        parts += [f"## `gradclip {name}`", "", "```text", sub.get_usage(), "```", ""]
        if command.help:
            parts += [command.help.strip(), ""]
        parts += ["| option | value | help |", "| --- | --- | --- |"]
        for param in command.get_params(sub):
            if isinstance(param, click.Option) and param.hidden:
                continue
            record = param.get_help_record(sub)
            if record is None:  # an argument
                parts.append(f"| `{param.human_readable_name}` | argument | |")
                continue
            flags, help_text = record
            names, words = [], flags.split(" ")
            while words and words[0].startswith("-"):
                names.append(words.pop(0).rstrip(",/"))
            value = f"`{_escape_cell(' '.join(words))}`" if words else ""
            flags_cell = ", ".join(f"`{n}`" for n in names)
            parts.append(f"| {flags_cell} | {value} | {_escape_cell(help_text)} |")
        parts.append("")
    return "\n".join(parts)


# -- JSON schemas --------------------------------------------------------------------------


def _type_of(spec: dict) -> str:
    if "const" in spec:
        return f"`{json.dumps(spec['const'])}`"
    if "enum" in spec:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in spec["enum"])
    kind = spec.get("type")
    if isinstance(kind, list):
        return " \\| ".join(kind)
    if kind:
        return str(kind)
    for key in ("oneOf", "anyOf"):
        if key in spec:
            return " \\| ".join(_type_of(s) for s in spec[key])
    if "$ref" in spec:
        return spec["$ref"].rsplit("/", 1)[-1]
    return ""


def schemas_page() -> str:
    parts = [
        "# JSON schemas",
        "",
        "*Generated from the JSON Schema files the package ships "
        "(`gradclip_cli/schemas/*.json`, draft 2020-12); the tests validate real output "
        "against them.* Keys beyond a schema's `required` list are extras a script may "
        "read but should not depend on. In Python:",
        "",
        "```python",
        "import json, jsonschema",
        "from gradclip_cli.schemas import schema",
        "",
        "document = json.loads(output)",
        'jsonschema.validate(document, schema(document["schema"]))',
        "```",
        "",
    ]
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        name = schema.get("properties", {}).get("schema", {}).get("const", path.stem)
        required = set(schema.get("required", []))
        parts += [f"## `{name}`", "", f"`gradclip_cli/schemas/{path.name}`", ""]
        if schema.get("description"):
            parts += [schema["description"], ""]
        parts += ["| key | type | required | description |", "| --- | --- | --- | --- |"]
        for key, spec in schema.get("properties", {}).items():
            parts.append(
                f"| `{key}` | {_type_of(spec)} | {'yes' if key in required else ''} | "
                f"{_escape_cell(spec.get('description', ''))} |"
            )
        parts += [
            "",
            f'??? note "{path.name}"',
            "",
            "    ```json",
            *("    " + line for line in json.dumps(schema, indent=2).splitlines()),
            "    ```",
            "",
        ]
    return "\n".join(parts)


def benchmarks_page() -> str:
    """BENCHMARKS.md as a page of the site (its links to docs/ made relative to it)."""
    text = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    return re.sub(r"\]\(docs/", "](", text)


def pages() -> dict[str, str]:
    """Every generated page: its path under docs/ -> its Markdown."""
    generated = {f"layouts/{m}.md": layout_page(m) for m in layout_modules()}
    generated["reference/cli.md"] = cli_page()
    generated["reference/schemas.md"] = schemas_page()
    generated["benchmarks.md"] = benchmarks_page()
    return generated


# -- the MkDocs hook -----------------------------------------------------------------------


def _drop_pending(nav: list) -> list:
    kept = []
    for entry in nav:
        if isinstance(entry, dict):
            ((title, value),) = entry.items()
            if isinstance(value, list):
                value = _drop_pending(value)
                if not value:
                    continue
            elif value in PENDING and not (DOCS / value).is_file():
                continue
            kept.append({title: value})
        elif isinstance(entry, str) and entry in PENDING and not (DOCS / entry).is_file():
            continue
        else:
            kept.append(entry)
    return kept


def on_config(config):
    if config.get("nav"):
        config["nav"] = _drop_pending(config["nav"])
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, text in pages().items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=text))
    return files


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for path, text in pages().items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text, encoding="utf-8")

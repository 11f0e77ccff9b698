"""Fuzzing ``gradclip inspect`` with mutated DCP folders (the invariant of ``test_fuzz.py``).

The base is a real DCP checkpoint, written by ``dcp.save`` in this process (no
process group: DCP then saves as one rank): gradients, a model and a bytes
value. Each example mutates the ``.metadata`` pickle or the ``.distcp`` file,
then inspects the folder: exit 0 or 1 with JSON, or exit 3 with one line
naming a file of the folder. Never a traceback, never anything run from the
pickle (the metadata pickle can name any global once mutated).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given

from .support import assert_clean_inspect, run_cli
from .test_fuzz import COUNTS, FUZZ, _apply, _mutations

_DIR = Path(tempfile.mkdtemp(prefix="gradclip-fuzz-dcp-"))


def _base() -> dict[str, bytes]:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {
        "grads": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g).half()},
        "model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)},
        "step": 7,
    }
    folder = _DIR / "base"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as one rank"
        dcp.save(state, checkpoint_id=folder)
    return {p.name: p.read_bytes() for p in folder.iterdir()}


BASE = _base()
_DISTCP = next(name for name in BASE if name.endswith(".distcp"))


def _check(changed: str, data: bytes, label: str) -> None:
    COUNTS[label] = COUNTS.get(label, 0) + 1
    folder = Path(tempfile.mkdtemp(dir=_DIR))
    try:
        for name, raw in BASE.items():
            (folder / name).write_bytes(data if name == changed else raw)
        result = run_cli("inspect", folder, "--format", "json", "-q")
        assert_clean_inspect(result, folder)
        assert not (Path.cwd() / "ran").exists()
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("name", [".metadata", _DISTCP])
def test_fuzz_dcp_bytes(name):
    @FUZZ
    @given(mutations=_mutations(len(BASE[name])))
    def run(mutations):
        _check(name, _apply(BASE[name], mutations), f"dcp-bytes-{name.lstrip('.')}")

    run()


def test_fuzz_dcp_metadata_fields():
    """Well-formed metadata with wrong numbers: chunk offsets and sizes, byte ranges, files."""
    import pickle

    from hypothesis import strategies as st

    meta = pickle.loads(BASE[".metadata"])  # the test's own base: torch's classes, trusted
    chunks = [(k, i) for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")
              for i in range(len(v.chunks))]
    keys = list(meta.storage_data)
    small = st.integers(0, 8)
    chunk_edit = st.tuples(st.just("chunk"), st.sampled_from(chunks), st.booleans(),
                           st.lists(small, min_size=0, max_size=3))
    place_edit = st.tuples(st.just("place"), st.sampled_from(keys),
                           st.sampled_from(["offset", "length", "relative_path"]),
                           st.integers(0, 4000) | st.sampled_from(["..", "/", "x", _DISTCP]))

    @FUZZ
    @given(edits=st.lists(st.one_of(chunk_edit, place_edit), min_size=1, max_size=3))
    def run(edits):
        edited = pickle.loads(BASE[".metadata"])
        for edit in edits:
            if edit[0] == "chunk":
                _, (key, i), which, dims = edit
                chunk = edited.state_dict_metadata[key].chunks[i]
                setattr(chunk, "offsets" if which else "sizes", torch.Size(dims))
            else:
                _, index, field, value = edit
                info = edited.storage_data[index]
                if field == "relative_path":
                    value = str(value)
                elif not isinstance(value, int):
                    value = 0
                setattr(info, field, value)
        _check(".metadata", pickle.dumps(edited), "dcp-metadata-fields")

    run()

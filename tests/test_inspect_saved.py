"""``nimble inspect`` on a saved graph (the recorded fixture of ``tests/saved_fixture.py``): its
summary as text and JSON without torch or a GPU, and one line with status 2 for a damaged one."""
from __future__ import annotations

import copy
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nimble.cli.main as cli
from nimble.ir.saved_format import SavedFile

from saved_fixture import fixture_path

ROOT = Path(__file__).resolve().parents[1]
INTERNAL_NAMES = ("Traceback", "JSONDecodeError", "UnicodeDecodeError", "KeyError",
                  "AttributeError", "TypeError", "EOFError", "IndexError", "BadGzipFile",
                  "LoadError")


@pytest.fixture
def saved(tmp_path) -> Path:
    path = tmp_path / "llama.nimble"
    path.write_bytes(gzip.decompress(fixture_path().read_bytes()))
    return path


def _manifest(path: Path) -> SavedFile:
    saved = SavedFile.read(path)
    return SavedFile(copy.deepcopy(saved.manifest), bytes(saved.blobs))


def test_the_text_summary_without_torch(saved):
    """In a process where torch cannot be imported at all."""
    code = f"""
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "cuda"):
            raise ImportError(name + " is made unimportable by this test")
sys.meta_path.insert(0, Refuse())
from nimble.cli.main import main
status = main(["inspect", {str(saved)!r}])
assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "cuda")]
sys.exit(status)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"{saved}: saved graph (format version 1), 0.3 MiB"
    assert "torch 2.11.0+cu130 on NVIDIA H100 80GB HBM3 (sm_90), CUDA driver 13.0" in lines[1]
    assert lines[2] == "  instances: 1, pad: no"
    assert lines[3] == "  bucket 0: inputs int64 [1, 128] -> outputs float16 [1, 128, 512]"
    assert lines[4] == "    tasks: 219, streams: 1, arena: 1.3 MiB"
    assert lines[5:7] == ["  kernels: 42", "    embedded: 42 kernels in 1 image, 0.01 MiB"]
    assert lines[7] == "  weights: 39 storages, 54.3 MiB, not included: load with model=..."


def test_the_json_summary_holds_the_files_numbers(saved, capsys):
    assert cli.main(["inspect", str(saved), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    m = _manifest(saved).manifest
    assert s["kind"] == "saved graph" and s["format_version"] == 1
    assert s["file_bytes"] == saved.stat().st_size
    assert (s["arch"], s["driver"], s["instances"], s["pad"]) == (90, 13000, 1, False)
    bucket = s["buckets"][0]
    assert bucket["inputs"] == [{"dtype": "int64", "shape": [1, 128]}]
    assert bucket["outputs"] == [{"dtype": "float16", "shape": [1, 128, 512]}]
    assert bucket["tasks"] == 219 and bucket["streams"] == 1
    assert bucket["programmatic_edges"] == 0
    assert bucket["arena_bytes"] == m["buckets"][0]["memplan"]["arena_bytes"]
    assert not bucket["training_step"]
    assert s["kernels"] == 42 and s["binaries"]["libraries"] == []
    assert s["binaries"]["embedded"] == {"images": 1, "kernels": 42,
                                         "bytes": m["binaries"][0]["blob"][1],
                                         "unpacked_bytes": m["binaries"][0]["blob"][1]}
    assert not s["weights_included"] and s["weight_storages"] == 39
    assert s["weight_bytes"] == sum(w["size"] for w in m["weights"])


def test_kernels_from_library_files_are_counted_by_library(saved, capsys):
    file = _manifest(saved)
    m = file.manifest
    for offset in (0, 4096):
        m["binaries"].append({"kind": "library", "path": "/opt/lib/libcublasLt.so.13",
                              "name": "libcublasLt.so.13", "file_size": 1 << 20,
                              "offset": offset, "size": 4096, "sha256": "ab" * 32})
    for k, kernel in enumerate(m["kernels"][:5]):
        kernel["binary"] = 1 + k % 2
    file.write(saved)
    assert cli.main(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "    libcublasLt.so.13: 5 kernels in 2 fatbin containers\n" in out
    assert "    embedded: 37 kernels in 1 image" in out


def test_the_private_copies_of_library_memory_are_counted_in_the_bucket(tmp_path, capsys):
    """What a file holds beyond its weights and kernels: the bytes of library memory a graph
    writes (resnet50's training step: cuDNN's batch-norm buffers), and the workspaces it holds
    no bytes of (inception_v3 in bfloat16: a 32 MiB convolution workspace, zeroed at load)."""
    from saved_fixture import saved_file

    for name, private, zeroed in (("resnet50_train", 2 * (25344 + 4), 0),
                                  ("inception_v3_bfloat16", 0, 32 << 20)):
        path = saved_file(name).write(tmp_path / f"{name}.nimble")
        assert cli.main(["inspect", str(path), "--json"]) == 0
        bucket = json.loads(capsys.readouterr().out)["buckets"][0]
        assert (bucket["private_bytes"], bucket["zeroed_bytes"]) == (private, zeroed)
        assert cli.main(["inspect", str(path)]) == 0
        out = capsys.readouterr().out
        assert ("    private copies of library memory: 49.5 KiB, in the file\n" in out) == \
            bool(private)
        if name == "resnet50_train":  # its output and 161 gradients, the first four named
            assert re.search(r"-> outputs float32 \[32, 10\], float32 \[64, 3, 7, 7\], "
                             r"float32 \[64\], float32 \[64\] and 158 more\n", out), out[:600]
        assert ("    workspaces: 32.0 MiB, zeroed at load (not in the file)\n" in out) == \
            bool(zeroed)


def test_the_files_bytes_are_told_by_what_they_hold(tmp_path, capsys):
    """Every byte of the file counted once, under the kind of blob (or section) that holds it:
    what a file larger than its weights carries (mobilenet_v2's float32 fixture without its
    weights: two reference input sets of 3x224x224 floats, the rest small)."""
    from saved_fixture import saved_file

    path = saved_file("mobilenet_v2").write(tmp_path / "m.nimble")
    assert cli.main(["inspect", str(path), "--json"]) == 0
    contents = json.loads(capsys.readouterr().out)["contents"]
    assert sum(contents.values()) == path.stat().st_size
    assert all(n >= 0 for n in contents.values())
    saved = SavedFile.read(path)
    m = saved.manifest
    refs = {tuple(r) for row in m["buckets"] for part in ("inputs", "outputs")
            for sets in row["reference"][part] for r in sets}
    assert contents["references"] == sum(size for _, size in refs) >= 2 * 3 * 224 * 224 * 4
    assert contents["weights"] == 0 and contents["library_memory"] == 0
    assert contents["manifest"] == saved.sections["manifest"][1]
    assert 0 < contents["other"] < 4096
    assert cli.main(["inspect", str(path)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("  the file's bytes: references 1.2 MiB, manifest ")


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:5000])


def _flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x20
    path.write_bytes(bytes(data))


def _mistyped(path: Path) -> None:
    file = _manifest(path)
    file.manifest["buckets"][0]["schedule"]["streams"] = "one"
    file.write(path)


def _graph_undecodable(path: Path) -> None:
    file = _manifest(path)
    file.manifest["buckets"][0]["graph"] = file.manifest["binaries"][0]["blob"]
    file.write(path)


DAMAGED = {"truncated": (_truncated, "truncated or has bytes appended"),
           "flipped": (_flipped, "its checksum does not match"),
           "mistyped": (_mistyped, r"buckets\[0\]\.schedule\.streams is a string"),
           "graph": (_graph_undecodable, "bucket 0 holds a graph that does not decode")}


@pytest.mark.parametrize("how", sorted(DAMAGED))
def test_a_damaged_saved_graph_is_one_line_and_status_2(saved, how):
    damage, says = DAMAGED[how]
    damage(saved)
    r = subprocess.run([sys.executable, "-m", "nimble", "inspect", saved.name],
                       capture_output=True, text=True, cwd=saved.parent, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nimble: {saved.name}: a saved graph"), \
        r.stderr
    assert re.search(says, lines[0]), lines[0]
    assert not any(word in r.stderr for word in INTERNAL_NAMES), r.stderr


def test_options_of_a_taskgraph_do_not_apply_to_a_saved_graph(saved, tmp_path, capsys):
    assert cli.main(["inspect", str(saved), "--memplan", "--export", str(tmp_path / "p")]) == 2
    assert "a saved graph; --memplan, --export apply to a TaskGraph only" in \
        capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_the_largest_embedded_images_are_named_with_their_origin(saved, capsys):
    file = _manifest(saved)
    m = file.manifest
    first = m["binaries"][0]
    m["binaries"].append({**first, "blob": [first["blob"][0], first["blob"][1] // 2],
                          "origin": "module loaded in the saving process"})
    for kernel in m["kernels"][:3]:
        kernel["binary"] = 1
    file.write(saved)
    assert cli.main(["inspect", str(saved)]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("    embedded: 42 kernels in 2 images, 0.01 MiB")
    assert lines[at + 1].startswith("      0.01 MiB, 39 kernels (")
    assert lines[at + 1].endswith(f"), from {first['origin']}")
    assert lines[at + 2].startswith("      0.00 MiB, 3 kernels (" + m["kernels"][0]["name"][:20])
    assert lines[at + 2].endswith("), from module loaded in the saving process")
    assert cli.main(["inspect", str(saved), "--json"]) == 0
    largest = json.loads(capsys.readouterr().out)["binaries"]["largest_images"]
    assert [r["kernels"] for r in largest] == [39, 3] and largest[1]["bytes"] == \
        first["blob"][1] // 2


def test_an_image_stored_packed_is_counted_in_the_file_and_unpacked(saved, capsys):
    """The fixture's image stored as nimble save stores a cubin (LZ4-packed, the row saying
    its size unpacked), beside a second image stored as it is (three of the kernels in it)."""
    from nimble.record.fatbin_pack import packed_cubin

    file = _manifest(saved)
    m = file.manifest
    first = m["binaries"][0]
    image = file.blob(first["blob"])
    packed = packed_cubin(image, 90)
    m["binaries"][0] = {**first, "blob": [len(file.blobs), len(packed)], "packed": "lz4",
                        "image_size": len(image),
                        "sha256": hashlib.sha256(packed).hexdigest()}
    m["binaries"].append({**first, "blob": [first["blob"][0], 1 << 20]})
    file.blobs += packed + bytes(1 << 20)
    for kernel in m["kernels"][:3]:
        kernel["binary"] = 1
    file.write(saved)
    assert cli.main(["inspect", str(saved)]) == 0
    lines = capsys.readouterr().out.splitlines()
    stored, unpacked = (len(packed) + (1 << 20)) / 2**20, (len(image) + (1 << 20)) / 2**20
    at = lines.index(f"    embedded: 42 kernels in 2 images, {stored:.2f} MiB ({unpacked:.2f} MiB "
                     "unpacked)")
    assert lines[at + 1].startswith("      1.00 MiB, 3 kernels (")
    assert lines[at + 2].startswith(f"      0.00 MiB ({len(image) / 2**20:.2f} MiB unpacked), "
                                    "39 kernels (")
    assert cli.main(["inspect", str(saved), "--json"]) == 0
    binaries = json.loads(capsys.readouterr().out)["binaries"]
    assert binaries["embedded"] == {"images": 2, "kernels": 42, "bytes": len(packed) + (1 << 20),
                                    "unpacked_bytes": len(image) + (1 << 20)}
    assert [(r["bytes"], r["unpacked_bytes"]) for r in binaries["largest_images"]] == \
        [(1 << 20, 1 << 20), (len(packed), len(image))]


def test_a_buckets_programmatic_edges_are_counted(saved, capsys):
    """A bucket whose saving process served edges programmatic says how many (the fixture's
    one-stream chain: two of its edges listed)."""
    file = _manifest(saved)
    file.manifest["buckets"][0]["programmatic"] = [[0, 1], [1, 2]]
    file.write(saved)
    assert cli.main(["inspect", str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["buckets"][0]["programmatic_edges"] == 2
    assert cli.main(["inspect", str(saved)]) == 0
    assert "    programmatic edges: 2 (into Nimble's waiting kernels, built so at load)\n" in \
        capsys.readouterr().out

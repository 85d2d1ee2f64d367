"""The C runtime's sources compile, on the CPU, wherever a C compiler and the driver API's cuda.h
are found (the ``test`` extra installs NVIDIA's nvidia-cuda-runtime wheel, which carries
cuda.h); no GPU and no libcuda are needed to compile.  ``nimble c-runtime`` tells a build
where they are."""
from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest

from nimble.cli import c_runtime
from nimble.cli.common import Fail
from nimble.cli.main import main

HOST = Path(__file__).parent / "c_host" / "run_saved.c"


def _toolchain() -> tuple[str, Path]:
    try:
        return c_runtime.compiler(), c_runtime.cuda_include()
    except Fail as e:
        pytest.skip(str(e))


def _compile(cc: str, include: Path, source: Path, out: Path) -> None:
    cmd = [cc, "-O2", "-std=c11", "-pthread", "-Wall", "-Wextra", "-Werror", "-I",
           str(c_runtime.FOLDER),
           "-I", str(include), "-c", str(source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, " ".join(cmd) + "\n" + done.stderr


def test_the_c_runtime_and_its_host_program_compile_without_a_warning(tmp_path):
    cc, include = _toolchain()
    for source in [c_runtime.FOLDER / s for s in c_runtime.SOURCES] + [HOST]:
        _compile(cc, include, source, tmp_path / (source.stem + ".o"))


def test_the_runtimes_files_link_leaving_only_the_drivers_and_the_c_librarys_symbols(tmp_path):
    """One file's function called in another is defined there: linked as a shared library,
    every symbol left undefined is the driver's (``cu...``, found in libcuda at run time) or
    comes from the C library the link named (versioned: ``fopen@GLIBC_2.2.5``)."""
    import shutil

    cc, include = _toolchain()
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm on PATH")
    objects = []
    for source in [c_runtime.FOLDER / s for s in c_runtime.SOURCES]:
        objects.append(tmp_path / (source.stem + ".o"))
        cmd = [cc, "-O2", "-std=c11", "-pthread", "-fPIC", "-I", str(c_runtime.FOLDER), "-I",
               str(include), "-c", str(source), "-o", str(objects[-1])]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    lib = tmp_path / "libnimble.so"
    done = subprocess.run([cc, "-shared", "-pthread", *map(str, objects), "-o", str(lib)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    listed = subprocess.run([nm, "-D", "--undefined-only", str(lib)], capture_output=True,
                            text=True, check=True).stdout.split()
    names = [word for word in listed if word not in ("U", "w", "v")]
    strange = [n for n in names if not n.startswith("cu") and "@" not in n
               and not n.startswith("_")]
    assert not strange, strange
    assert any(n.startswith("cuGraphLaunch") for n in names)


def test_the_header_compiles_as_cpp_too(tmp_path):
    import shutil

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    _, include = _toolchain()
    source = tmp_path / "use.cpp"
    source.write_text('#include "nimble.h"\nint main() { return nimble_buckets(nullptr); }\n')
    done = subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-I", str(c_runtime.FOLDER),
                           "-I", str(include), "-c", str(source), "-o", str(tmp_path / "u.o")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_command_prints_where_the_runtime_is(capsys):
    assert main(["c-runtime", "--print-include"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert (folder / "nimble.h").is_file() and (folder / "nimble.c").is_file()
    assert main(["c-runtime", "--print-sources"]) == 0
    assert capsys.readouterr().out.split() == [str(folder / s) for s in c_runtime.SOURCES]


def test_the_package_data_carries_the_runtime():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"c_runtime/*.c", "c_runtime/*.h"' in text


def test_a_build_without_a_toolchain_ends_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(c_runtime.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert main(["c-runtime", "--build", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nimble: no C compiler") and "\n" not in err


@pytest.mark.parametrize("sha_extensions", ["where the CPU has them", "off"])
def test_the_c_checksum_is_the_python_readers(tmp_path, monkeypatch, sha_extensions):
    """The C runtime's SHA-256 and the file's hash-list checksum, compiled alone (no CUDA) and
    called through ctypes, against hashlib and nimble.ir.saved_format.checksum on sizes around
    the 64-byte block and the 8 MiB chunk: on the x86 SHA extensions where the CPU has them
    (the CPU machine's has), and on the portable rounds."""
    if sha_extensions == "off":
        monkeypatch.setenv("NIMBLE_NO_SHA_NI", "1")
    import ctypes
    import hashlib
    import random

    from nimble.ir.saved_format import checksum

    try:
        cc = c_runtime.compiler()
    except Fail as e:
        pytest.skip(str(e))
    lib_path = tmp_path / "libsha.so"
    done = subprocess.run([cc, "-O2", "-std=c11", "-pthread", "-shared", "-fPIC", "-Werror",
                           str(c_runtime.FOLDER / "nimble_sha256.c"), "-o", str(lib_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(lib_path))
    data = random.Random(0).randbytes((8 << 20) * 2 + 1000)
    for n in (0, 1, 55, 56, 63, 64, 65, 1000, 8 << 20, (8 << 20) + 1, len(data)):
        out = ctypes.create_string_buffer(32)
        lib.nimble_sha256(data, ctypes.c_size_t(n), out)
        assert out.raw == hashlib.sha256(data[:n]).digest(), n
        lib.nimble_checksum(data, ctypes.c_size_t(n), out)
        assert out.raw == checksum(data[:n]), n
    pieces = [data[i * 1000:i * 1000 + 37 * i] for i in range(20)]  # one per binary, in threads
    starts = (ctypes.c_char_p * 20)(*pieces)
    sizes = (ctypes.c_size_t * 20)(*[len(p) for p in pieces])
    sums = ctypes.create_string_buffer(32 * 20)
    lib.nimble_sha256_many(starts, sizes, sums, ctypes.c_size_t(20))
    assert [sums.raw[32 * i:32 * i + 32] for i in range(20)] == \
        [hashlib.sha256(p).digest() for p in pieces]


# ---- the C reader on saved files, on the CPU --------------------------------------------------

@pytest.fixture(scope="module")
def plan_check(tmp_path_factory) -> Path:
    """tests/c_host/plan_check.c built with the runtime's reader (no libcuda needed)."""
    cc, include = _toolchain()
    out = tmp_path_factory.mktemp("plan") / "plan_check"
    cmd = [cc, "-O2", "-std=c11", "-pthread", "-Wall", "-Wextra", "-Werror", "-I",
           str(c_runtime.FOLDER), "-I", str(include), str(HOST.parent / "plan_check.c"),
           str(c_runtime.FOLDER / "nimble_plan.c"), str(c_runtime.FOLDER / "nimble_sha256.c"),
           "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, " ".join(cmd) + "\n" + done.stderr
    return out


def _every_edge_served(version: int | None = None):
    """The plan writer taking every programmatic edge as one into a waiting kernel (the
    stand-ins' kernels are none of Nimble's: tests/test_c_plan.py tests the rule itself), its
    plan written as ``version`` where given."""
    import contextlib
    from unittest import mock

    from nimble.engine import c_plan as c_plan_module

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(c_plan_module, "waiting_edges",
                                          lambda graph, edges: frozenset(edges)))
    if version is not None:
        stack.enter_context(mock.patch.object(c_plan_module, "plan_version",
                                              lambda *a, **k: version))
    return stack


def _saved_with_plan(tmp_path, name: str = "googlenet", programmatic=(), **changes
                     ) -> tuple[Path, dict]:
    from c_plan_reader import read_plan
    from test_c_plan import _stand_in

    from nimble.engine.c_plan import c_plan
    from nimble.ir.saved_format import SavedFile

    prepared, state, manifest, *_ = _stand_in(name)
    prepared.programmatic = frozenset(programmatic)
    prepared.graph.meta.update(changes)
    with _every_edge_served():
        data, _ = c_plan(manifest, [prepared], [state], state.size)
    path = SavedFile({"format": "nimble.saved-graph"}, b"\0" * 64,
                     extra={"c_plan": data}).write(tmp_path / f"{name}.nimble")
    return path, read_plan(data)


def _run(program: Path, path: Path) -> tuple[int, str]:
    done = subprocess.run([str(program), str(path)], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout.strip()


@pytest.mark.parametrize("name", ["googlenet", "inception_v3"])
def test_the_c_reader_reads_what_python_wrote(plan_check, tmp_path, name):
    path, plan = _saved_with_plan(tmp_path, name)
    rc, out = _run(plan_check, path)
    assert rc == 0, out
    bucket = plan["buckets"][0]
    written = {(p[0], p[1]) for p, _ in bucket["written"]}
    want = (f"arch 90 instances 2 buckets 1 binaries 1 kernels 1 weights {len(plan['weights'])} "
            f"memory {len(plan['memory'])} nodes {len(bucket['nodes'])} relocations "
            f"{sum(len(n.get('relocs', ())) for n in bucket['nodes'])} "
            f"edges {len(bucket['edges'])} (programmatic 0) written {len(written)} (weights 0) "
            "low-bits 0 (relocations 0)")
    assert out == want


def test_a_weight_the_graph_writes_is_put_back_by_the_c_proof_as_by_pythons(plan_check, tmp_path):
    """A weight a kernel writes (a buffer updated in the forward) is in the plan's list of
    memory put back before each checked launch, and the C reader keeps it, as the Python
    loader's proof restores it (nimble.engine.saving.restored_ranges)."""
    from c_plan_reader import read_plan
    from test_c_plan import _stand_in

    from nimble.engine.arena_layout import written_weights
    from nimble.engine.c_plan import c_plan
    from nimble.ir.saved_format import SavedFile
    from nimble.ir.taskgraph import BufferKind

    prepared, state, manifest, *_ = _stand_in("googlenet")
    graph = prepared.graph
    assert not written_weights(graph)
    task, access = next((t, a) for t in graph.tasks for a in t.accesses
                        if graph.buffers[a.buffer].kind == BufferKind.PARAM)
    access.write = True
    data, _ = c_plan(manifest, [prepared], [state], state.size)
    written = read_plan(data)["buckets"][0]["written"]
    assert [p[0] for p, _ in written].count(2) == 1  # R_WEIGHT, once
    path = SavedFile({"format": "nimble.saved-graph"}, b"\0" * 64,
                     extra={"c_plan": data}).write(tmp_path / "writes_a_weight.nimble")
    rc, out = _run(plan_check, path)
    assert rc == 0 and f"written {len(written)} (weights 1)" in out, out


def test_the_c_reader_refuses_bad_files_with_their_codes(plan_check, tmp_path):
    from nimble.ir.saved_format import SavedFile

    path, _ = _saved_with_plan(tmp_path)
    data = path.read_bytes()

    def code(content: bytes) -> tuple[int, str]:
        bad = tmp_path / "bad.nimble"
        bad.write_bytes(content)
        return _run(plan_check, bad)
    rc, out = code(data[:-9])
    assert rc == 3 and "truncated" in out
    flipped = bytearray(data)
    flipped[-20] ^= 4
    rc, out = code(bytes(flipped))
    assert rc == 3 and "checksum" in out
    newer = bytearray(data)
    struct.pack_into("<I", newer, 8, 3)  # 2 holds workspaces without bytes: read
    assert code(bytes(newer))[0] == 4
    saved = SavedFile.read(path)
    plan = bytearray(saved.extra["c_plan"])
    for at, value, want in ((0, 7, 3), (8, 5, 4)):  # the magic; a plan version to come
        changed = bytearray(plan)
        struct.pack_into("<Q", changed, at, value)
        rc, _ = code(SavedFile({"format": "x"}, b"\0" * 64, extra={"c_plan": bytes(changed)})
                     .to_bytes())
        assert rc == want
    rc, _ = code(SavedFile({"format": "x"}, b"\0" * 64, extra={"c_plan": bytes(plan[:-40])})
                 .to_bytes())
    assert rc == 3  # a plan that ends early
    rc, _ = code(SavedFile({"format": "x"}, b"\0" * 64).to_bytes())
    assert rc == 7  # a file without a c_plan


def test_the_c_reader_refuses_a_graph_it_cannot_run_with_the_reason(plan_check, tmp_path):
    path, _ = _saved_with_plan(tmp_path, rng={"increment": 4, "cells": 2})
    rc, out = _run(plan_check, path)
    assert rc == 7 and "draws random numbers" in out


def test_the_c_reader_reads_buffers_kept_at_their_low_bits(plan_check, tmp_path):
    """A version-3 plan: its low-bits buffers read before every place that names them, each
    word into one relocated to it; a place naming one the plan does not list is refused."""
    from test_c_plan import _stand_in

    graph = _stand_in("googlenet")[0].graph
    pointed = {p.buffer for t in graph.tasks for p in t.pointers}
    kept = sorted(b.id for b in graph.buffers if b.relocatable and b.id in pointed)[:3]
    path, plan = _saved_with_plan(tmp_path, low_word_buffers=kept)
    assert plan["version"] == 3 and len(plan["buckets"][0]["low_bits"]) == 3
    low = sum(place[0] == 4 for n in plan["buckets"][0]["nodes"]
              for _, place in n.get("relocs", ()))
    rc, out = _run(plan_check, path)
    assert rc == 0 and out.endswith(f"low-bits 3 (relocations {low})") and low, out
    from nimble.ir.saved_format import SavedFile

    data = bytearray(SavedFile.read(path).extra["c_plan"])
    # a relocation into a low-bits buffer made to name buffer 3, which the plan does not list
    at = next(word for n in plan["buckets"][0]["nodes"]
              for word, (_, place) in zip(n.get("reloc_words", ()), n.get("relocs", ()))
              if place[0] == 4)
    struct.pack_into("<Q", data, 8 * (at + 1), 3)
    bad = SavedFile({"format": "nimble.saved-graph"}, b"\0" * 64,
                    extra={"c_plan": bytes(data)}).write(tmp_path / "bad.nimble")
    rc, out = _run(plan_check, bad)
    assert rc == 3 and "damaged" in out, out


def test_a_private_copy_reaching_past_the_arena_makes_the_plan_bad(plan_check, tmp_path):
    """The loader writes the arena's private copies while the file's checksum is still being
    computed (nimble_file_check_start): the reader keeps each inside the arena past its base's
    alignment slack, so that a damaged plan cannot send them into other memory.  A copy that
    ends at the last byte allowed is read; one byte less of arena and the plan is bad."""
    from nimble.ir.saved_format import SavedFile

    path, plan = _saved_with_plan(tmp_path, "inception_v3_bfloat16")  # cuDNN's 32 MiB workspace
    (offset, size, _), = plan["buckets"][0]["private"]
    room = plan["arena_size"] - plan["alignment"]
    assert offset + size == room  # the writer's layout: the slack after the last state
    data = bytearray(SavedFile.read(path).extra["c_plan"])
    for arena, want in ((plan["arena_size"], 0), (plan["arena_size"] - 1, 3)):
        struct.pack_into("<Q", data, 8 * 4, arena)  # the plan's fifth word: the arena's size
        changed = SavedFile({"format": "x"}, b"\0" * 64, extra={"c_plan": bytes(data)}).write(
            tmp_path / "arena.nimble")
        rc, out = _run(plan_check, changed)
        assert rc == want and (want == 0 or "damaged" in out), out


def test_the_c_reader_refuses_a_file_of_several_graphs(plan_check, tmp_path):
    from test_c_plan import _stand_in

    from nimble.engine.c_plan import c_plan
    from nimble.ir.saved_format import SavedFile

    _, _, manifest, *_ = _stand_in("googlenet")
    why = "several graphs in one file (a Generator): load it from Python"
    data, said = c_plan(manifest, [], [], 0, unsupported=why)
    assert said == why
    path = SavedFile({"format": "x"}, b"\0" * 64, extra={"c_plan": data}).write(
        tmp_path / "g.nimble")
    rc, out = _run(plan_check, path)
    assert rc == 7 and "several graphs" in out


def _kernel_edges(name: str = "googlenet", count: int = 3) -> list[tuple[int, int]]:
    """The first ``count`` edges of the stand-in's one-stream schedule between two kernels."""
    from test_c_plan import _stand_in

    from nimble.ir.taskgraph import TaskKind

    prepared, *_ = _stand_in(name)
    tasks = prepared.graph.tasks
    return [(u, v) for u, v in prepared.schedule.edges()
            if tasks[u].kind == TaskKind.KERNEL and tasks[v].kind == TaskKind.KERNEL][:count]


def test_a_plan_with_programmatic_edges_is_version_4_and_read_with_them(plan_check, tmp_path):
    path, plan = _saved_with_plan(tmp_path, programmatic=_kernel_edges())
    assert plan["version"] == 4 and plan["buckets"][0]["programmatic"] == _kernel_edges()
    rc, out = _run(plan_check, path)
    assert rc == 0 and "(programmatic 3)" in out, out
    _, plain = _saved_with_plan(tmp_path)
    assert plain["version"] == 1  # a runtime that reads version 1 reads every other file


def test_a_programmatic_edge_that_is_no_edge_or_leaves_a_kernel_makes_the_plan_bad(
        plan_check, tmp_path):
    import struct

    from nimble.ir.saved_format import SavedFile

    path, plan = _saved_with_plan(tmp_path, programmatic=_kernel_edges(count=1))
    data = bytearray(SavedFile.read(path).extra["c_plan"])
    (u, v), = plan["buckets"][0]["programmatic"]
    words = struct.unpack_from(f"<{len(data) // 8}Q", data)
    # the pair's two words come right after the count 1, after the last edge
    at = next(i for i in range(len(words) - 2) if words[i:i + 3] == (1, u, v)
              and words[i - 2:i] == plan["buckets"][0]["edges"][-1])
    from test_c_plan import _stand_in

    from nimble.ir.taskgraph import TaskKind

    tasks = _stand_in("googlenet")[0].graph.tasks
    other = next((a, b) for a, b in plan["buckets"][0]["edges"]
                 if TaskKind.KERNEL not in (tasks[a].kind, tasks[b].kind)
                 or tasks[a].kind != tasks[b].kind)
    for changed in ((v, u), (u, u + 10**6), other):
        bad = bytearray(data)
        struct.pack_into("<2Q", bad, 8 * (at + 1), *changed)
        out = tmp_path / "bad.nimble"
        SavedFile({"format": "x"}, b"\0" * 64, extra={"c_plan": bytes(bad)}).write(out)
        rc, text = _run(plan_check, out)
        assert rc == 3, text


# ---- nimble_load on a fake driver, on the CPU ---------------------------------------------------

FAKE_SIZES = [40, 3 << 20, 1000, 200_000, 64, 5000, 1 << 20, 77, 300, 90_000, 12, 9 << 20]


@pytest.fixture(scope="module", params=["plain", "thread sanitizer"])
def fake_load(request, tmp_path_factory) -> Path:
    """tests/c_host/fake_driver.c linked with the whole runtime: nimble_load with its threads,
    on a driver of the test's own (no GPU); also built with ThreadSanitizer where the compiler
    and the machine run it."""
    cc, include = _toolchain()
    folder = tmp_path_factory.mktemp("fake")
    flags = ["-O2"] if request.param == "plain" else ["-O1", "-g", "-fsanitize=thread"]
    if request.param != "plain":
        probe = folder / "probe.c"
        probe.write_text("int main(void) { return 0; }\n")
        done = subprocess.run([cc, *flags, str(probe), "-o", str(folder / "probe")],
                              capture_output=True, text=True)
        if done.returncode != 0 or subprocess.run([str(folder / "probe")]).returncode != 0:
            pytest.skip("no ThreadSanitizer here")
    out = folder / "fake_driver"
    cmd = [cc, *flags, "-std=c11", "-pthread", "-Wall", "-Wextra", "-Werror", "-I",
           str(c_runtime.FOLDER), "-I", str(include), str(HOST.parent / "fake_driver.c"),
           *[str(c_runtime.FOLDER / s) for s in c_runtime.SOURCES], "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, " ".join(cmd) + "\n" + done.stderr
    return out


def _fake_saved(tmp_path, wrong_hashes=(), programmatic=(), version=None
                ) -> tuple[Path, dict]:
    """The branchy stand-in with 12 embedded binaries (FAKE_SIZES: one past the checksum's 8 MiB
    chunk) tagged for the fake driver, 40 kernels over them, the weights' bytes in the file; the
    binaries of ``wrong_hashes`` saved with another binary's hash; ``programmatic`` edges
    marked so in the plan, written as ``version`` where given.  (path, where things are)."""
    import hashlib
    import random

    from test_c_plan import _stand_in

    from nimble.engine.c_plan import c_plan
    from nimble.ir.saved_format import SavedFile

    rng = random.Random(0)
    prepared, state, manifest, *_ = _stand_in("branchy")
    prepared.programmatic = frozenset(programmatic)
    blobs = bytearray()

    def add(data: bytes) -> list[int]:
        at = len(blobs)
        blobs.extend(data + b"\0" * (-len(data) % 64))
        return [at, len(data)]
    binaries = []
    for i, size in enumerate(FAKE_SIZES):
        image = (f"BIN{i}\0".encode() + rng.randbytes(4096))[:size].ljust(size, b"\0")
        digest = hashlib.sha256(image + (b"x" if i in wrong_hashes else b"")).hexdigest()
        binaries.append({"kind": "embedded", "blob": add(image), "sha256": digest})
    kernels = [{**manifest["kernels"][0], "binary": rng.randrange(len(binaries)) if k else 0,
                "name": f"kernel{k}"} for k in range(40)]
    for w in manifest["weights"]:
        w["blob"] = add(rng.randbytes(w["size"]))
    manifest.update(binaries=binaries, kernels=kernels)
    with _every_edge_served(version):
        data, why = c_plan(manifest, [prepared], [state], state.size)
    assert why == ""
    path = SavedFile({"format": "nimble.saved-graph"}, bytes(blobs),
                     extra={"c_plan": data}).write(tmp_path / "fake.nimble")
    raw = path.read_bytes()
    where = {"blobs": raw.index(bytes(blobs[:64])), "plan": raw.index(data[:64]),
             "binaries": [b["blob"][0] for b in binaries],
             "weight": manifest["weights"][0]["blob"][0]}
    return path, where


def _fake_run(program: Path, path: Path, **env) -> tuple[int, list[str]]:
    import os

    done = subprocess.run([str(program), str(path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "FAKE_JITTER": "1", **env})
    assert "ThreadSanitizer" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines and lines[-1] == ("left: allocations 0 libraries 0 graphs 0 execs 0 contexts 0 "
                                   "wild 0 no-context 0"), done.stdout + done.stderr
    return done.returncode, lines


def test_a_load_takes_each_kernels_function_from_its_own_binary(fake_load, tmp_path):
    """One item per binary (read, hashed, loaded, its kernels' functions taken) over the
    threads, the binaries ending out of order: every kernel's function is its own binary's,
    and nimble_free leaves nothing behind."""
    path, _ = _fake_saved(tmp_path)
    for _ in range(3):
        rc, lines = _fake_run(fake_load, path)
        assert rc == 0 and lines[1].startswith("kernels 40 misplaced 0 edges "), lines
        assert lines[1].endswith(" programmatic 0") and not lines[1].startswith(
            "kernels 40 misplaced 0 edges 0 "), lines


def test_a_plans_programmatic_edges_are_built_as_full_dependencies_unless_asked(fake_load,
                                                                                tmp_path):
    """A plan of version 2 that marks edges programmatic (a graph prepared with programmatic
    launch) loads, and the runtime adds every edge, none of them programmatic; with
    NIMBLE_LOAD_PROGRAMMATIC the same edges, the marked ones (in every instance) given the
    programmatic type and port, as the Python loader builds them, except those out of a root
    (no edge ends in it), which stay full dependencies (wrong outputs built so on the GPU)."""
    from test_c_plan import _stand_in

    marked = _kernel_edges("branchy")
    prepared = _stand_in("branchy")[0]
    entered = {v for _, v in set(prepared.schedule.edges()) | set(prepared.late_edges)}
    built_programmatic = [(u, v) for u, v in marked if u in entered]
    assert marked and 0 < len(built_programmatic) < len(marked)  # a root's edge among them
    path, _ = _fake_saved(tmp_path, programmatic=marked)
    rc, lines = _fake_run(fake_load, path)
    assert rc == 0 and lines[1].startswith("kernels 40 misplaced 0 edges "), lines
    built = int(lines[1].split()[5])
    assert built > 0 and lines[1].endswith(" programmatic 0"), lines
    rc, lines = _fake_run(fake_load, path, FAKE_PROGRAMMATIC="1")
    assert rc == 0 and int(lines[1].split()[5]) == built, lines
    instances = _stand_in("branchy")[2]["instances"]
    assert lines[1].endswith(f" programmatic {len(built_programmatic) * instances}"), lines


def test_a_run_with_its_inputs_copies_each_into_its_slot_then_launches(fake_load, tmp_path):
    """nimble_run_with_inputs: each input's bytes copied from the caller's buffer to the
    address nimble_input_address names (inside the arena), then one launch; a NULL input
    pointer or a NULL list is refused with nothing queued (no run on half its inputs)."""
    path, _ = _fake_saved(tmp_path)
    rc, lines = _fake_run(fake_load, path, FAKE_RUN="1")
    assert rc == 0, lines
    import re

    run = next(line for line in lines if line.startswith("run: "))
    got = re.fullmatch(r"run: status (\d+) copies (\d+) bytes (\d+) launches (\d+) same (\d) "
                       r"\(of (\d+)\)", run)
    assert got, run
    status, copies, copied, launches, same, total = map(int, got.groups())
    assert (status, launches, same) == (0, 1, 1) and copies > 0 and copied == total > 0, run
    null = next(line for line in lines if line.startswith("null input: "))
    assert null.startswith("null input: status 1 queued 0: inputs[") and "is NULL" in null, null
    none = next(line for line in lines if line.startswith("no inputs: "))
    assert none.startswith("no inputs: status 1 queued 0: inputs is NULL"), none


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_plans_programmatic_edges_are_built_full_even_when_asked(fake_load, tmp_path,
                                                                          version):
    """A plan of version 2 or 3 may list the withdrawn rule's edges between Inductor's kernels:
    with NIMBLE_LOAD_PROGRAMMATIC too, every edge is a full dependency."""
    path, _ = _fake_saved(tmp_path, programmatic=_kernel_edges("branchy"), version=version)
    rc, lines = _fake_run(fake_load, path, FAKE_PROGRAMMATIC="1")
    assert rc == 0 and lines[1].endswith(" programmatic 0"), lines
    assert int(lines[1].split()[5]) > 0, lines


@pytest.mark.parametrize("where", ["binary", "plan", "section table", "weight"])
def test_a_damaged_files_checksum_error_wins_over_what_the_damage_did(fake_load, tmp_path,
                                                                      where):
    """The checksum runs beside the loading: a damaged file fails on it (status 3, its message)
    whatever else failed meanwhile (a binary's hash, the plan, the sections; a library's load,
    failed on purpose here too), and everything loaded by then is freed."""
    path, at = _fake_saved(tmp_path)
    raw = bytearray(path.read_bytes())
    if where == "binary":
        raw[at["blobs"] + at["binaries"][3] + 100] ^= 1
    elif where == "plan":
        raw[at["plan"]] ^= 1  # its magic
    elif where == "section table":
        struct.pack_into("<Q", raw, 64 + 48 * 2 + 16, 1 << 40)  # the c_plan section's offset
    else:
        raw[at["blobs"] + at["weight"]] ^= 1
    path.write_bytes(bytes(raw))
    rc, lines = _fake_run(fake_load, path, FAKE_FAIL_LIBRARY="5")
    assert rc == 3 and lines[0].endswith("is damaged: its checksum does not match"), lines


def test_the_first_failing_binary_in_binary_order_is_the_loads_error(fake_load, tmp_path):
    """Every binary's item runs to its end whatever the others do, and the error kept is the
    first failing binary's in binary order, however the items end: binary 3's hash here, not
    binary 7's nor binary 9's failed load."""
    path, at = _fake_saved(tmp_path, wrong_hashes=(3, 7))
    for _ in range(5):
        rc, lines = _fake_run(fake_load, path, FAKE_FAIL_LIBRARY="9")
        assert rc == 6 and f"binary at byte {at['binaries'][3]} of the file" in lines[0], lines
    path, _ = _fake_saved(tmp_path)
    rc, lines = _fake_run(fake_load, path, FAKE_FAIL_LIBRARY="9", FAKE_MISSING_KERNEL="kernel0")
    assert rc == 6 and "kernel kernel0 is not in the binary" in lines[0], lines  # binary 0's

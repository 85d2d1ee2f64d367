"""What a saved file's kernel binaries are, and how long the driver takes to load each: as the
file stores it (a library's whole fatbin container, or an embedded image), against a container
of only this GPU's ELF entry cut out of it (issue 49: would the C load's kernels stage shorten
if the file stored less?).  One thread, one process; every image loaded twice, the second
pass reported.

    python3 -m nimble save nasnetalarge --dtype float16 -o /tmp/n.nimble
    python3 tools/experiments/binary_load.py /tmp/n.nimble
"""
from __future__ import annotations

import argparse
import collections
import sys
import time


def own_arch_container(image: bytes, arch: int) -> bytes | None:
    """A container of ``image``'s ELF entry for ``arch`` alone (header and payload as they
    are, compressed or not); None where ``image`` is no container, has no such entry, or has
    nothing else."""
    from nimble.record import binaries as found

    listed = entries(image)
    mine = [e for e in listed if e.kind == found.ENTRY_KIND_ELF and e.arch == arch]
    if not mine or len(listed) == 1:
        return None
    body = image[mine[0].whole]
    return found.FATBIN_HEADER.pack(found.FATBIN_MAGIC, 1, found.FATBIN_HEADER.size,
                                    len(body)) + body


def entries(container: bytes) -> tuple:
    """The entries (``nimble.record.binaries.FatbinEntry``) of the fatbin container that
    starts ``container``; none where it starts no container."""
    from nimble.record import binaries as found

    found_here = found.fatbin_containers(container)
    return found_here[0].entries if found_here and found_here[0].offset == 0 else ()


def load_ms(image: bytes) -> float:
    from nimble.driver import Library

    t0 = time.perf_counter()
    library = Library.load_data(image)
    elapsed = time.perf_counter() - t0
    library.close()
    return elapsed * 1e3


def measure(path: str) -> list[str]:
    import torch

    from nimble.engine.kernel_loading import binary_bytes
    from nimble.ir.saved_format import SavedFile

    torch.zeros(1, device="cuda")  # the primary context, current
    saved = SavedFile.read(path)
    rows, arch = saved.manifest["binaries"], int(saved.manifest["arch"])
    images = [binary_bytes(r, saved) for r in rows]
    slim = [own_arch_container(i, arch) for i in images]
    for _ in range(2):
        as_is = [load_ms(i) for i in images]
        cut = [load_ms(s) if s is not None else t for s, t in zip(slim, as_is)]
    kinds = collections.Counter(r["kind"] for r in rows)
    cut_bytes = sum(len(s) if s is not None else len(i) for s, i in zip(slim, images))
    lines = [f"{path}: arch {arch}, {len(rows)} binaries {dict(kinds)}, "
             f"{sum(map(len, images))} bytes; {sum(s is not None for s in slim)} cut to this "
             f"GPU's entry: {cut_bytes} bytes",
             f"cuLibraryLoadData on one thread, summed: as stored {sum(as_is):.1f} ms, this "
             f"GPU's entry alone {sum(cut):.1f} ms"]
    for k in sorted(range(len(rows)), key=lambda k: -as_is[k])[:10]:
        listed = entries(images[k])
        lines.append(f"  {as_is[k]:7.2f} ms {cut[k]:7.2f} ms  {len(images[k]):9d} bytes  "
                     f"{rows[k].get('name', rows[k]['kind'])}  archs {[e.arch for e in listed]}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="a file nimble save wrote")
    args = p.parse_args(argv)
    print("\n".join(measure(args.file)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
